"""ZeRO over ranks on one machine: our stages 0, 2 and 3 against DeepSpeed ZeRO-3, weights and optimizer
states on nvme, side by side in the same run.

Each mode is one torchrun of --ranks processes (gloo, one thread each), one mode after the other, on the
same model (--preset, our seeding), the same global batch (ranks x --batch sequences of --seq tokens: rank
r's micro-batch i is the stream's batch i x ranks + r) and the same drive (--dir):

  stage0_nvme           our engine, zero_stage 0: every rank holds all weights and states (on nvme)
  stage2_nvme           our engine, zero_stage 2: each rank holds and steps 1/ranks of the states (on nvme)
  stage3_nvme           our engine, zero_stage 3: also 1/ranks of the weights, gathered per unit when used
  deepspeed_zero3_nvme  DeepSpeed ZeRO-3, offload_param and offload_optimizer nvme (bench/ds_e2e.py in the
                        DeepSpeed venv: --ds-python, else $OFFLOAD_DS_PYTHON, else /work/dsvenv/bin/python;
                        skipped, and reported null, when there is none)

A step's time is the slowest rank's (a barrier before each step), the median of --steps after --warmup.
The physical limits measured in the same run: `offload bench nvme` on --dir gives the drive's bandwidth, and
our modes' own nvme bytes of one step (all ranks together: they share the drive) over it give io_bound_s;
every mode runs at --precision (default auto: what the engine picks on this host), whose matmul GFLOP/s on
this host (all its cores, which the ranks share) gives compute_floor_s = 6 x params x global batch tokens /
matmul_gflops (bench/limits.py).
stage3_nvme is the same partitioning as DeepSpeed's ZeRO-3; stages 0 and 2 show what it costs and saves.

python bench/zero.py [--preset bench-200m] [--batch 2] [--seq 256] [--steps 3] [--warmup 1] [--ranks 2]
                     [--dir DIR] [--io-size 1G] [--precision auto|bf16|fp16|fp32] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import iobound  # bench/, this script's directory, is first on sys.path
import limits
from e2e import add_run_arguments, default_ds_python, worker_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = {"stage0_nvme": 0, "stage2_nvme": 2, "stage3_nvme": 3}
DS_MODE = "deepspeed_zero3_nvme"


def worker(args) -> None:
    """One rank of one of our modes (under torchrun); rank 0 prints the mode's JSON line."""
    import torch.distributed as dist

    import offload
    from offload.data import BatchSampler, load_tokens
    from offload.models import build_model, loss_of
    from offload.ranks import reduced

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args.preset, seed=0)
    sampler = BatchSampler(load_tokens(), args.batch, args.seq, seed=0)
    t0 = time.perf_counter()
    engine = offload.initialize(model, {"precision": args.precision, "zero_stage": OURS[args.mode], "nvme_path": args.dir,
                                        "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"},
                                        "optimizer": {"lr": 1e-4}})
    init_s = time.perf_counter() - t0
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        ids, labels = sampler.batch(i * world + rank)
        dist.barrier()
        t0 = time.perf_counter()
        loss = loss_of(engine(ids, labels=labels))
        engine.backward(loss)
        engine.step()
        seconds = reduced([time.perf_counter() - t0], "max")[0]  # the slowest rank's step
        losses.append(reduced([loss.item()])[0] / world)
        if i >= args.warmup:
            times.append(seconds)
    last = engine.stats()["last_step"]
    nvme = {k: int(reduced([float(v)])[0]) for k, v in iobound.step_nvme_bytes(last["links"]).items()}
    rss = reduced([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], "max")[0]
    params = sum(u.numel for u in engine.units)
    engine.close()
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"params": params, "step_s": sorted(times)[len(times) // 2], "losses": losses,
                          "init_s": init_s, "peak_rss_bytes": int(rss), "nvme_step_bytes": nvme,
                          "collectives": last["collectives"], "ranks": world}), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mode(args, mode: str, base: str) -> dict:
    """One mode as a torchrun of args.ranks processes; its JSON line (the last on stdout)."""
    common = ["--preset", args.preset, "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
              "--warmup", str(args.warmup), "--dir", base, "--precision", args.precision]
    python = args.ds_python if mode == DS_MODE else sys.executable
    script = os.path.join(REPO, "bench", "ds_e2e.py" if mode == DS_MODE else "zero.py")
    extra = [] if mode == DS_MODE else ["--worker", "--mode", mode]
    cmd = [os.path.join(os.path.dirname(python), "torchrun"), "--nproc-per-node", str(args.ranks), "--master-port",
           str(_free_port()), script, *common, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**worker_env(), "OMP_NUM_THREADS": "1"})
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{mode}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(ap)
    ap.set_defaults(batch=2)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dir", default=None, help="directory on the drive to test (default: a temporary one)")
    ap.add_argument("--ds-python", default=default_ds_python())
    ap.add_argument("--modes", default=",".join([*OURS, DS_MODE]))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    iobound.add_io_arguments(ap)
    limits.add_precision_argument(ap)
    args = ap.parse_args()
    args.precision = limits.resolve(args.precision)  # the ranks and DeepSpeed get the one that runs
    if args.worker:
        return worker(args)
    base = tempfile.mkdtemp(prefix="offload-bench-zero-", dir=args.dir)
    try:
        report = _run(args, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)  # ours alone: created above, gigabytes of swap
    if args.json:
        print(json.dumps(report))
    else:
        _print_table(report)


