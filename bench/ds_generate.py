"""DeepSpeed ZeRO-Inference: bench/generate.py's deepspeed mode. A Hugging Face directory's model under ZeRO-3
with offload_param on nvme (no optimizer), its own generate() on DeepSpeed's CPU accelerator, at --precision as ours;
stage3_max_live_parameters holds --budget bytes of weights, what ours and accelerate get. Runs INSIDE a DeepSpeed
venv (bench/ds_venv.sh; DeepSpeed is never our dependency) and prints one JSON line per batch of --prompts (a JSON
file: {"batch": [[ids]]}): {"batch", "seconds", "tokens"}, the generate() of --new-tokens exactly, greedy, after an
untimed one of 2 new tokens (as bench/generate.py times ours).

  DS_ACCELERATOR=cpu PYTHONPATH=. /work/dsvenv/bin/python bench/ds_generate.py --model DIR --prompts FILE
      --new-tokens 64 --budget BYTES --dir DIR [--precision fp32]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time


def ds_config(nvme_dir: str, largest_numel: int, budget: int, precision: str) -> dict:
    """ZeRO-3 at `precision`, weights on nvme under nvme_dir, --budget bytes of live parameters; DeepSpeed's
    documented aio defaults (ds_e2e.ds_config's)."""
    itemsize = 4 if precision == "fp32" else 2
    return {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": False,
                              "buffer_count": 5, "buffer_size": max(int(1e8), largest_numel)},
            "stage3_max_live_parameters": max(budget // itemsize, largest_numel),
            "stage3_prefetch_bucket_size": max(budget // (2 * itemsize), 1),
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                "overlap_events": True},
        "steps_per_print": 1 << 30,
    }


def keep_dtype(deepspeed) -> None:
    """DeepSpeed 0.19.8's zero.Init._set_dtype drops the dtype it is given where the accelerator lacks fp16 (the CPU
    one): `dtype or torch.float16 if fp16 else torch.bfloat16 if ...` parses as `(dtype or fp16) if fp16 else bf16`
    (runtime/zero/partition_parameters.py:409), so the partitioned weights of an fp32 model become bf16 beside fp32
    activations and the first matmul fails. Given a config, the same method reads the precision from it; the bench
    makes it do so, which runs DeepSpeed at the precision its config names (ours)."""
    from deepspeed.runtime.zero.partition_parameters import Init

    original = Init._set_dtype

    def _set_dtype(self, ds_config, dtype):
        original(self, ds_config, None if ds_config is not None else dtype)

    Init._set_dtype = _set_dtype


def run(args, emit) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from ds_e2e import _single_process_group  # bench/ is this script's directory, first on sys.path

    _single_process_group()
    import deepspeed
    import torch
    import transformers

    deepspeed.init_distributed(dist_backend="gloo")
    keep_dtype(deepspeed)
    with open(args.prompts) as f:
        batches = json.load(f)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    from offload.step.generation import contiguous_head  # as ours and the in-memory model (bench/generate.py)

    contiguous_head(model)
    largest = max(p.numel() for p in model.parameters())
    nvme_dir = os.path.join(args.dir, f"deepspeed-{os.getpid()}")
    os.makedirs(nvme_dir)
    try:
        engine, *_ = deepspeed.initialize(model=model, config=ds_config(nvme_dir, largest, args.budget, args.precision))
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
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
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
