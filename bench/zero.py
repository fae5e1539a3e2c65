"""ZeRO over ranks on one machine: our stages 0-3 beside DeepSpeed ZeRO-1, -2 and -3, each DeepSpeed row
against ours at the same stage and placement, side by side in the same run.

Each mode is one torchrun of --ranks processes (gloo, one thread each), one mode after the other, on the
same model (--preset, our seeding), the same global batch (ranks x --batch sequences of --seq tokens: rank
r's micro-batch i is the stream's batch i x ranks + r) and the same drive (--dir). A placement is
offload_param/offload_optimizer, in both engines' words: none (hbm: on CPUs, host memory as well), cpu
(dram), nvme.

  stage0_nvme               ours, zero_stage 0, nvme/nvme: every rank holds all weights and states
  stage1_nvme, stage2_nvme  ours, zero_stage 1 and 2, nvme/nvme: each rank holds and steps 1/ranks of the
                            states (the same here: the gradient accumulator lives with the states)
  stage1_dram, stage2_dram  the same, none/cpu: the weights whole on every rank, the states in dram
  stage3_nvme               ours, zero_stage 3, nvme/nvme: also 1/ranks of the weights, gathered per unit
  stage3_nvme_gather_on_use the same with zero_gather_ahead false: a unit's gather runs on the compute thread
                            when the unit is used, not ahead on the gather thread
  deepspeed_zero1_cpu       DeepSpeed ZeRO-1, offload_optimizer cpu (none/cpu)  -> stage1_dram
  deepspeed_zero2_cpu       DeepSpeed ZeRO-2, offload_optimizer cpu (none/cpu)  -> stage2_dram
  deepspeed_zero3_nvme      DeepSpeed ZeRO-3, offload_param and offload_optimizer nvme (nvme/nvme)
                            -> stage3_nvme, stage3_nvme_gather_on_use

DeepSpeed offloads the weights at stage 3 only, and at stages 1 and 2 takes an offload_optimizer nvme as
cpu, silently (bench/ds_e2e.py's [Note: DeepSpeed's placement by stage]): its rows are what it can do at
each stage, and a mode of ours is compared (`vs`, `vs_deepspeed`) only with the DeepSpeed row of its stage
and placement; stage0_nvme, stage1_nvme and stage2_nvme have none. DeepSpeed runs bench/ds_e2e.py --stage
in the DeepSpeed venv (bench/ds_venv.sh; --ds-python, else $OFFLOAD_DS_PYTHON, else
/work/dsvenv/bin/python); without one its rows are in `errors`, as is a mode that fails.

A step's time is the slowest rank's (a barrier before each step), the median of --steps after --warmup.
Our modes report, from the last step's stats, the all_gather's seconds (gather_s) and, where the engine
records it, the part the compute thread waited on (gather_exposed_s), the slowest rank's of each.
The physical limits measured in the same run: `offload bench nvme` on --dir gives the drive's bandwidth, and
our nvme modes' own nvme bytes of one step (all ranks together: they share the drive) over it give
io_bound_s; every mode, DeepSpeed's too, runs at --precision (default auto: what the engine picks on this
host), whose matmul GFLOP/s on this host (all its cores, which the ranks share) gives compute_floor_s =
6 x params x global batch tokens / matmul_gflops (bench/limits.py).

python bench/zero.py [--preset bench-200m] [--batch 2] [--seq 256] [--steps 3] [--warmup 1] [--ranks 2]
                     [--dir DIR] [--io-size 1G] [--precision auto|bf16|fp16|fp32] [--modes M,M,...] [--json]
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
from typing import NamedTuple

import iobound  # bench/, this script's directory, is first on sys.path
import limits
from ds_e2e import PLACEMENT
from e2e import add_run_arguments, default_ds_python, worker_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Mode(NamedTuple):
    stage: int
    offload_param: str       # none, cpu or nvme: where the weights live between uses
    offload_optimizer: str   # where the fp32 optimizer states live
    extra: tuple = ()        # our engine's other config keys, as (key, value) pairs


OURS = {
    "stage0_nvme": Mode(0, "nvme", "nvme"),
    "stage1_nvme": Mode(1, "nvme", "nvme"),
    "stage1_dram": Mode(1, "none", "cpu"),
    "stage2_nvme": Mode(2, "nvme", "nvme"),
    "stage2_dram": Mode(2, "none", "cpu"),
    "stage3_nvme": Mode(3, "nvme", "nvme"),
    "stage3_nvme_gather_on_use": Mode(3, "nvme", "nvme", (("zero_gather_ahead", False),)),
}
# DeepSpeed's rows: at each stage the placement it can do there (bench/ds_e2e.py).
DEEPSPEED = {f"deepspeed_zero{stage}_{opt}": Mode(stage, param, opt) for stage, (param, opt) in PLACEMENT.items()}
MODES = {**OURS, **DEEPSPEED}
ORDER = [m for stage in range(4) for m in MODES if MODES[m].stage == stage]  # each stage's rows together


def deepspeed_pair(mode: str) -> str | None:
    """The DeepSpeed row our `mode` is compared with: the same stage and placement; None where there is none."""
    placed = OURS[mode]._replace(extra=()) if mode in OURS else None
    return next((d for d, m in DEEPSPEED.items() if m == placed), None)


def worker(args) -> None:
    """One rank of one of our modes (under torchrun); rank 0 prints the mode's JSON line."""
    import torch.distributed as dist

    import offload
    from offload.data import BatchSampler, load_tokens
    from offload.models import build_model, loss_of
    from offload.state.ranks import reduced

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args.preset, seed=0)
    sampler = BatchSampler(load_tokens(), args.batch, args.seq, seed=0)
    mode = OURS[args.mode]
    t0 = time.perf_counter()
    engine = offload.initialize(model, {"precision": args.precision, "zero_stage": mode.stage, "nvme_path": args.dir,
                                        "offload_param": {"device": mode.offload_param},
                                        "offload_optimizer": {"device": mode.offload_optimizer},
                                        "optimizer": {"lr": 1e-4}, **dict(mode.extra)})
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
    gather = _gather_seconds(last["collectives"].get("all_gather"), reduced)
    params = sum(u.numel for u in engine.units)
    engine.close()
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"params": params, "step_s": sorted(times)[len(times) // 2], "losses": losses,
                          "init_s": init_s, "peak_rss_bytes": int(rss), "nvme_step_bytes": nvme, **gather,
                          "collectives": last["collectives"], "ranks": world}), flush=True)


