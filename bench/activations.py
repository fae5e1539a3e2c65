"""Long sequences: the memory and the step of activations kept four ways, side by side, per sequence length.

  none   no activation checkpointing: every layer's activations stay in memory until its backward
  hbm    activation_checkpointing: each unit keeps its inputs (in hbm) and runs its forward again in its backward
  dram   the same, the kept inputs in dram (offload_activations cpu), back ahead of their backward
  nvme   the same, the kept inputs on nvme (offload_activations nvme)

Each (sequence length, mode) runs in its own subprocess (its peak RSS its own), on the same model and data,
batch --batch; weights and optimizer states where --weights puts them (default dram: the activations are
what differs). Per run: the median step of --steps after --warmup, peak RSS, the hbm tier's accounted peak
(what the engine charges: fetched weights, gradients, kept inputs back for their backward) and the kept
inputs' hbm peak (engine.stats()["activations"]), the bytes moved and the time the backward waited for them.
Beside each step: the compute bound, (6, or 8 with the recompute) x params x tokens plus attention's causal
products, (3, or 4 with the recompute) x 2 x batch x seq^2 x d_model x layers (QK^T and PV over the half below
the diagonal), over the matmul GFLOP/s measured before and after the runs (bench/limits.py).
A run that fails (out of memory: killed) is reported with its error and the others go on.

python bench/activations.py [--preset bench-200m] [--seqs 2048,4096,8192,16384] [--batch 1]
                            [--modes none,hbm,dram,nvme] [--steps 1] [--warmup 1] [--dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import limits  # bench/, this script's directory, is first on sys.path
from e2e import REPO, worker_env

MODES = {"none": {}, "hbm": {"activation_checkpointing": True},
         "dram": {"activation_checkpointing": True, "offload_activations": {"device": "cpu"}},
         "nvme": {"activation_checkpointing": True, "offload_activations": {"device": "nvme"}}}
WEIGHTS = {"dram": "cpu", "nvme": "nvme", "hbm": "none"}


def run_one(args) -> dict:
    """In the subprocess: the preset at --seq, warmup + steps through the engine in --mode."""
    import torch

    import offload
    from offload.data import BatchSampler, load_tokens
    from offload.models import PRESETS, build_model, loss_of

    torch.manual_seed(0)
    model = build_model(dataclasses.replace(PRESETS[args.preset], max_seq_len=args.seq), seed=0)
    sampler = BatchSampler(load_tokens(), args.batch, args.seq, seed=0)
    params = sum(p.numel() for p in model.parameters())  # before the engine holds them
    home = WEIGHTS[args.weights]
    cfg = {"precision": args.precision, "offload_param": {"device": home}, "offload_optimizer": {"device": home},
           "nvme_path": args.dir, "optimizer": {"lr": 1e-4}, **MODES[args.mode]}
    times, losses = [], []
    with offload.initialize(model, cfg) as engine:
        for i in range(args.warmup + args.steps):
            ids, labels = sampler.batch(i)
            t0 = time.perf_counter()
            loss = loss_of(engine(ids, labels))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            del loss
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        stats = engine.stats()
    acts = stats["activations"]
    mc = PRESETS[args.preset]
    return {"params": params, "d_model": mc.d_model, "n_layers": mc.n_layers, "step_s": statistics.median(times),
            "losses": losses, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "hbm_tier_peak_bytes": stats["tiers"]["hbm"]["peak_bytes"],
            "inputs_hbm_peak_bytes": acts.get("inputs_peak_bytes", 0),
            "moved_out_bytes": acts.get("moved_out_bytes", 0), "unpack_wait_s": acts.get("unpack_wait_s", 0.0),
            "stall_seconds": stats["stall_seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench-200m")
    ap.add_argument("--seqs", default="2048,4096,8192,16384", help="comma-separated sequence lengths")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--weights", default="dram", choices=tuple(WEIGHTS),
                    help="where weights and optimizer states live in every mode (default dram)")
    ap.add_argument("--steps", type=int, default=1, help="measured steps (median reported)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--dir", default=None, help="swap directory (default: a temp dir in .)")
    limits.add_precision_argument(ap)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--seq", type=int, help=argparse.SUPPRESS)  # internal: one run in this process
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.precision = limits.resolve(args.precision)
    if args.mode:
        print(json.dumps(run_one(args)))
        return
    modes, seqs = args.modes.split(","), [int(s) for s in args.seqs.split(",")]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"--modes={args.modes}: {', '.join(unknown)} unknown; use some of {', '.join(MODES)}")
    base = args.dir or tempfile.mkdtemp(prefix="activations-", dir=".")
    try:
        report = _compare(args, base, seqs, modes)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    _print_table(report)
    if args.json:
        print(json.dumps(report))


def compute_flops(run: dict, batch: int, seq: int, recompute: bool) -> float:
    """The step's matmul work (module docstring): the linears' 6 (8 with the recompute) x params x tokens and
    attention's causal QK^T and PV, 2 x batch x seq^2 x d_model per layer forward, 3 (4) times."""
    passes = 4 if recompute else 3
    linears = (limits.FLOPS_PER_PARAM_TOKEN + (2 if recompute else 0)) * run["params"] * batch * seq
    return linears + passes * 2 * batch * seq * seq * run["d_model"] * run["n_layers"]


