"""Soak over ranks: the 2-rank `offload train` run again and again, a CPU hog beside every other run; any
run that does not finish in time is a hang ([Note: collective order] in offload/state/ranks.py).

    python bench/soak_ranks.py --runs 50 --stages 3 [--steps 10] [--timeout 300] [--json]

Each run: `torchrun --nproc-per-node 2 -m offload train --zero-stage S --steps N --precision fp32
--no-progress` in a fresh directory (its swap and report there). Counted per stage: finished (exit 0),
failed (another exit code, with its last line), hung (still running at --timeout: killed with its
process group), the runs that printed "unit order differs", and swap bytes left behind under
.offload-swap after the run (the data files are unlinked: expected 0).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time


def hog(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(100_000))


def left_bytes(directory: str) -> int:
    total = 0
    for d, _, files in os.walk(os.path.join(directory, ".offload-swap")):
        for f in files:
            if f != "owner.json":
                try:
                    total += os.path.getsize(os.path.join(d, f))
                except OSError:
                    pass
    return total


def one_run(stage: int, steps: int, timeout: float, with_hog: bool) -> dict:
    work = tempfile.mkdtemp(prefix="soak-")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc-per-node", "2", "-m", "offload", "train", "--zero-stage", str(stage), "--steps",
           str(steps), "--precision", "fp32", "--no-progress"]
    stop = multiprocessing.Event()
    hogger = multiprocessing.Process(target=hog, args=(stop,), daemon=True) if with_hog else None
    if hogger:
        hogger.start()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, hung = proc.communicate(timeout=timeout)[0], False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, hung = proc.communicate()[0], True
    seconds = time.monotonic() - t0
    if hogger:
        stop.set()
        hogger.join()
    row = {"stage": stage, "hog": with_hog, "rc": proc.returncode, "hung": hung, "seconds": round(seconds, 1),
           "diverged": "unit order differs" in out, "left_bytes": left_bytes(work),
           "last_line": "" if proc.returncode == 0 else out.strip().splitlines()[-1][-300:] if out.strip() else ""}
    shutil.rmtree(work, ignore_errors=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50, help="runs per stage (a hog beside every other one)")
    ap.add_argument("--stages", default="3", help="comma-separated zero stages, e.g. 1,2,3")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before a run counts as hung")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for stage in (int(s) for s in args.stages.split(",")):
        for i in range(args.runs):
            row = one_run(stage, args.steps, args.timeout, with_hog=i % 2 == 1)
            rows.append(row)
            print(f"stage {stage} run {i + 1}/{args.runs}{' +hog' if row['hog'] else ''}: rc {row['rc']}"
                  f"{' HUNG' if row['hung'] else ''} {row['seconds']} s{' (trace re-recorded)' if row['diverged'] else ''}"
                  f"{' left ' + str(row['left_bytes']) + ' B' if row['left_bytes'] else ''} {row['last_line']}",
                  flush=True)
    summary = {}
    for stage in sorted({r["stage"] for r in rows}):
        mine = [r for r in rows if r["stage"] == stage]
        summary[stage] = {"runs": len(mine), "finished": sum(r["rc"] == 0 for r in mine),
                          "hung": sum(r["hung"] for r in mine), "failed": sum(r["rc"] != 0 and not r["hung"] for r in mine),
                          "diverged": sum(r["diverged"] for r in mine), "left_bytes": sum(r["left_bytes"] for r in mine),
                          "median_s": sorted(r["seconds"] for r in mine)[len(mine) // 2]}
    print("\nstage  runs  finished  hung  failed  trace re-recorded  swap bytes left  median s")
    for stage, s in summary.items():
        print(f"{stage:>5}  {s['runs']:>4}  {s['finished']:>8}  {s['hung']:>4}  {s['failed']:>6}  {s['diverged']:>17}  "
              f"{s['left_bytes']:>15}  {s['median_s']:>8}")
    if args.json:
        print(json.dumps({"summary": summary, "runs": rows}))


if __name__ == "__main__":
    main()
