"""A Hugging Face Trainer script with weights and optimizer states on NVMe: Trainer becomes OffloadTrainer.

    python examples/trainer_offload.py                                  # a tiny Llama, the bundled corpus
    python examples/trainer_offload.py --nvme-path /mnt/nvme/swap --steps 200 --bf16

Everything else is an ordinary Trainer script: TrainingArguments set the learning rate and its schedule,
warmup, clipping, gradient accumulation and precision; the offload config only says where states live
(it may also be a DeepSpeed JSON config). Prints one JSON line at the end.
"""

import argparse
import json
import os
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from offload.data import ByteTokenizer, causal_lm_windows, load_tokens, split_tokens
from offload.integrations.transformers import OffloadTrainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    p.add_argument("--nvme-path", default=None, help="directory for the swap files (default: a temporary one)")
    p.add_argument("--bf16", action="store_true", help="train in bf16 (default fp32)")
    args = p.parse_args()
    if args.steps < 1:
        p.error(f"--steps={args.steps}: must be at least 1")

    train_tokens, val_tokens = split_tokens(load_tokens())   # the bundled corpus, byte-level tokens
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=ByteTokenizer.vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))

    with tempfile.TemporaryDirectory() as tmp:
        training_args = TrainingArguments(
            output_dir=os.path.join(tmp, "out"), max_steps=args.steps, per_device_train_batch_size=8,
            gradient_accumulation_steps=2, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=5,
            max_grad_norm=1.0, bf16=args.bf16, use_cpu=not torch.cuda.is_available(),
            logging_steps=max(1, min(5, args.steps // 2)),   # a short run logs its loss too
            eval_strategy="steps", eval_steps=max(1, args.steps // 2), per_device_eval_batch_size=8,
            save_strategy="no",      # or save_steps=N: checkpoint-N dirs that resume_from_checkpoint continues
            report_to=[], dataloader_pin_memory=False)
        offload_config = {
            "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"},
            "nvme_path": args.nvme_path or os.path.join(tmp, "swap"),
            "units": {"classes": ["LlamaDecoderLayer"]},   # one unit (moved as one buffer) per decoder layer
        }
        trainer = OffloadTrainer(model=model, args=training_args, offload_config=offload_config,
                                 train_dataset=causal_lm_windows(train_tokens, 16 * args.steps, 64, seed=0),
                                 eval_dataset=causal_lm_windows(val_tokens, 32, 64, seed=1))
        try:
            trainer.train()
            eval_loss = trainer.evaluate()["eval_loss"]
            trainer.save_model(os.path.join(tmp, "model"))   # HF weights: from_pretrained loads them
            reloaded = LlamaForCausalLM.from_pretrained(os.path.join(tmp, "model"))
        finally:
            trainer.close()                                   # removes the swap files
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(json.dumps({"steps": trainer.state.global_step, "first_loss": losses[0], "last_loss": losses[-1],
                      "eval_loss": eval_loss, "saved_params": reloaded.num_parameters()}))


if __name__ == "__main__":
    main()