def _compare(args, base: str, seqs: list[int], modes: list[str]) -> dict:
    gflops = [limits.matmul_gflops(args.precision)]
    runs: dict[str, dict] = {}
    for seq in seqs:
        for mode in modes:
            cmd = [sys.executable, __file__, "--mode", mode, "--seq", str(seq), "--preset", args.preset,
                   "--batch", str(args.batch), "--weights", args.weights, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--dir", base, "--precision", args.precision]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=worker_env(), cwd=REPO)
            if proc.returncode:
                lines = proc.stderr.strip().splitlines()
                runs[f"{seq}/{mode}"] = {"error": lines[-1] if lines else f"exit {proc.returncode}"}
                print(f"seq {seq} {mode} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}", file=sys.stderr)
            else:
                runs[f"{seq}/{mode}"] = json.loads(proc.stdout.strip().splitlines()[-1])
    gflops.append(limits.matmul_gflops(args.precision))
    mean = sum(gflops) / len(gflops)
    for key, r in runs.items():
        if "error" in r:
            continue
        seq, mode = key.split("/")
        r["compute_bound_s"] = compute_flops(r, args.batch, int(seq), recompute=mode != "none") / (mean * 1e9)
        r["step_vs_bound"] = r["step_s"] / r["compute_bound_s"]
    for seq in seqs:  # the goal of issue 42: the step with the inputs on nvme against the step with them in hbm
        hbm, nvme = runs.get(f"{seq}/hbm", {}), runs.get(f"{seq}/nvme", {})
        if "step_s" in hbm and "step_s" in nvme:
            nvme["vs_hbm"] = nvme["step_s"] / hbm["step_s"]
    return {"preset": args.preset, "batch": args.batch, "weights": args.weights, "precision": args.precision,
            "matmul_gflops": mean, "matmul_gflops_before_after": gflops, "runs": runs}


def _print_table(report: dict) -> None:
    gib = 2 ** 30
    print(f"{report['preset']}, batch {report['batch']}, {report['precision']}, weights and states in "
          f"{report['weights']}; matmul {report['matmul_gflops']:.1f} GFLOP/s (before, after: "
          f"{', '.join(f'{g:.1f}' for g in report['matmul_gflops_before_after'])})")
    print("| seq | mode | step s | compute bound s | step / bound | nvme / hbm | peak RSS GiB | hbm tier peak GiB "
          "| kept inputs hbm peak GiB | moved out GiB | backward waited s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for key, r in report["runs"].items():
        seq, mode = key.split("/")
        if "error" in r:
            print(f"| {seq} | {mode} | failed: {r['error'][:80]} |")
            continue
        vs = f"{r['vs_hbm']:.2f}" if "vs_hbm" in r else ""
        print(f"| {seq} | {mode} | {r['step_s']:.2f} | {r['compute_bound_s']:.2f} | {r['step_vs_bound']:.2f} | {vs} "
              f"| {r['peak_rss_bytes'] / gib:.2f} | {r['hbm_tier_peak_bytes'] / gib:.3f} "
              f"| {r['inputs_hbm_peak_bytes'] / gib:.3f} | {r['moved_out_bytes'] / gib:.3f} | {r['unpack_wait_s']:.2f} |")


if __name__ == "__main__":
    main()
