"""LoRA on a base larger than RAM: the frozen base streamed from nvme, the adapters and their states in hbm.

Ours runs in a subprocess: a preset (default 7b, Llama-2-7B's shape) built on the meta device, wrapped
with peft's LoRA (offload.lora, as `offload train --lora` does: r --lora on --targets), placed with
offload_param nvme, offload_optimizer none and budgets.hbm_bytes --hbm, which holds the step's activations
too (planned for --batch x --seq by the engine's formula, offload.plan.activation_memory), initialized (init_s) and trained
--steps steps of --batch x --seq byte-id tokens. Each step reports its time, forward/backward split,
loss and bytes per link. Its peak RSS is sampled every 0.2 s (bench/scale.py's PeakRss) and compared with
what is stated: the process before initialize (interpreter, torch, peft), the memory plan's hbm need (on the
CPU backend hbm is host memory: fetched weights, adapters, their states and the activations) and its dram
need; beside it the activations one decoder layer keeps, measured in plain torch (below), against the plan's
formula. The goal is at most 6 GB at the default --hbm 5.5G (2.27 GiB of fetched weights for the 7b preset,
as at the 2.5G of the runs before activations were planned, beside 2.76 GiB of activations at 1 x 256).

The limits a step is stated against, measured in the same run:
  io_bound_s       bytes the step read and wrote on nvme (the engine's counters) over `offload bench nvme`'s
                   bandwidth in the same --dir (before and after ours: the mean; bench/iobound.py)
  compute_bound_s  the step's compute in plain torch, in memory, at the same precision: the LoRA model with
                   one decoder layer (embedding, one layer, norm, head, loss: forward + backward), plus
                   (layers - 1) x one more decoder layer's forward + backward on its input, each the
                   mean after a warm-up over 6 s and 20 s (3 to 50 runs); with no optimizer (the
                   adapters' Adam is microseconds). Measured before ours, between its steps (ours holds
                   still after each backward, before the step() that starts the next forward's reads)
                   and after it: the mean, all recorded. Each step is set against the mean of the two
                   measured beside it (this shared host's speed moves by 20-30% within seconds and by
                   10-20% over minutes), and the ratio is the median after the first.
  compute_floor_s  (4 x frozen + 6 x trainable parameters) x tokens / the matmul GFLOP/s measured in this run:
                   a frozen weight needs no weight gradient, so 2 FLOPs forward + 2 for the input gradient
The goal (issue 31): step <= 1.2 x max(compute_bound_s, io_bound_s).

python bench/lora.py --dir DIR [--model 7b] [--layers N] [--lora 16] [--targets q_proj,v_proj] [--hbm 5.5G]
                     [--steps 4] [--batch 1] [--seq 256] [--io-size 16G] [--precision auto|fp32|bf16] [--json]
--layers N trains the preset with N decoder layers (a quick run of the same shapes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import statistics
import sys
import time

import iobound  # bench/, this script's directory, is first on sys.path
import limits
from e2e import worker_env
from scale import bench_main, bracketed, run_sampled, steady

GOAL_RATIO = 1.2
GOAL_RSS_BYTES = 6e9
WHOLE_WINDOW_S, LAYER_WINDOW_S, MAX_RUNS = 6.0, 20.0, 50  # the compute bound's timing windows (compute_worker)


def _model(args, device: str, checkpoint_layers: bool = False):
    """The preset (with --layers) wrapped with peft's LoRA, on `device`; and its info dict. checkpoint_layers: the
    model calls torch's checkpoint on each decoder layer itself (the in-memory compute bound's, as the engine's
    activation_checkpointing does for ours)."""
    from offload import models
    from offload.lora import apply_lora

    if args.layers:
        models.PRESETS[args.model] = dataclasses.replace(models.PRESETS[args.model], n_layers=args.layers)
    model = models.build_model(args.model, device="meta", checkpoint_activations=checkpoint_layers)
    if device != "meta":
        import torch

        from offload.plan.precision import DTYPES

        model = model.to_empty(device=device).to(DTYPES[args.precision])
        with torch.no_grad():
            for p in model.parameters():  # values do not matter, but garbage may hold denormals or NaNs
                p.normal_(0.0, 0.02)
    if args.quantize:  # the frozen base's linears as bitsandbytes layers (in memory: quantized now)
        from offload.plan.precision import DTYPES
        from offload.plan.quantized import quantize_linears, replace_linears

        (replace_linears if device == "meta" else quantize_linears)(model, args.quantize, DTYPES[args.precision])
    lora = {"r": args.lora, "alpha": 2.0 * args.lora, "targets": args.targets.split(","), "dropout": 0.0}
    return apply_lora(model, {"kind": "preset"}, lora)


def worker(args) -> None:
    """In the subprocess: a JSON line after initialize, one per step, one at the end."""
    import psutil

    import offload
    from offload.plan.config import load_config
    from offload.kernels.cpu_adam import host_cache_stats
    from offload.data import BatchSampler, load_tokens
    from offload.models import loss_of

    cfg = load_config({"precision": args.precision, "offload_param": {"device": args.base},
                       "offload_optimizer": {"device": "none"}, "nvme_path": args.dir, "optimizer": {"lr": 1e-4},
                       "budgets": {"hbm_bytes": args.hbm}, "quantize_base": args.quantize,
                       "activation_checkpointing": args.activation_checkpointing,
                       "activations": {"batch": args.batch, "seq": args.seq}})
    model = _model(args, "meta")
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    sampler = BatchSampler(load_tokens(), args.batch, args.seq, seed=0)
    proc = psutil.Process()
    baseline = proc.memory_info().rss  # the interpreter, torch, peft: before the engine holds anything
    t0 = time.perf_counter()
    with offload.initialize(model, cfg) as engine:
        need = engine.placement.need
        _emit({"params": params, "trainable_params": trainable, "init_s": time.perf_counter() - t0,
               "baseline_rss_bytes": baseline, "rss_after_init_bytes": proc.memory_info().rss,
               "plan_hbm_bytes": need["hbm"], "plan_dram_bytes": need["dram"]})
        for i in range(args.steps):
            ids, labels = (t.to(engine.device) for t in sampler.batch(i))
            fresh = host_cache_stats().get("mapped_fresh_bytes", 0)
            t0 = time.perf_counter()
            loss = loss_of(engine(ids, labels=labels))
            t1 = time.perf_counter()
            rss_forward = proc.memory_info().rss  # the step's activations are all alive here
            engine.backward(loss)
            t2 = time.perf_counter()
            if args.pause:  # before step(), which starts the next forward's reads: nothing of ours is in flight
                _emit({"pause": i})
                sys.stdin.readline()
            t3 = time.perf_counter()
            engine.step()
            t4 = time.perf_counter()
            last = engine.stats()["last_step"]
            _emit({"step": i, "step_s": t2 - t0 + t4 - t3, "forward_s": t1 - t0, "backward_s": t2 - t1 + t4 - t3,
                   "loss": loss.item(), "links": last["links"], "stall_s": last["stall_seconds"],
                   "rss_after_forward_bytes": rss_forward,
                   "host_fresh_bytes": host_cache_stats().get("mapped_fresh_bytes", 0) - fresh,
                   "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
    _emit({"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})


def compute_worker(args) -> None:
    """In a subprocess: compute_bound_s (module docstring) and the activations one decoder layer keeps."""
    import psutil
    import torch

    from offload.data import BatchSampler, load_tokens
    from offload.models import loss_of, rotary

    layers = args.layers or _preset(args).n_layers
    args.layers = 1
    model = _model(args, "cpu", checkpoint_layers=args.activation_checkpointing)
    ids, labels = BatchSampler(load_tokens(), args.batch, args.seq, seed=0).batch(0)
    block = next(m for name, m in model.named_modules() if name.endswith("layers.0"))
    cfg = _preset(args)
    x = torch.randn(args.batch, args.seq, cfg.d_model, dtype=next(model.parameters()).dtype, requires_grad=True)
    cos, sin = rotary(args.seq, cfg.head_dim, cfg.rope_theta, "cpu")

    def whole():
        loss_of(model(ids, labels=labels)).backward()

    def layer():  # with --activation-checkpointing its forward runs again in its backward, as ours does
        if args.activation_checkpointing:
            out = torch.utils.checkpoint.checkpoint(block, x, cos, sin, use_reentrant=False)
        else:
            out = block(x, cos, sin)
        out.backward(torch.ones_like(out))

    def timed(fn, window_s: float):
        """The mean after a warm-up over at least `window_s` seconds (3 to MAX_RUNS runs): this host's
        speed moves by 20-30% over a few seconds, which ours' steps, a minute long, average out."""
        times: list[float] = []
        while len(times) < 4 or (sum(times[1:]) < window_s and len(times) <= MAX_RUNS):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
            x.grad = None
        return statistics.mean(times[1:])

    one, per_layer = timed(whole, WHOLE_WINDOW_S), timed(layer, LAYER_WINDOW_S)
    rss = psutil.Process().memory_info().rss
    outs = [block(x, cos, sin) for _ in range(4)]  # four layers' saved activations held at once
    activations = (psutil.Process().memory_info().rss - rss) / 4
    del outs
    _emit({"model_one_layer_s": one, "layer_s": per_layer, "compute_bound_s": one + (layers - 1) * per_layer,
           "activation_bytes_per_layer": activations})


