"""DeepSpeed ZeRO-Inference: bench/generate.py's deepspeed mode. A Hugging Face directory's model under ZeRO-3
with offload_param on nvme (no optimizer), its own generate() on DeepSpeed's CPU accelerator, in fp32 as ours runs;
stage3_max_live_parameters holds --budget bytes of weights, what ours and accelerate get. Runs INSIDE a DeepSpeed
venv (bench/ds_venv.sh; DeepSpeed is never our dependency) and prints one JSON line per batch of --prompts (a JSON
file: {"batch": [[ids]]}): {"batch", "seconds", "tokens"}, the generate() of --new-tokens exactly, greedy, after an
untimed one of 2 new tokens (as bench/generate.py times ours).

  DS_ACCELERATOR=cpu PYTHONPATH=. /work/dsvenv/bin/python bench/ds_generate.py --model DIR --prompts FILE
      --new-tokens 64 --budget BYTES --dir DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time


def ds_config(nvme_dir: str, largest_numel: int, budget: int) -> dict:
    """ZeRO-3 in fp32, weights on nvme under nvme_dir, --budget bytes of live fp32 parameters; DeepSpeed's
    documented aio defaults (ds_e2e.ds_config's)."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": False,
                              "buffer_count": 5, "buffer_size": max(int(1e8), largest_numel)},
            "stage3_max_live_parameters": max(budget // 4, largest_numel),
            "stage3_prefetch_bucket_size": max(budget // 8, 1),
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                "overlap_events": True},
        "steps_per_print": 1 << 30,
    }


def run(args, emit) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from ds_e2e import _single_process_group  # bench/ is this script's directory, first on sys.path

    _single_process_group()
    import deepspeed
    import torch
    import transformers

    deepspeed.init_distributed(dist_backend="gloo")
    with open(args.prompts) as f:
        batches = json.load(f)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    largest = max(p.numel() for p in model.parameters())
    nvme_dir = os.path.join(args.dir, f"deepspeed-{os.getpid()}")
    os.makedirs(nvme_dir)
    try:
        engine, *_ = deepspeed.initialize(model=model, config=ds_config(nvme_dir, largest, args.budget))
        engine.module.eval()
        for batch, ids in batches.items():
            x = torch.tensor(ids)
            kw = {"attention_mask": torch.ones_like(x), "do_sample": False, "num_beams": 1, "pad_token_id": 0}
            with torch.no_grad():
                engine.module.generate(input_ids=x, max_new_tokens=2, min_new_tokens=2, **kw)
                t = time.perf_counter()
                out = engine.module.generate(input_ids=x, max_new_tokens=args.new_tokens,
                                             min_new_tokens=args.new_tokens, **kw)
                seconds = time.perf_counter() - t
            emit({"batch": int(batch), "seconds": seconds, "tokens": out[:, x.shape[1]:].tolist(),
                  "deepspeed_version": deepspeed.__version__})
        engine.destroy()
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face directory")
    ap.add_argument("--prompts", required=True, help='a JSON file {"batch": [[ids]]}')
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, required=True, help="bytes of live weights")
    ap.add_argument("--dir", required=True, help="the swap goes in a subdirectory")
    args = ap.parse_args()
    json_out = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)  # [Note: stdout] in bench/ds_e2e.py

    def emit(line: dict) -> None:
        json_out.write(json.dumps(line) + "\n")
        json_out.flush()

    run(args, emit)


if __name__ == "__main__":
    main()
