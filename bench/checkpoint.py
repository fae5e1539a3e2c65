"""Step times with a checkpoint every step: none, in the background, blocking (issue 52), side by side on one
engine (weights and optimizer states on nvme), in rounds so that drift on a shared machine hits each mode alike.

Each round: a step with no checkpoint (none); a background checkpoint asked, then the steps that run while it
is written (background: each of them, until it is published), then plain steps again until none has as many
as background (the medians compare samples of one size, taken in the same minutes); gated, with --gated: the
same with no states held at the swap, so each unit's update waits for the saver; a step followed by a blocking
checkpoint (blocking: the step plus the save, what training waits); and a step while fio moves the bytes a
background save moves (beside_io: reading the checkpoint's bytes and writing them to a new file, each at that
size over a plain step's time, O_DIRECT, in --dir; null without fio): what the host's compute and drive keep
beside that I/O, the floor of any background save of that size. Goal: background <= 1.05 x none. exposed_s:
the mean time training waited for a background checkpoint (its request, and units the step reached before the
saver). held: per background save, its mode, the bytes of states held at the swap (copy-on-write), the units
gated instead and the saver thread's CPU seconds; swap_growth_bytes: how much the swap file grew during each
held one (a first save grows it, later ones reuse that room).

    python bench/checkpoint.py [--model bench-200m|3b] [--batch 4] [--seq 512] [--rounds 3] [--dir DIR]
                               [--optimizer-states fp32|int8] [--gated] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench-200m", help="a preset (bench-200m, 3b, ...)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="swap and checkpoints go under it (default: a temporary directory)")
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--optimizer-states", default="fp32", choices=("fp32", "int8"),
                    help="int8: half the state bytes on disk and in each checkpoint (the 3b shape's fit this disk)")
    ap.add_argument("--gated", action="store_true",
                    help="also a background checkpoint with every unit gated (no states held at the swap), each round")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)
    try:
        report = run(args, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    step = report["step_s"]
    print(f"{args.model}, {args.batch} x {args.seq}, weights and states on nvme, {report['precision']}, "
          f"{args.optimizer_states} optimizer states:")
    for mode in ("none", "background", "gated", "blocking", "beside_io"):
        if step.get(mode) is not None:
            print(f"  {mode:10s} step {step[mode]:7.2f} s  ({step[mode] / step['none']:.2f}x none)")
    if step.get("beside_io") is not None:
        print(f"  beside_io: the step while fio reads {report['checkpoint_bytes'] / 1e9:.2f} GB and writes as much "
              f"to a new file over a plain step's time (the bytes of one checkpoint)")
        for moved in report["beside_io_bytes"]:
            print("    fio moved during the step: " + ", ".join(
                f"{rw} {v / 1e9:.2f} GB" if v is not None else f"{rw} unknown" for rw, v in moved.items()))
    print(f"  a plain step moves {report['step_nvme_bytes']['read'] / 1e9:.2f} GB from nvme and "
          f"{report['step_nvme_bytes']['written'] / 1e9:.2f} GB to it; a checkpoint is "
          f"{report['checkpoint_bytes'] / 1e9:.2f} GB, the blocking save {report['save_gbps_blocking']:.2f} GB/s")
    print(f"  blocking save {report['save_s_blocking']:.2f} s; background: {report['background_s']:.2f} s to publish, "
          f"{report['exposed_s']:.3f} s exposed, over {report['steps_per_background']:.1f} steps, the saver's CPU "
          f"{report['saver_cpu_s']:.2f} s")
    grown = iter(report["swap_growth_bytes"])
    for h in report["held"]:
        grew = f"; the swap file grew {next(grown) / 1e9:.2f} GB" if h["mode"] == "background" else ""
        print(f"  {h['mode']} save: {h['held_bytes'] / 1e9:.2f} GB of states held at the swap (copy-on-write), "
              f"{h['gated_units']} units gated, the saver's CPU {h['saver_cpu_s']:.2f} s{grew}")
    if args.json:
        print(json.dumps(report))


def run(args, base: str) -> dict:
    import torch

    import offload
    from offload.checkpoint import background as background_module
    from offload.data import BatchSampler, load_tokens
    from offload.models import build_model, loss_of

    model = build_model(args.model, seed=0)
    sampler = BatchSampler(load_tokens(), args.batch, args.seq, seed=0)
    cfg = {"precision": args.precision, "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"},
           "nvme_path": os.path.join(base, "swap"), "optimizer": {"states": args.optimizer_states}}
    ck = os.path.join(base, "ck")
    times = {"none": [], "background": [], "gated": [], "blocking": [], "beside_io": []}
    size = None  # the bytes of one checkpoint, once the first is written
    saves, per_save, fio_moved = [], [], []
    bg = {"exposed_s": [], "seconds": [], "saver_cpu_s": [], "held": [], "swap_growth_bytes": []}
    with offload.initialize(model, cfg) as engine:
        i = 0

        def step() -> float:
            nonlocal i
            ids, labels = sampler.batch(i)
            i += 1
            t = time.perf_counter()
            engine.backward(loss_of(engine(ids, labels=labels)))
            engine.step()
            return time.perf_counter() - t

        def background(mode: str) -> None:
            """A background checkpoint and the steps that run while it is written, into times[mode]; gated:
            with no states held at the swap, every unit's update waits for the saver (background.HOLD_AT_SWAP)."""
            nonlocal size
            swap_before = engine.store.disk_bytes
            background_module.HOLD_AT_SWAP = mode == "background"
            try:
                handle = engine.save_checkpoint(ck, name=f"{mode}{i}", keep=1, background=True)
            finally:
                background_module.HOLD_AT_SWAP = True
            n = 0
            while not handle.done():
                times[mode].append(step())
                n += 1
            path = handle.wait()
            size = size or sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
            shutil.rmtree(ck)  # one checkpoint on the disk at a time (the 3b shape's fill it)
            stats = handle.stats()
            if mode == "background":
                per_save.append(n)
                for k in ("exposed_s", "seconds", "saver_cpu_s"):
                    bg[k].append(stats[k])
                bg["swap_growth_bytes"].append(engine.store.disk_bytes - swap_before)
            bg["held"].append({"mode": mode, **{k: stats[k] for k in ("held_bytes", "gated_units", "saver_cpu_s")}})

        step(), step()  # the first records the trace, the second settles the pool
        for _ in range(args.rounds):
            times["none"].append(step())
            links = engine.stats()["last_step"]["links"]
            step_io = {"read": links["nvme_to_dram"]["bytes"], "written": links["dram_to_nvme"]["bytes"]}
            background("background")
            for _ in range(per_save[-1] - 1):  # as many plain steps as the save had beside it
                times["none"].append(step())
            if args.gated:
                background("gated")
            s = step()
            t = time.perf_counter()
            engine.save_checkpoint(ck, name=f"bl{i}", keep=1)
            saves.append(time.perf_counter() - t)
            shutil.rmtree(ck)
            times["blocking"].append(s + saves[-1])
            if shutil.which("fio"):
                t, moved = beside_io(step, size, statistics.median(times["none"]), base)
                times["beside_io"].append(t)
                fio_moved.append(moved)
        precision = engine.cfg.precision
        params = sum(u.numel for u in engine.units)
    med = {k: statistics.median(v) if v else None for k, v in times.items()}
    return {"model": args.model, "params": params, "precision": precision, "optimizer_states": args.optimizer_states, "batch": args.batch, "seq": args.seq,
            "rounds": args.rounds, "step_s": med, "steps": times, "save_s_blocking": statistics.median(saves),
            "exposed_s": statistics.mean(bg["exposed_s"]), "background_s": statistics.median(bg["seconds"]),
            "saver_cpu_s": statistics.median(bg["saver_cpu_s"]),
            "steps_per_background": statistics.mean(per_save), "background_over_none": med["background"] / med["none"],
            "checkpoint_bytes": size, "step_nvme_bytes": step_io,
            "save_gbps_blocking": size / statistics.median(saves) / 1e9,
            "beside_io_bytes": fio_moved,  # the bytes fio read and wrote during each beside_io step
            "held": bg["held"], "swap_growth_bytes": bg["swap_growth_bytes"]}