def _preset(args):
    from offload.models import PRESETS

    return PRESETS[args.model]


def _emit(line: dict) -> None:
    print(json.dumps(line), flush=True)


def _sub(args, flag: str, extra: list[str]) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), flag, "--model", args.model, "--layers", str(args.layers),
            "--lora", str(args.lora), "--targets", args.targets, "--batch", str(args.batch), "--seq", str(args.seq),
            "--precision", args.precision, "--base", args.base,
            *(["--activation-checkpointing"] if args.activation_checkpointing else []), *(["--quantize", args.quantize] if args.quantize else []),
            *extra]


def _compute(args) -> dict:
    import subprocess

    proc = subprocess.run(_sub(args, "--compute-worker", []), capture_output=True, text=True, env=worker_env())
    if proc.returncode:
        raise RuntimeError(f"compute bound not measured: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _run(args, work: str) -> dict:
    aio = {}
    bw = iobound.measure_swap(work, args.io_size, aio) if args.io_size else None
    before = _compute(args)  # the compute bound before ours, between its steps and after it (module docstring)
    ours_dir = os.path.join(work, "ours")
    os.makedirs(ours_dir)
    ours = run_sampled(_sub(args, "--worker", ["--hbm", str(args.hbm), "--steps", str(args.steps), "--dir", ours_dir,
                                               "--pause"]), "ours", on_pause=lambda: _compute(args))
    shutil.rmtree(ours_dir, ignore_errors=True)
    if bw:
        bw = bracketed(bw, iobound.measure_swap(work, args.io_size, aio))
    after = _compute(args)
    measured = [before, *ours.pop("pauses", []), after]
    compute = {k: statistics.mean(m[k] for m in measured) for k in before}
    bounds = [m["compute_bound_s"] for m in measured]
    # step i ran between the measurements i and i + 1 (its step() after i + 1: no compute)
    beside = [(a + b) / 2 for a, b in zip(bounds, bounds[1:])][:len(ours["step_s"])]
    compute.update({"compute_bound_s_before": bounds[0], "compute_bound_s_after": bounds[-1],
                    "compute_bound_measured_s": bounds, "compute_bound_per_step_s": beside})
    gflops = limits.matmul_gflops(args.precision)
    report = {"model": args.model, "layers": args.layers or _preset(args).n_layers, "lora_r": args.lora,
              "targets": args.targets, "batch": args.batch, "seq": args.seq, "precision": args.precision,
              "quantize": args.quantize, "base": args.base, "activation_checkpointing": args.activation_checkpointing,
              "hbm_budget_bytes": args.hbm, "matmul_gflops": gflops, **compute, **ours}
    links = [l for l in report.pop("links") if l]
    report["nvme_read_bytes"] = [l["nvme_to_dram"]["bytes"] for l in links]
    report["nvme_write_bytes"] = [l["dram_to_nvme"]["bytes"] for l in links]
    if ours["params"]:
        frozen = ours["params"] - ours["trainable_params"]
        report["compute_floor_s"] = ((4 * frozen + 6 * ours["trainable_params"]) * args.batch * args.seq
                                     / (gflops * 1e9))
    report.update({k: bw.get(k) if bw else None for k in ("swap_read_gbps", "swap_write_gbps", "swap_read_gbps_before",
                                                           "swap_read_gbps_after")})
    step = steady(ours["step_s"])
    report["step_s_steady"] = step
    report["io_bound_s"] = steady([iobound.io_bound_s(iobound.step_nvme_bytes(
        {k: l[k] for k in iobound.NVME_LINKS}), bw) for l in links]) if bw and links else None
    report["step_vs_bound_per_step"] = [s / max(c, report["io_bound_s"] or 0.0)
                                        for s, c in zip(ours["step_s"], compute["compute_bound_per_step_s"])]
    report["step_vs_bound"] = steady(report["step_vs_bound_per_step"])
    # What is stated for host memory on the CPU backend: the process before initialize and the memory plan's hbm
    # need (fetched weights, adapters, their states, the activations) and dram need (pool).
    report["stated_host_bytes"] = (ours.get("baseline_rss_bytes", 0) + (ours.get("plan_hbm_bytes") or 0)
                                   + (ours.get("plan_dram_bytes") or 0))
    return report


def _print_summary(r: dict) -> None:
    gb = 1e9
    print(f"model {r['model']} ({r['layers']} layers, {(r['params'] or 0) / 1e9:.2f}B params, "
          f"{(r['trainable_params'] or 0) / 1e6:.1f}M trained: LoRA r {r['lora_r']} on {r['targets']}), batch "
          f"{r['batch']} x {r['seq']}, {r['precision']}, hbm budget {r['hbm_budget_bytes'] / 2**30:.2f} GiB")
    print(f"init {r['init_s'] or float('nan'):.1f} s; steps (s): " + ", ".join(f"{s:.1f}" for s in r["step_s"])
          + "; forward/backward of the last: "
          + (f"{r['forward_s'][-1]:.1f} / {r['backward_s'][-1]:.1f}" if r.get("forward_s") else "-"))
    print(f"io bound {r['io_bound_s'] or float('nan'):.1f} s: read {r['nvme_read_bytes'][-1] / gb:.1f} GB at "
          f"{r['swap_read_gbps'] or float('nan'):.2f} GB/s, wrote {r['nvme_write_bytes'][-1] / gb:.2f} GB at "
          f"{r['swap_write_gbps'] or float('nan'):.2f} GB/s (offload bench nvme in --dir, mean of before and after)")
    print(f"compute bound {r['compute_bound_s']:.1f} s = model with one layer {r['model_one_layer_s']:.2f} s + "
          f"{r['layers'] - 1} x layer {r['layer_s']:.2f} s (plain torch, in memory; the mean of "
          + ", ".join(f"{b:.1f}" for b in r["compute_bound_measured_s"]) + " s, measured before ours, between its "
          f"steps and after); compute floor {r.get('compute_floor_s') or float('nan'):.1f} s at "
          f"{r['matmul_gflops']:.0f} GFLOP/s")
    print(f"step (median after the first) {r['step_s_steady'] or float('nan'):.1f} s; each step over "
          "max(the compute bound measured beside it, io bound): " + ", ".join(f"{x:.2f}" for x in r["step_vs_bound_per_step"])
          + f"; median after the first {r['step_vs_bound'] or float('nan'):.2f} x (goal <= {GOAL_RATIO})")
    print(f"peak RSS {r['peak_rss_bytes'] / gb:.2f} GB (goal <= {GOAL_RSS_BYTES / gb:.0f} GB; after each forward: "
          + ", ".join(f"{x / gb:.2f}" for x in r.get("rss_after_forward_bytes", [])) + "); stated: before initialize "
          f"{r.get('baseline_rss_bytes', 0) / gb:.2f} + hbm plan {(r.get('plan_hbm_bytes') or 0) / gb:.2f} (with the "
          f"activations) + dram plan {(r.get('plan_dram_bytes') or 0) / gb:.2f} = {r['stated_host_bytes'] / gb:.2f} GB; "
          f"activations measured in plain torch {r['layers']} x {r['activation_bytes_per_layer'] / 1e6:.0f} MB"
          + (f"; activations' host blocks mapped afresh a step (MB): "
             + ", ".join(f"{x / 1e6:.0f}" for x in r["host_fresh_bytes"]) if r.get("host_fresh_bytes") else "")
          + (f"  FAILED: {r['error']}" if r.get("error") else ""))


def _parse_args() -> argparse.Namespace:
    from offload.swap.measure import parse_size

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="7b", help="a preset (default 7b)")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (default: the preset's)")
    ap.add_argument("--lora", type=int, default=16, help="LoRA rank r (alpha 2r)")
    ap.add_argument("--targets", default="q_proj,v_proj")
    ap.add_argument("--hbm", type=parse_size, default="5.5G",
                    help="budgets.hbm_bytes, the activations included (default 5.5G = 5.5 GiB)")
    ap.add_argument("--quantize", choices=("nf4", "fp4", "int8"), default=None,
                    help="the frozen base quantized by bitsandbytes (QLoRA; the compute bound then includes the "
                         "dequantization: the in-memory model is quantized too)")
    ap.add_argument("--base", choices=("nvme", "cpu"), default="nvme", help="offload_param: the base on nvme or in dram")
    ap.add_argument("--activation-checkpointing", "--checkpoint-activations", action="store_true",
                    help="the engine checkpoints each decoder layer (config activation_checkpointing: keeps its "
                         "input, runs its forward again in the backward; the compute bound's layers call torch's "
                         "checkpoint themselves)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--dir", help="a directory on the drive; the run's swap goes in a new subdirectory, removed "
                                  "at the end")
    ap.add_argument("--io-size", type=parse_size, default="16G",
                    help="bytes `offload bench nvme` writes then reads in --dir for the I/O bound (0 skips it)")
    limits.add_precision_argument(ap)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--compute-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pause", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.precision = limits.resolve(args.precision)
    from offload.models import PRESETS

    if args.model not in PRESETS:
        ap.error(f"--model={args.model}: not a preset ({', '.join(PRESETS)})")
    if args.worker or args.compute_worker:
        return args
    if args.steps < 2 or args.lora < 1 or args.layers < 0:
        ap.error(f"--steps={args.steps} --lora={args.lora} --layers={args.layers}: need >= 2 (the first step "
                 f"records the trace), >= 1, >= 0")
    if not args.dir or not os.path.isdir(args.dir):
        ap.error(f"--dir={args.dir}: not a directory; create it or pass an existing one")
    return args


def main() -> None:
    bench_main(_parse_args(), "lora-", _run, _print_summary, worker, compute_worker)


if __name__ == "__main__":
    main()
