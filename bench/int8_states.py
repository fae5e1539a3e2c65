"""Fidelity of int8 optimizer states (issue 50): the `small` preset trained on the bundled corpus with fp32 and
with int8 moments side by side, the same batches in the same order, each step of one beside the same step of
the other (so drift on a shared machine hits both alike). Prints the loss curve (the mean over each stretch of
--every steps), the held-out loss at the end, the final ratio (goal: within 1%), and with --plot a figure.
--plain adds the same training in plain PyTorch in memory with torch's AdamW and with bitsandbytes' AdamW8bit
(its CPU backend; min_8bit_size 4096, blocks of 256): whether a difference is the 8-bit method's or ours.
--modes picks the runs (fp32 int8 torch bnb8 torch-fused; `--modes torch bnb8`: the plain pair alone, half the
time). torch-fused is torch's AdamW again with fused=True: the same fp32 math rounded in another order, whose
distance from the first is the spread of fp32 AdamW itself on this run (what "within 1%" is measured against).

    python bench/int8_states.py [--model small] [--steps 300] [--every 25] [--optimizer cpu|nvme] [--plain]
                                [--modes M ...] [--seed 0] [--plot F] [--json]
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

MODES = ("fp32", "int8")
PLAIN = ("torch AdamW", "bnb AdamW8bit", "torch AdamW fused")
NAMES = {"fp32": "fp32", "int8": "int8", "torch": PLAIN[0], "bnb8": PLAIN[1], "torch-fused": PLAIN[2]}  # --modes
RATIOS = (("int8", "fp32", "int8/fp32"), (PLAIN[1], PLAIN[0], "bnb8/torch"),  # printed where both ran
          (PLAIN[2], PLAIN[0], "fused/torch"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small", help="a preset")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=25, help="steps a row of the loss table averages")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--optimizer", default="cpu", choices=("cpu", "nvme"), help="where the states live")
    ap.add_argument("--precision", default="fp32",
                    help="ours' precision; fp32 (default) is the plain loops' (--plain), so all start from one loss")
    ap.add_argument("--dir", default=None, help="swap goes under it (default: a temporary directory)")
    ap.add_argument("--plain", action="store_true", help="also torch's AdamW and bitsandbytes' AdamW8bit in memory")
    ap.add_argument("--modes", nargs="+", choices=tuple(NAMES), default=["fp32", "int8"],
                    help="the runs: ours with fp32 or int8 states; in memory torch's AdamW (torch-fused: again, "
                         "fused=True) and bitsandbytes' AdamW8bit")
    ap.add_argument("--seed", type=int, default=0, help="the model's initial weights and the batches' order")
    ap.add_argument("--plot", default=None, metavar="PNG")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.modes = [NAMES[m] for m in NAMES if m in args.modes or (args.plain and m in ("torch", "bnb8"))]
    base = tempfile.mkdtemp(prefix="int8-bench-", dir=args.dir)
    try:
        report = run(args, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"{args.model}, {args.batch} x {args.seq}, lr {args.lr}, {args.steps} steps, states in "
          f"{args.optimizer}, {report['precision']}: training loss, mean over each {args.every} steps")
    rows, c, ev = args.modes, report["curve"], report["eval_loss"]
    ratios = [r for r in RATIOS if r[0] in rows and r[1] in rows]
    print(f"  {'steps':>9s} " + " ".join(f"{m:>13s}" for m in rows) + "".join(f" {r[2]:>10s}" for r in ratios))
    for k, (a, b) in enumerate(report["stretches"]):
        print(f"  {a:4d}-{b:<4d} " + " ".join(f"{c[m][k]:13.4f}" for m in rows)
              + "".join(f" {c[x][k] / c[y][k]:10.4f}" for x, y, _ in ratios))
    print(f"  held-out loss after {args.steps} steps: " + ", ".join(f"{m} {ev[m]:.4f}" for m in rows)
          + "".join(f" ({name} {ev[x] / ev[y]:.4f}x)" for x, y, name in ratios)
          + (f"; step time int8/fp32 {report['step_ratio']:.2f}x" if report["step_ratio"] else ""))
    if args.plot:
        plot(report, args.plot)
    if args.json:
        print(json.dumps({k: v for k, v in report.items() if k != "losses"}))


def run(args, base: str) -> dict:
    import torch

    import offload
    from offload.data import BatchSampler, load_tokens, split_tokens
    from offload.models import build_model, loss_of

    train_tokens, val_tokens = split_tokens(load_tokens())
    sampler = BatchSampler(train_tokens, args.batch, args.seq, seed=args.seed)
    held = BatchSampler(val_tokens, args.batch, args.seq, seed=1)
    ours = [m for m in MODES if m in args.modes]
    engines, losses, times = {}, {m: [] for m in args.modes}, {m: [] for m in ours}
    plain = plain_loops(args, [m for m in PLAIN if m in args.modes])
    for mode in ours:
        cfg = {"precision": args.precision, "offload_param": {"device": "cpu"},
               "offload_optimizer": {"device": args.optimizer}, "nvme_path": os.path.join(base, mode),
               "gradient_clipping": 1.0, "optimizer": {"lr": args.lr, "states": mode},
               "lr_schedule": {"warmup_steps": 10}}
        engines[mode] = offload.initialize(build_model(args.model, seed=args.seed), cfg)
    try:
        for i in range(args.steps):
            ids, labels = sampler.batch(i)
            for mode, engine in engines.items():
                loss, seconds = timed_step(engine, ids, labels)
                times[mode].append(seconds)
                losses[mode].append(loss)
            for mode, step in plain.items():
                losses[mode].append(step(i, ids, labels))
            if (i + 1) % args.every == 0:
                print(f"step {i + 1}: " + ", ".join(
                    f"{m} {statistics.mean(losses[m][-args.every:]):.4f}"
                    + (f" ({statistics.median(times[m][-args.every:]):.2f} s)" if m in times else "") for m in losses),
                    file=sys.stderr, flush=True)
        evals = {}
        with torch.no_grad():
            for mode, engine in [*engines.items(), *((m, s.model) for m, s in plain.items())]:
                evals[mode] = statistics.mean(loss_of(engine(*held.batch(k)[:1], labels=held.batch(k)[1])).item()
                                              for k in range(8))
        precision = next(iter(engines.values())).cfg.precision if engines else "fp32 (plain)"
    finally:
        for engine in engines.values():
            engine.close()
    stretches = [(a, min(a + args.every, args.steps)) for a in range(0, args.steps, args.every)]
    curve = {m: [statistics.mean(losses[m][a:b]) for a, b in stretches] for m in losses if losses[m]}
    return {"model": args.model, "steps": args.steps, "precision": precision, "optimizer": args.optimizer,
            "stretches": stretches, "curve": curve, "losses": losses, "eval_loss": evals,
            "final_ratio": curve["int8"][-1] / curve["fp32"][-1] if len(ours) == 2 else None,
            "final_ratios": {name: curve[a][-1] / curve[b][-1] for a, b, name in RATIOS if a in curve and b in curve},
            # the first step records the trace: left out
            "step_ratio": statistics.median(times["int8"][1:]) / statistics.median(times["fp32"][1:])
            if len(ours) == 2 and args.steps > 1 else None}


def timed_step(engine, ids, labels) -> tuple[float, float]:
    """(loss, seconds) of one training step of `engine` (forward, backward, step) on a batch."""
    from offload.models import loss_of

    t = time.perf_counter()
    loss = loss_of(engine(ids, labels=labels))
    engine.backward(loss)
    engine.step()
    return loss.item(), time.perf_counter() - t


def plain_loops(args, modes) -> dict:
    """mode -> step(i, ids, labels) -> loss: the model in memory, fp32, the engine's clipping (1.0) and schedule
    (10 warm-up steps, then constant), torch's AdamW or bitsandbytes' AdamW8bit; step.model is the model."""
    import torch

    from offload.models import build_model, loss_of
    from offload.plan.config import LRScheduleConfig
    from offload.step.scale import lr_factor

    out = {}
    for mode in modes:
        model = build_model(args.model, seed=args.seed)
        if mode in (PLAIN[0], PLAIN[2]):
            fused = {"fused": True} if mode == PLAIN[2] else {"foreach": False}
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, **fused)
        else:
            import bitsandbytes

            opt = bitsandbytes.optim.AdamW8bit(model.parameters(), lr=args.lr, weight_decay=0.0)

        def step(i, ids, labels, model=model, opt=opt):
            for group in opt.param_groups:
                group["lr"] = args.lr * lr_factor(LRScheduleConfig(warmup_steps=10), i)
            loss = loss_of(model(ids, labels=labels))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()
        step.model = model
        out[mode] = step
    return out


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in report["losses"]:
        if report["losses"][mode]:
            ax.plot(range(1, report["steps"] + 1), report["losses"][mode], lw=0.8,
                    label=mode if mode in PLAIN else f"ours, {mode} states")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"{report['model']}: int8 against fp32 optimizer states")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
