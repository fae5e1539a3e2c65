"""The split master (issue 50, [Note: split master] in offload/kernels/split.py) against the fp32 master, side by
side: a preset trained in bf16 with optimizer states on nvme (weights too, or in dram: --param cpu), one engine
per (moments, master), each step of one beside the same step of the others (drift on a shared machine hits all
alike). Per run: the median step, the nvme bytes a step reads and writes (the engine's own counters) a
trained element (the elements the optimizer states cover), and whether its losses and final weights equal the
fp32 master's bit for bit. Then the CPU cost of the record over --numel elements, in this process: the fp32
Adam step (bf16 gradients and weights), join + split beside it, and the step joining and splitting each chunk
in its own pass (what the engine runs where a window is one run).

    python bench/split_master.py [--model small] [--steps 6] [--batch 4] [--seq 128] [--states fp32 int8]
                                 [--param nvme|cpu] [--dir DIR] [--numel N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MASTERS = ("fp32", "split")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small", help="a preset")
    ap.add_argument("--steps", type=int, default=6, help="steps each; the first (it records the trace) is left out")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--states", nargs="+", choices=("fp32", "int8"), default=["fp32", "int8"], help="the moments")
    ap.add_argument("--param", choices=("nvme", "cpu"), default="nvme",
                    help="where the weights live (cpu: dram, where the join reads them in memory)")
    ap.add_argument("--dir", default=None, help="swap goes under it (default: a temporary directory)")
    ap.add_argument("--numel", type=int, default=1 << 24, help="elements of the kernel comparison (0: skip it)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step is left out)")
    base = tempfile.mkdtemp(prefix="split-bench-", dir=args.dir)
    try:
        report = {"model": args.model, "batch": args.batch, "seq": args.seq, "steps": args.steps,
                  "param": args.param, "runs": train(args, base), "kernel": kernel(args.numel) if args.numel else None}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    where = "weights and states on nvme" if args.param == "nvme" else "weights in dram, states on nvme"
    print(f"{args.model}, {args.batch} x {args.seq}, bf16, {where}, {args.steps} steps "
          f"(median of the last {args.steps - 1}):")
    for r in report["runs"]:
        print(f"  {r['states']:>4s} moments, {r['master']:>5s} master: step {r['step_s']:7.2f} s "
              f"({r['step_ratio']:.3f}x fp32 master), nvme {r['read_b'] / r['params']:6.3f} B read + "
              f"{r['written_b'] / r['params']:6.3f} B written a trained element a step, bit for bit: {r['equal']}")
    k = report["kernel"]
    if k:
        print(f"  kernel, {k['numel']:,} elements: fp32 Adam {k['adam_s'] * 1e3:.1f} ms; join + split beside it "
              f"{k['record_s'] * 1e3:.1f} ms ({k['record_s'] / k['adam_s']:.2f}x the step); the step joining and "
              f"splitting in its pass {k['fused_s'] * 1e3:.1f} ms ({k['fused_s'] / k['adam_s']:.2f}x)")
    if args.json:
        print(json.dumps(report))


def train(args, base: str) -> list[dict]:
    import torch

    import offload
    from int8_states import timed_step
    from offload.data import BatchSampler, load_tokens, split_tokens
    from offload.models import build_model

    sampler = BatchSampler(split_tokens(load_tokens())[0], args.batch, args.seq, seed=0)
    runs = [(s, m) for s in args.states for m in MASTERS]
    engines, losses, times, links = {}, {r: [] for r in runs}, {r: [] for r in runs}, {}
    for s, m in runs:
        cfg = {"precision": "bf16", "offload_param": {"device": args.param}, "offload_optimizer": {"device": "nvme"},
               "nvme_path": os.path.join(base, f"{s}-{m}"), "optimizer": {"lr": 1e-3, "states": s, "master": m}}
        engines[s, m] = offload.initialize(build_model(args.model, seed=0), cfg)
    try:
        for i in range(args.steps):
            ids, labels = sampler.batch(i)
            for r, engine in engines.items():
                loss, seconds = timed_step(engine, ids, labels)
                times[r].append(seconds)
                losses[r].append(loss)
                links[r] = engine.stats()["last_step"]["links"]
            print(f"step {i + 1}: " + ", ".join(f"{s}/{m} {times[s, m][-1]:.2f} s" for s, m in runs),
                  file=sys.stderr, flush=True)
        final = {r: engine.full_state_dict() for r, engine in engines.items()}
        engine = next(iter(engines.values()))  # the elements the states cover (parameters, their alignment padding)
        params = sum(e - b for st in engine.states if st is not None for b, e in st.chunks)
    finally:
        for engine in engines.values():
            engine.close()
    out = []
    for s, m in runs:
        ref = (s, "fp32")
        equal = losses[s, m] == losses[ref] and all(torch.equal(final[s, m][k], final[ref][k]) for k in final[ref])
        step = statistics.median(times[s, m][1:])
        out.append({"states": s, "master": m, "params": params, "step_s": step,
                    "step_ratio": step / statistics.median(times[ref][1:]), "equal": equal,
                    "read_b": links[s, m].get("nvme_to_dram", {}).get("bytes", 0),
                    "written_b": links[s, m].get("dram_to_nvme", {}).get("bytes", 0), "losses": losses[s, m]})
    return out


def kernel(numel: int) -> dict:
    """Seconds (best of 5) over `numel` elements of the fp32 Adam step (bf16 grads and weights out), of join +
    split of their split master, and of the step joining and splitting in its pass."""
    import torch

    from offload.kernels import split
    from offload.kernels.cpu_adam import adam_step

    g = torch.Generator().manual_seed(0)
    master = torch.randn(numel, generator=g)
    grad = torch.randn(numel, generator=g).to(torch.bfloat16)
    m, v, out = torch.zeros(numel), torch.zeros(numel), torch.empty(numel, dtype=torch.bfloat16)
    record = torch.empty(split.record_bytes(numel), dtype=torch.uint8)

    def best(fn) -> float:
        times = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    def adam(**kw) -> None:
        adam_step(master, grad, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                  out=out, **kw)

    split.split_(master, record)
    out.copy_(master)
    plain = best(adam)
    record_s = best(lambda: (split.join(out, record, master), split.split_(master, record)))
    fused = best(lambda: adam(split=(out, *split.parts(record, numel))))
    return {"numel": numel, "adam_s": plain, "record_s": record_s, "fused_s": fused}


if __name__ == "__main__":
    main()
