"""An Accelerate training loop with weights and optimizer states on NVMe: one call wraps the model.

    python examples/accelerate_offload.py                               # a tiny Llama, the bundled corpus
    python examples/accelerate_offload.py --nvme-path /mnt/nvme/swap --steps 200

`offload.integrations.accelerate.prepare` returns the engine (the model to call) and an optimizer whose
step is the engine's; `accelerator.prepare` passes both through, and `accelerator.backward` reaches the
engine. The Accelerator sets gradient accumulation and precision, the optimizer's param_groups the
learning rate (any torch LR scheduler), the offload config where states live. Prints one JSON line.
"""

import argparse
import json
import os
import tempfile

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup

from offload.data import ByteTokenizer, causal_lm_windows, load_tokens, split_tokens
from offload.integrations import accelerate as offload_accelerate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    p.add_argument("--nvme-path", default=None, help="directory for the swap files (default: a temporary one)")
    args = p.parse_args()

    gas = 2
    accelerator = Accelerator(gradient_accumulation_steps=gas)
    train_tokens, _ = split_tokens(load_tokens())   # the bundled corpus, byte-level tokens
    loader = torch.utils.data.DataLoader(causal_lm_windows(train_tokens, 8 * gas * args.steps, 64, seed=0), batch_size=8)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=ByteTokenizer.vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))

    with tempfile.TemporaryDirectory() as tmp:
        engine, optimizer = offload_accelerate.prepare(accelerator, model, offload_config={   # offload
            "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"},
            "nvme_path": args.nvme_path or os.path.join(tmp, "swap"),
            "units": {"classes": ["LlamaDecoderLayer"]},
            "optimizer": {"lr": 3e-3}, "gradient_clipping": 1.0,
        })
        scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=5, num_training_steps=args.steps)
        engine, optimizer, loader, scheduler = accelerator.prepare(engine, optimizer, loader, scheduler)
        losses, window_loss = [], 0.0
        try:
            for batch in loader:
                with accelerator.accumulate(engine):
                    loss = engine(**batch).loss
                    accelerator.backward(loss)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                window_loss += loss.item() / gas
                if accelerator.sync_gradients:
                    losses.append(window_loss)
                    window_loss = 0.0
            steps = engine.step_count
        finally:
            engine.close()                                 # removes the swap files
    print(json.dumps({"steps": steps, "first_loss": losses[0], "last_loss": losses[-1]}))


if __name__ == "__main__":
    main()
