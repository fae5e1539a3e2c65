"""End-to-end training step time: in-memory vs cpu offload vs nvme offload, side by side.

Each mode runs in its own subprocess (so its peak RSS is its own), one after the other, on the same
model, batch and disk; the figures that matter are the ratios to the in-memory step of the same run.

  in_memory    plain torch: the model in the compute dtype, fp32 masters, torch.optim.AdamW(fused=True), copy
               back (at fp32: AdamW on the model's own parameters)
  cpu_offload  offload engine: weights and optimizer states in dram (offload_param/optimizer = cpu)
  nvme_offload offload engine: weights and optimizer states on nvme
  deepspeed_nvme  DeepSpeed ZeRO-3, weights and optimizer states on nvme (bench/ds_e2e.py, run by the
               DeepSpeed venv's python: --ds-python, else $OFFLOAD_DS_PYTHON, else /work/dsvenv/bin/python
               if it exists; skipped, and reported null, when there is none)

The step's I/O bound (bench/iobound.py) is measured in the same run, before the modes: `offload bench nvme`
moves --io-size bytes in the same --dir, and the nvme_offload step's own nvme bytes over that bandwidth give
io_bound_s = bytes read / read bandwidth + bytes written / write bandwidth; the table shows
nvme step / max(in-memory step, io bound), the figure issue 12 asks to bring to 1.15.
Every mode runs at --precision (default auto: what the engine picks on this host); beside io_bound_s the
JSON has precision, matmul_gflops (that dtype's F.linear speed, the mean of a measurement before and one
after the modes) and compute_floor_s (bench/limits.py).

python bench/e2e.py [--preset bench-200m] [--batch 4] [--seq 256] [--steps 3] [--rounds 1] [--dir DIR]
                    [--io-size 2G] [--precision auto|bf16|fp16|fp32] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import iobound  # bench/, this script's directory, is first on sys.path
import limits

MODES = ("in_memory", "cpu_offload", "nvme_offload")
DS_MODE = "deepspeed_nvme"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_mode(args) -> dict:
    """In the subprocess: build the model, train warmup + steps, return step times and peak RSS."""
    import torch


    import offload
    from offload.data import BatchSampler, load_tokens
    from offload.models import build_model, loss_of

    torch.manual_seed(0)
    model = build_model(args.preset, seed=0)
    sampler = BatchSampler(load_tokens(), args.batch, args.seq, seed=0)
    params = sum(p.numel() for p in model.parameters())
    if args.mode == "in_memory":
        step = _plain_step(model, torch, args.precision)
    else:
        dev = "cpu" if args.mode == "cpu_offload" else "nvme"
        engine = offload.initialize(model, {"precision": args.precision, "offload_param": {"device": dev},
                                            "offload_optimizer": {"device": dev}, "nvme_path": args.dir,
                                            "optimizer": {"lr": 1e-4}, **json.loads(args.engine_config)})

        def step(ids, labels):
            loss = loss_of(engine(ids, labels))
            engine.backward(loss)
            engine.step()
            return loss.item()

    times, losses, stall0 = [], [], 0.0
    for i in range(args.warmup + args.steps):
        ids, labels = sampler.batch(i)
        if i == args.warmup and args.mode != "in_memory":
            stall0 = engine.stats()["stall_seconds"]
        t0 = time.perf_counter()
        losses.append(step(ids, labels))
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    out = {"params": params, "step_s": sorted(times)[len(times) // 2], "losses": losses,
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if args.mode != "in_memory":
        stats = engine.stats()
        out["stall_seconds"] = (stats["stall_seconds"] - stall0) / args.steps  # per measured step
        out["links"] = stats["last_step"]["links"]  # bytes per link in the last step: what the step moved
        engine.close()
    return out


def _plain_step(model, torch, precision: str):
    """Plain torch at `precision`: fp32 masters beside a low-precision model, or (fp32) AdamW on the model."""
    from offload.models import loss_of
    from offload.plan.precision import DTYPES

    params = [p for p in model.parameters() if p.requires_grad]
    if precision == "fp32":
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)

        def step(ids, labels):
            loss = loss_of(model(ids, labels))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

        return step
    for p in model.parameters():
        p.data = p.data.to(DTYPES[precision])
    masters = [p.detach().float().clone() for p in params]
    opt = torch.optim.AdamW(masters, lr=1e-4, fused=True)

    def step(ids, labels):
        loss = loss_of(model(ids, labels))
        loss.backward()
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        return loss.item()

    return step


def add_run_arguments(ap: argparse.ArgumentParser) -> None:
    """The run's shape, shared with bench/ds_e2e.py so every mode runs the same job."""
    ap.add_argument("--preset", default="bench-200m")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="measured steps (median reported)")
    ap.add_argument("--warmup", type=int, default=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(ap)
    ap.add_argument("--dir", default=None, help="swap directory on the drive to test (default: a temp dir in .)")
    ap.add_argument("--modes", default=None, help=f"comma-separated, of {', '.join(MODES + (DS_MODE,))} "
                    "(default: all; deepspeed_nvme only where a DeepSpeed python is found)")
    ap.add_argument("--ds-python", default=default_ds_python(),
                    help="python of a venv with DeepSpeed, for the deepspeed_nvme mode")
    add_engine_config_argument(ap)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every mode this many times, in turn (round-robin), and report each mode's median "
                         "round: the host's drift then reaches every mode alike (default 1)")
    iobound.add_io_arguments(ap)
    limits.add_precision_argument(ap)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--mode", help=argparse.SUPPRESS)  # internal: run one mode in this process
    args = ap.parse_args()
    args.precision = limits.resolve(args.precision)  # every mode, and the DeepSpeed run, at the same one
    if args.mode:
        print(json.dumps(run_mode(args)))
        return
    if args.rounds < 1:
        ap.error(f"--rounds={args.rounds}: must be >= 1")
    base = args.dir or tempfile.mkdtemp(prefix="e2e-", dir=".")
    try:
        _compare(args, base)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)  # ours: a tree of swap files the modes left, if any