def beside_io(step, nbytes: int, seconds: float, base: str) -> float:
    """step()'s time while fio reads and writes `nbytes` each at nbytes / `seconds` a second (what a background
    save of `nbytes` moves over one step; O_DIRECT, libaio, 8 MiB blocks, files under `base`). The writes go to a
    new file, as a checkpoint's do: on some drives (this project's VM) writing new blocks is several times slower
    than overwriting a file written before, as the swap file is; the reads go over a file of at most 1 GiB."""
    import subprocess

    rate = str(max(int(nbytes / seconds), 1 << 20))
    size = -(-nbytes // (8 << 20)) * (8 << 20)  # whole 8 MiB blocks (O_DIRECT, fio's bs)
    common = ["--bs=8M", "--direct=1", "--ioengine=libaio", "--iodepth=8", f"--rate={rate}"]
    path = {rw: os.path.join(base, f"fio-{rw}.dat") for rw in ("read", "write")}
    subprocess.run(["fio", "--name=layout", f"--filename={path['read']}", f"--size={min(size, 1 << 30)}", "--bs=8M",
                    "--direct=1", "--rw=write"], check=True, capture_output=True)  # the file to read
    jobs = [["fio", "--name=read", f"--filename={path['read']}", f"--size={min(size, 1 << 30)}", "--rw=read",
             "--time_based", "--runtime=3600", *common],
            ["fio", "--name=write", f"--filename={path['write']}", f"--size={size}", "--rw=write", *common]]
    procs = [subprocess.Popen(job + ["--output-format=json"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True) for job in jobs]
    moved = {}
    try:
        time.sleep(1)
        return step(), moved
    finally:  # stopped as ^C stops fio: it reports the bytes it moved; then anything left of this run's files
        for rw, p in zip(("read", "write"), procs):
            p.send_signal(signal.SIGINT)
            try:
                out = p.communicate(timeout=60)[0]  # "fio: terminating on signal 2", then its JSON
                moved[rw] = json.loads(out[out.index("{"):])["jobs"][0][rw]["io_bytes"]
            except (subprocess.TimeoutExpired, ValueError, KeyError, IndexError):
                moved[rw] = None
        subprocess.run(["pkill", "-9", "-f", os.path.join(base, "fio-")])
        for p in procs:
            p.wait()
        for f in path.values():
            if os.path.exists(f):
                os.remove(f)


if __name__ == "__main__":
    main()
