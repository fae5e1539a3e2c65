"""DeepSpeed ZeRO-3 with NVMe offload of weights and optimizer states: bench/e2e.py's reference mode; with
--stage 1 or 2, DeepSpeed ZeRO-1 or -2 with the optimizer offloaded to cpu (bench/zero.py's rows per stage).

Runs INSIDE a DeepSpeed venv (never ours: DeepSpeed is not a dependency), with our package importable by
PYTHONPATH=<repo root>. It trains the model and batches e2e.py's other modes train (build_model(preset,
seed=0), BatchSampler(load_tokens(), batch, seq, seed=0).batch(i)) in a single-process gloo group on
DeepSpeed's CPU accelerator, and prints one JSON line: {"params", "step_s", "losses", "peak_rss_bytes"}.
Before it, as they happen (so a crash leaves them behind): {"params", "init_s"} once DeepSpeed is
initialized, then {"step", "step_s", "loss"} per step (bench/scale.py reads these).

  DS_ACCELERATOR=cpu PYTHONPATH=. /work/dsvenv/bin/python bench/ds_e2e.py --preset tiny --dir DIR [--stage 3]

(bench/ds_venv.sh creates that venv.)

Under torchrun (bench/zero.py) it trains data parallel over the ranks: rank r's micro-batch i is the
stream's batch i x ranks + r (as `offload train` slices it), a step's time is the slowest rank's, its loss
the mean over the ranks, its peak RSS the largest rank's; rank 0 prints.

With --zero-init the model is built inside deepspeed.zero.Init, DeepSpeed's way for a model larger than
memory: each module's parameters go to NVMe as it is constructed, and their values are DeepSpeed's draw,
not ours (bench/scale.py; e2e.py builds it whole, see [Note: same weights]). init_s then counts the
construction, as it is DeepSpeed's initialization; without it, deepspeed.initialize alone.

[Note: same weights] The model is built (and initialized by our seeding contract) before
deepspeed.initialize, and zero.Init is not used: DeepSpeed then converts the existing parameters into
ZeRO-3 partitions (casting them to bf16) without re-initializing them, so the first loss equals ours
within bf16 noise. The optimizer matches our engine's defaults: AdamW, lr 1e-4, betas (0.9, 0.999),
eps 1e-8, weight_decay 0 (DeepSpeedCPUAdam, since the optimizer is offloaded).

[Note: DeepSpeed's placement by stage] PLACEMENT is what DeepSpeed can do at each stage, in our
vocabulary (offload_param, offload_optimizer: none, cpu or nvme), read from DeepSpeed 0.19.8's source:
offload_param is "Valid only with stage 3" (runtime/zero/offload_config.py; stage_1_and_2.py never reads
it), and stages 1 and 2 take any offload_optimizer device other than none as cpu_offload=True
(stage_1_and_2.py): the states live in host memory and nvme_path is never used. Both without a word:
ZeRO-1 and -2 given offload_param and offload_optimizer nvme train with cpu_offload on, no optimizer
swapper and no file under nvme_path (measured). So they are run with offload_optimizer cpu, not a nvme
that would be a cpu in disguise, and the weights stay on the "device" (none), which on the CPU
accelerator is host memory too.

[Note: stdout] DeepSpeed and its JIT builds print to stdout, so file descriptor 1 is pointed at stderr
for the whole run and the JSON line goes to a copy of the original stdout, last.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import sys
import time

# zero stage -> (offload_param, offload_optimizer) devices: [Note: DeepSpeed's placement by stage]
PLACEMENT = {1: ("none", "cpu"), 2: ("none", "cpu"), 3: ("nvme", "nvme")}


def ds_config(batch: int, nvme_dir: str, largest_numel: int, sub_group_size: int = int(1e9),
              precision: str = "bf16", stage: int = 3) -> dict:
    """ZeRO-`stage` at `precision` (bf16, fp16 or fp32: neither section enabled), DeepSpeedCPUAdam; at stage 3
    weights and optimizer states on NVMe under nvme_dir, at 1 and 2 the optimizer states in cpu memory
    (PLACEMENT).

    [Note: DeepSpeed's host memory] The optimizer swapper keeps buffer_count (4) fp32 buffers of the
    largest sub-group: with the default sub_group_size (1e9) a 200M model is one sub-group, so 4 x 200M
    x 4 B = 3.2 GB; the parameter swapper keeps buffer_count x buffer_size bf16 (5 x 1e8 x 2 B = 1 GB).
    Both are DeepSpeed's defaults, what a user gets; --sub-group-size trades that memory for more,
    smaller optimizer swaps.
    """
    if stage not in PLACEMENT:
        raise ValueError(f"stage={stage}: DeepSpeed offloads at ZeRO stages 1, 2 and 3; pass one of those")
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage,
                              "offload_optimizer": {"device": PLACEMENT[stage][1], "pin_memory": False}},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if stage < 3:
        return config
    # DeepSpeed swaps each parameter whole through buffers of buffer_size elements: the largest
    # parameter must fit (the 3b preset's embedding does not fit the 1e8 default).
    config["zero_optimization"] = {
        "stage": 3,
        "sub_group_size": sub_group_size,
        "offload_param": {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": False,
                          "buffer_count": 5, "buffer_size": max(int(1e8), largest_numel)},
        "offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": False},
    }
    # DeepSpeed's documented defaults (1 MiB blocks, 8 in flight): what its NVMe tutorial starts from.
    config["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1,
                     "single_submit": False, "overlap_events": True}
    return config


def _single_process_group() -> None:
    """A world of one: gloo on 127.0.0.1 and a free port (DeepSpeed needs a process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0"})


def run(args, emit) -> dict:
    """Trains warmup + steps, emit()ting the init and each step as it happens; returns the summary."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        _single_process_group()
    import deepspeed
    import torch
    import torch.distributed as dist

    from offload.data import BatchSampler, load_tokens
    from offload.models import build_model, loss_of
    from offload.state.ranks import reduced

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank:
        emit = lambda line: None  # noqa: E731  rank 0 speaks
    shapes = build_model(args.preset, device="meta")   # sizes only: the buffers must fit the largest parameter
    params = sum(p.numel() for p in shapes.parameters())
    largest = max(p.numel() for p in shapes.parameters())
    sampler = BatchSampler(load_tokens(), args.batch, args.seq, seed=0)
    nvme_dir = os.path.join(args.dir, f"deepspeed-{os.getpid()}")
    os.makedirs(nvme_dir)
    try:
        config = ds_config(args.batch, nvme_dir, largest, args.sub_group_size, args.precision, args.stage)
        t0 = time.perf_counter()
        model = _build(args, config, deepspeed, build_model)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        if args.stage == 3 and getattr(model, "lm_head", 1) is None:  # tied head: embed.weight used outside embed
            deepspeed.zero.register_external_parameter(model, model.embed.weight)
        emit({"params": params, "init_s": time.perf_counter() - t0})
        times, losses = [], []
        for i in range(args.warmup + args.steps):
            ids, labels = sampler.batch(i * world + rank)
            dist.barrier()
            t0 = time.perf_counter()
            loss = loss_of(engine(ids, labels=labels))  # by name: a HF model's second argument is the mask
            engine.backward(loss)
            engine.step()
            seconds = reduced([time.perf_counter() - t0], "max")[0]  # the slowest rank's step
            losses.append(reduced([loss.item()])[0] / world)
            emit({"step": i, "step_s": seconds, "loss": losses[-1]})
            if i >= args.warmup:
                times.append(seconds)
        engine.destroy()
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)    # ours alone: created above, gigabytes of swap
    rss = reduced([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], "max")[0]
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return {"params": params, "step_s": sorted(times)[len(times) // 2], "losses": losses, "ranks": world,
            "peak_rss_bytes": int(rss),
            "deepspeed_version": deepspeed.__version__, "sub_group_size": args.sub_group_size,
            "zero_optimization": _placement_of(config)}


def _placement_of(config: dict) -> dict:
    """The run's ZeRO stage and offload devices (none where a section is absent), for the report."""
    zero = config["zero_optimization"]
    return {"stage": zero["stage"], **{k: zero.get(k, {}).get("device", "none")
                                       for k in ("offload_param", "offload_optimizer")}}


def _build(args, config: dict, deepspeed, build_model):
    """Our model: whole, from our weights ([Note: same weights]), or inside zero.Init with --zero-init."""
    import torch

    torch.manual_seed(0)
    if not args.zero_init:
        return build_model(args.preset, seed=0)       # our weights, before DeepSpeed sees the model
    with deepspeed.zero.Init(config_dict_or_path=config):  # remote_device: offload_param's (nvme)
        return build_model(args.preset, seed=0)


def main() -> None:
    from e2e import add_run_arguments  # bench/ is this script's directory, first on sys.path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(ap)
    ap.add_argument("--sub-group-size", type=int, default=int(1e9),
                    help="ZeRO-3 sub_group_size (DeepSpeed's default 1e9); see [Note: DeepSpeed's host memory]")
    ap.add_argument("--dir", default=".", help="directory on the drive to test; swap goes in a subdirectory")
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"),
                    help="DeepSpeed's precision (e2e.py passes the one its own modes run at)")
    ap.add_argument("--stage", type=int, default=3, choices=sorted(PLACEMENT),
                    help="ZeRO stage: 3 offloads weights and optimizer to nvme, 1 and 2 the optimizer to cpu "
                         "(what DeepSpeed can do at each; [Note: DeepSpeed's placement by stage])")
    ap.add_argument("--zero-init", action="store_true",
                    help="build the model inside deepspeed.zero.Init (a model larger than memory; DeepSpeed's weights)")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0:
        ap.error(f"--steps={args.steps} --warmup={args.warmup}: need steps >= 1 and warmup >= 0")
    if args.sub_group_size < 1:
        ap.error(f"--sub-group-size={args.sub_group_size}: must be >= 1; DeepSpeed's default is 1000000000")
    if args.zero_init and args.stage != 3:
        ap.error(f"--zero-init with --stage={args.stage}: deepspeed.zero.Init partitions weights, a stage 3 "
                 "thing; drop --zero-init or use --stage 3")
    if not os.path.isdir(args.dir):
        ap.error(f"--dir={args.dir}: not a directory; create it or pass an existing one")
    json_out = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)                                      # [Note: stdout]

    def emit(line: dict) -> None:
        json_out.write(json.dumps(line) + "\n")
        json_out.flush()

    result = run(args, emit)
    if os.environ.get("RANK", "0") == "0":
        emit(result)


if __name__ == "__main__":
    main()