def _run(args, base: str) -> dict:
    bw = iobound.measure_swap(base, args.io_size, {}) if args.io_size else None
    gflops = limits.matmul_gflops(args.precision)
    results, errors = {}, {}
    for mode in args.modes.split(","):
        if mode == DS_MODE and not args.ds_python:
            errors[mode] = "no DeepSpeed python (--ds-python)"
            continue
        try:
            results[mode] = run_mode(args, mode, base)
        except RuntimeError as e:
            errors[mode] = str(e)
    ds = results.get(DS_MODE, {}).get("step_s")
    out = {"preset": args.preset, "ranks": args.ranks, "global_batch": args.ranks * args.batch, "seq": args.seq,
           "precision": args.precision, "matmul_gflops": gflops, "swap": bw, "errors": errors,
           "modes": {m: {k: r.get(k) for k in ("step_s", "init_s", "peak_rss_bytes", "losses", "nvme_step_bytes",
                                               "collectives")} for m, r in results.items()}}
    params = next((r["params"] for r in results.values() if r.get("params")), None)
    tokens = args.ranks * args.batch * args.seq
    out["compute_floor_s"] = limits.compute_floor_s(params, tokens, gflops) if params else None
    for m, r in out["modes"].items():
        r["vs_deepspeed"] = r["step_s"] / ds if ds and m != DS_MODE else None
        r["compute_floor_s"] = out["compute_floor_s"]
        if bw and r.get("nvme_step_bytes"):
            r["io_bound_s"] = iobound.io_bound_s(r["nvme_step_bytes"], bw)
            r["vs_io_bound"] = r["step_s"] / r["io_bound_s"]
    return out


def _print_table(report: dict) -> None:
    print(f"{report['preset']}, {report['ranks']} ranks, global batch {report['global_batch']} x {report['seq']}; "
          f"{report['precision']} matmul {report['matmul_gflops']:,.1f} GFLOP/s, compute floor "
          + (f"{report['compute_floor_s']:.2f} s" if report["compute_floor_s"] is not None else "-"))
    if report["swap"]:
        print(f"swap: read {report['swap']['swap_read_gbps']:.2f} GB/s, write {report['swap']['swap_write_gbps']:.2f} GB/s")
    print(f"{'mode':24s} {'step s':>8s} {'vs DS':>7s} {'io bound s':>10s} {'vs bound':>8s} {'peak RSS/rank':>13s}  losses")
    for m, r in report["modes"].items():
        f = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        print(f"{m:24s} {r['step_s']:8.2f} {f(r.get('vs_deepspeed'), '7.2f')} {f(r.get('io_bound_s'), '10.2f')} "
              f"{f(r.get('vs_io_bound'), '8.2f')} {r['peak_rss_bytes'] / 1e9:11.2f} GB  "
              + " ".join(f"{x:.3f}" for x in r["losses"][:3]))
    for m, e in report["errors"].items():
        print(f"{m}: not run: {e.splitlines()[0]}")


if __name__ == "__main__":
    main()
