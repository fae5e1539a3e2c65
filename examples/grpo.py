"""GRPO on a real instruct model with its weights and optimizer states on NVMe: TRL's GRPOTrainer becomes
OffloadGRPOTrainer, its rollouts generated through the engine (docs/huggingface.md, "GRPO").

    python examples/grpo.py                      # SmolLM2-135M-Instruct (--model smollm2), LoRA r 16, 8 steps
    python examples/grpo.py --stock              # the same run with stock GRPOTrainer, the model in memory

The task: one-digit additions; the reward is checkable in code: 1 when the sum appears in the answer as a
number ("3 + 4 = 7", "The answer is 7"), 0 else. Prints the mean reward of each step and one
JSON line at the end ({"rewards": [...], "lengths": [...], "seconds": s}).
"""

import argparse
import json
import os
import random
import re
import tempfile
import time

import datasets
import torch
import transformers
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer

from offload.integrations.trl import OffloadGRPOTrainer
from offload.pretrained import resolve_model

NUMBER = re.compile(r"-?\d+")


def problems(n: int, seed: int = 0) -> datasets.Dataset:
    """n additions as chat prompts, with the sum each one asks for."""
    rng = random.Random(seed)
    rows = {"prompt": [], "total": []}
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows["prompt"].append([{"role": "user", "content": f"What is {a} + {b}? Answer with the number."}])
        rows["total"].append(a + b)
    return datasets.Dataset.from_dict(rows)


def reward(completions, total, **kw) -> list[float]:
    out = []
    for completion, want in zip(completions, total):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        out.append(1.0 if any(int(n) == want for n in NUMBER.findall(text)) else 0.0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="a packaged model (smollm2) or a Hugging Face directory")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--generations", type=int, default=4, help="completions per prompt (num_generations)")
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--nvme-path", default=None, help="directory for the swap files (default: a temporary one)")
    p.add_argument("--stock", action="store_true", help="stock GRPOTrainer, the model in memory (the reference)")
    args = p.parse_args()
    directory = resolve_model(args.model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(output_dir=os.path.join(tmp, "out"), per_device_train_batch_size=args.prompts * args.generations,
                            num_generations=args.generations, max_completion_length=args.max_new_tokens,
                            max_steps=args.steps, learning_rate=args.lr, logging_steps=1, report_to=[],
                            save_strategy="no", disable_tqdm=True, bf16=False, seed=0, beta=0.0, temperature=1.0,
                            dataloader_pin_memory=False)
        lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
        common = dict(model=model, reward_funcs=reward, args=config, train_dataset=problems(args.steps * args.prompts),
                      processing_class=tokenizer, peft_config=lora)
        if args.stock:
            trainer = GRPOTrainer(**common)
        else:
            swap = args.nvme_path or os.path.join(tmp, "swap")
            trainer = OffloadGRPOTrainer(**common, offload_config={
                "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}, "nvme_path": swap})
        t = time.perf_counter()
        try:
            trainer.train()
        finally:
            if not args.stock:
                trainer.close()
        seconds = time.perf_counter() - t
    logs = [h for h in trainer.state.log_history if "reward" in h]
    for i, h in enumerate(logs, 1):
        print(f"step {i:3d}  reward {h['reward']:.3f}  completion length {h['completions/mean_length']:.1f}")
    print(json.dumps({"rewards": [h["reward"] for h in logs], "lengths": [h["completions/mean_length"] for h in logs],
                      "seconds": seconds, "stock": args.stock}))


if __name__ == "__main__":
    main()