def _gather_seconds(all_gather: dict | None, reduced) -> dict:
    """The slowest rank's all_gather seconds and exposed_s of one step (None where no rank has the figure).
    Every rank sends the same four numbers: one rank may lack a figure another has."""
    all_gather = all_gather or {}
    has = [float(k in all_gather) for k in ("seconds", "exposed_s")]
    seconds, exposed, has_seconds, has_exposed = reduced(
        [all_gather.get("seconds", 0.0), all_gather.get("exposed_s", 0.0), *has], "max")
    return {"gather_s": seconds if has_seconds else None, "gather_exposed_s": exposed if has_exposed else None}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mode(args, mode: str, base: str) -> dict:
    """One mode as a torchrun of args.ranks processes; its JSON line (the last on stdout)."""
    common = ["--preset", args.preset, "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
              "--warmup", str(args.warmup), "--dir", base, "--precision", args.precision]
    theirs = mode in DEEPSPEED
    python = args.ds_python if theirs else sys.executable
    script = os.path.join(REPO, "bench", "ds_e2e.py" if theirs else "zero.py")
    extra = ["--stage", str(DEEPSPEED[mode].stage)] if theirs else ["--worker", "--mode", mode]
    cmd = [os.path.join(os.path.dirname(python), "torchrun"), "--nproc-per-node", str(args.ranks), "--master-port",
           str(_free_port()), script, *common, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**worker_env(), "OMP_NUM_THREADS": "1"})
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode or not lines:
        errors = [x.strip() for x in proc.stderr.splitlines() if "Error:" in x]  # the exception, for the table
        raise RuntimeError(f"{mode}: exit {proc.returncode}" + (f": {errors[-1]}" if errors else "")
                           + f"\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(ap)
    ap.set_defaults(batch=2)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dir", default=None, help="directory on the drive to test (default: a temporary one)")
    ap.add_argument("--ds-python", default=default_ds_python())
    ap.add_argument("--modes", default=",".join(ORDER), help=f"comma-separated, of {', '.join(ORDER)}")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    iobound.add_io_arguments(ap)
    limits.add_precision_argument(ap)
    args = ap.parse_args()
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        ap.error(f"--modes={args.modes}: unknown {', '.join(unknown)}; choose from {', '.join(ORDER)}")
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
        if mode in DEEPSPEED and not args.ds_python:
            errors[mode] = "no DeepSpeed python (--ds-python; bench/ds_venv.sh creates one)"
            continue
        try:
            results[mode] = run_mode(args, mode, base)
        except RuntimeError as e:
            errors[mode] = str(e)
    out = {"preset": args.preset, "ranks": args.ranks, "global_batch": args.ranks * args.batch, "seq": args.seq,
           "precision": args.precision, "matmul_gflops": gflops, "swap": bw, "errors": errors,
           "modes": {m: _mode_report(m, r) for m, r in results.items()}}
    params = next((r["params"] for r in results.values() if r.get("params")), None)
    tokens = args.ranks * args.batch * args.seq
    out["compute_floor_s"] = limits.compute_floor_s(params, tokens, gflops) if params else None
    for m, r in out["modes"].items():
        ds = results.get(r["vs"] or "", {}).get("step_s")
        r["vs_deepspeed"] = r["step_s"] / ds if ds else None
        r["compute_floor_s"] = out["compute_floor_s"]
        if bw and r.get("nvme_step_bytes") and any(r["nvme_step_bytes"].values()):
            r["io_bound_s"] = iobound.io_bound_s(r["nvme_step_bytes"], bw)
            r["vs_io_bound"] = r["step_s"] / r["io_bound_s"]
    return out


def _mode_report(mode: str, r: dict) -> dict:
    """One mode's row: its figures, what it ran (stage, placement, engine config) and what it is compared with."""
    m = MODES[mode]
    out = {k: r.get(k) for k in ("step_s", "init_s", "peak_rss_bytes", "losses", "nvme_step_bytes", "gather_s",
                                 "gather_exposed_s", "collectives")}
    out.update(engine="deepspeed" if mode in DEEPSPEED else "ours", zero_stage=m.stage,
               offload_param=m.offload_param, offload_optimizer=m.offload_optimizer, vs=deepspeed_pair(mode))
    if mode in DEEPSPEED:   # what DeepSpeed was given, as it reports it
        out["deepspeed_config"] = {"deepspeed_version": r.get("deepspeed_version"), **r.get("zero_optimization", {})}
    else:
        out["engine_config"] = dict(m.extra)
    return out


def _print_table(report: dict) -> None:
    print(f"{report['preset']}, {report['ranks']} ranks, global batch {report['global_batch']} x {report['seq']}; "
          f"{report['precision']} matmul {report['matmul_gflops']:,.1f} GFLOP/s, compute floor "
          + (f"{report['compute_floor_s']:.2f} s" if report["compute_floor_s"] is not None else "-"))
    if report["swap"]:
        print(f"swap: read {report['swap']['swap_read_gbps']:.2f} GB/s, write {report['swap']['swap_write_gbps']:.2f} GB/s")
    print("placement: offload_param/offload_optimizer (none: hbm, cpu: dram); compared with: DeepSpeed's row of "
          "the same stage and placement; gather s, exposed: the last step's all_gather seconds, the part waited on")
    print(f"{'mode':26s} {'placement':>10s} {'step s':>8s} {'compared with':>21s} {'ratio':>6s} {'gather s':>8s} "
          f"{'exposed':>7s} {'io bound s':>10s} {'vs bound':>8s} {'peak RSS/rank':>13s}  losses")
    f = lambda v, width: f"{v:{width}.2f}" if v is not None else f"{'-':>{width}}"  # noqa: E731
    for m, r in report["modes"].items():
        print(f"{m:26s} {r['offload_param'] + '/' + r['offload_optimizer']:>10s} {r['step_s']:8.2f} "
              f"{r['vs'] or '-':>21s} {f(r.get('vs_deepspeed'), 6)} {f(r.get('gather_s'), 8)} "
              f"{f(r.get('gather_exposed_s'), 7)} {f(r.get('io_bound_s'), 10)} {f(r.get('vs_io_bound'), 8)} "
              f"{r['peak_rss_bytes'] / 1e9:11.2f} GB  " + " ".join(f"{x:.3f}" for x in r["losses"][:3]))
    for m, r in report["modes"].items():
        if r["engine"] == "deepspeed":
            c = r["deepspeed_config"]
            print(f"{m}: DeepSpeed {c['deepspeed_version']} zero_optimization stage {c['stage']}, offload_param "
                  f"{c['offload_param']}, offload_optimizer {c['offload_optimizer']}")
        elif r["engine_config"]:
            print(f"{m}: engine config {json.dumps(r['engine_config'])}")
    for m, e in report["errors"].items():
        print(f"{m}: not run: {e.splitlines()[0]}")


if __name__ == "__main__":
    main()