def _compare(args, base: str) -> None:
    modes = args.modes.split(",") if args.modes else list(MODES) + ([DS_MODE] if args.ds_python else [])
    if DS_MODE in modes and not args.ds_python:
        sys.exit(f"--modes={args.modes}: {DS_MODE} needs a DeepSpeed venv; pass --ds-python PATH")
    # Before the modes: a --dir that cannot hold the swap fails in seconds, not after the in-memory run.
    bw = (iobound.measure_swap(base, args.io_size, json.loads(args.engine_config))
          if "nvme_offload" in modes and args.io_size else None)
    errors, gflops = {}, [limits.matmul_gflops(args.precision)]
    runs: list[dict] = []  # one {mode: result} per round, the modes in turn within each round
    for _ in range(args.rounds):
        runs.append({})
        for mode in [m for m in modes if m not in errors]:
            proc = _run_in_subprocess(args, mode, base)
            if proc.returncode:  # keep the other modes' figures; say what failed and exit non-zero at the end
                errors[mode] = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
                print(f"{mode} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
            else:
                runs[-1][mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    gflops.append(limits.matmul_gflops(args.precision))
    results = _median_of_rounds(runs)
    report = {**_report(args, results, errors), **_io_report(results, bw)}
    report.update(_compute_report(args, report, gflops))
    report["rounds"] = [{m: r["step_s"] for m, r in rnd.items()} for rnd in runs]
    _print_table(report, results)
    if args.json:
        print(json.dumps(report))
    if errors:
        sys.exit(1)


def _run_in_subprocess(args, mode: str, base: str) -> subprocess.CompletedProcess:
    """One mode in its own process (its peak RSS its own): ours through this file, DeepSpeed's through
    bench/ds_e2e.py in the DeepSpeed venv; the result is the last stdout line, as JSON."""
    common = ["--preset", args.preset, "--batch", str(args.batch), "--seq", str(args.seq),
              "--steps", str(args.steps), "--warmup", str(args.warmup), "--dir", base, "--precision", args.precision]
    cmd = ([args.ds_python, os.path.join(REPO, "bench", "ds_e2e.py")] + common if mode == DS_MODE
           else [sys.executable, __file__, "--mode", mode, "--engine-config", args.engine_config] + common)
    return subprocess.run(cmd, capture_output=True, text=True, env=worker_env())


def worker_env() -> dict:
    """The environment of a benchmark's subprocess: this checkout's packages, DeepSpeed on its CPU accelerator."""
    return {**os.environ, "PYTHONPATH": REPO, "DS_ACCELERATOR": "cpu"}


def add_engine_config_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--engine-config", default="{}", type=_json_object, metavar="JSON",
                    help='extra config keys for our engine, e.g. \'{"gradient_clipping": 1.0, "delayed_update": true}\'')


def _json_object(text: str) -> str:
    """argparse type: the text itself (it is passed on to subprocesses), once it parses as a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}; pass a JSON object of config keys") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: not an object; pass a JSON object of config keys")
    return text


def _median_of_rounds(runs: list[dict]) -> dict:
    """Per mode: the round with the median step time (the faster middle one of an even count; its losses,
    stall and step) and the largest peak RSS over the rounds.
    With one round, that round."""
    out = {}
    for mode in dict.fromkeys(m for rnd in runs for m in rnd):
        mine = sorted((rnd[mode] for rnd in runs if mode in rnd), key=lambda r: r["step_s"])
        out[mode] = {**mine[(len(mine) - 1) // 2], "peak_rss_bytes": max(r["peak_rss_bytes"] for r in mine)}
    return out


def _compute_report(args, report: dict, gflops: list[float]) -> dict:
    """The compute floor beside the I/O bound (bench/limits.py). The matmul speed is measured before and
    after the modes: the step is mostly these products, so the ratios to DeepSpeed (whose NVMe cost does
    not scale with them) move with it; the floor uses their mean."""
    mean = sum(gflops) / len(gflops)
    floor = limits.compute_floor_s(report["params"], report["tokens_per_step"], mean) if report["params"] else None
    return {"precision": args.precision, "matmul_gflops": mean, "matmul_gflops_before_after": gflops,
            "compute_floor_s": floor}


def default_ds_python() -> str | None:
    """A DeepSpeed venv's python: $OFFLOAD_DS_PYTHON, else /work/dsvenv/bin/python if it exists, else None."""
    path = "/work/dsvenv/bin/python"
    return os.environ.get("OFFLOAD_DS_PYTHON") or (path if os.path.exists(path) else None)


def _report(args, results: dict, errors: dict) -> dict:
    ref = results.get("in_memory", {}).get("step_s")
    first = next(iter(results.values()), {})
    return {
        "preset": args.preset, "params": first.get("params"), "tokens_per_step": args.batch * args.seq,
        "in_memory_step_s": results.get("in_memory", {}).get("step_s"),
        "cpu_offload_step_s": results.get("cpu_offload", {}).get("step_s"),
        "nvme_offload_step_s": results.get("nvme_offload", {}).get("step_s"),
        "deepspeed_nvme_step_s": results.get(DS_MODE, {}).get("step_s"),  # null where DeepSpeed is absent
        "peak_rss_bytes": {m: r["peak_rss_bytes"] for m, r in results.items()},
        "ratio_to_in_memory": {m: (r["step_s"] / ref if ref else None) for m, r in results.items()},
        "stall_seconds": {m: r.get("stall_seconds") for m, r in results.items()},
        "first_losses": {m: r["losses"][:2] for m, r in results.items()},
        "engine_config": json.loads(args.engine_config),
        "errors": errors,
    }


def _io_report(results: dict, bw: dict | None) -> dict:
    """The nvme_offload step against its I/O bound (bench/iobound.py); nulls where either is missing."""
    nvme, ref = results.get("nvme_offload"), results.get("in_memory", {}).get("step_s")
    if bw is None or nvme is None:  # no nvme_offload mode in the run, --io-size 0, or the mode failed
        return dict.fromkeys(("io_bound_s", "swap_read_gbps", "swap_write_gbps", "nvme_step_bytes", "nvme_vs_bound"))
    nbytes = iobound.step_nvme_bytes(nvme["links"])
    bound = iobound.io_bound_s(nbytes, bw)
    return {"io_bound_s": bound, "swap_read_gbps": bw["swap_read_gbps"], "swap_write_gbps": bw["swap_write_gbps"],
            "nvme_step_bytes": nbytes, "nvme_vs_bound": nvme["step_s"] / max(ref or 0.0, bound),
            "io_line": iobound.describe(nbytes, bw, nvme["params"])}


def _print_table(report: dict, results: dict) -> None:
    print(f"preset {report['preset']}: {(report['params'] or 0) / 1e6:.0f}M params, {report['tokens_per_step']} tokens/step; "
          f"{report['precision']} matmul {' -> '.join(f'{g:.1f}' for g in report['matmul_gflops_before_after'])} "
          f"GFLOP/s (before -> after)")
    if report["compute_floor_s"] is not None:
        print(limits.describe(report["precision"], report["matmul_gflops"], report["compute_floor_s"],
                              report["io_bound_s"]))
    print(f"{'mode':14s} {'step s':>8s} {'x in-mem':>9s} {'peak RSS GB':>12s} {'stall s/step':>12s}")
    for m, r in results.items():
        ratio = report["ratio_to_in_memory"][m]
        stall = r.get("stall_seconds")
        print(f"{m:14s} {r['step_s']:8.2f} {ratio if ratio else float('nan'):9.2f} "
              f"{r['peak_rss_bytes'] / 1e9:12.2f} {stall if stall is not None else float('nan'):12.2f}")
    if report["io_bound_s"] is not None:
        print(report["io_line"])
        print(f"nvme step / max(in-memory step, io bound) = {report['nvme_vs_bound']:.2f}")
    if len(report["rounds"]) > 1:
        print("step s per round (the table shows each mode's median round):")
        for i, rnd in enumerate(report["rounds"], 1):
            print(f"  round {i}: " + ", ".join(f"{m} {t:.2f}" for m, t in rnd.items()))


if __name__ == "__main__":
    main()
