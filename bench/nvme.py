"""NVMe swap bandwidth: ours (the SwapStore path) next to fio and DeepSpeed's ds_io, same run, same dir.

    python bench/nvme.py --dir /work/nvme-bench --size 4G [--rounds 1] [--json]

Every tool moves the same SIZE with the same block size and queue depth, O_DIRECT, on the same
directory; the runs alternate (ours, fio, ds_io, with the order rotated each round) so a noisy
neighbour hurts all of them alike. Each round also runs ours with checksums on (the default is off),
which is the figure the store's checksum default is chosen from. Figures are GB/s = 1e9 bytes/s; ds_io prints GiB/s
(it divides by 1024**3) and is converted here. The median over rounds is reported.
  All three time a rewrite of data already on disk (the steady state of training): ours rewrites
  its keys in place after a warm-up write, fio runs with --overwrite=1 (it writes the file once
  before timing), ds_io overwrites the file of its warm-up loop. Ours' first write is reported too.
  fio:   --ioengine=libaio --direct=1 --rw=write then --rw=read of one file.
  ds_io: DeepSpeed's aio_handle through /work/dsvenv (or $DS_VENV) when DeepSpeed imports there;
         its write overwrites its warm-up file; its read file is the write's output, renamed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from offload.swap.buffers import aligned_empty  # noqa: E402
from offload.swap.measure import fill_pattern, measure, parse_size, ring_bytes  # noqa: E402
from offload.swap.store import DEFAULT_CHECKSUM  # noqa: E402

DS_VENV = Path(os.environ.get("DS_VENV", "/work/dsvenv"))


def run_ours(args, buf, checksum: bool) -> dict:
    r = measure(args.dir, args.size_bytes, engine=args.engine, block_bytes=args.block_bytes,
                queue_depth=args.queue_depth, threads=args.threads, checksum=checksum, buffer=buf)
    return {"write": r["write_gbps"], "read": r["read_gbps"], "engine": r["engine"], "direct": r["direct"],
            "first_write": r["first_write_gbps"]}


def run_fio(args, op: str) -> float:
    cmd = ["fio", "--name=offload-bench", f"--filename={Path(args.dir) / 'fio-bench.dat'}", f"--rw={op}",
           f"--bs={args.block_bytes}", f"--iodepth={args.queue_depth}", "--ioengine=libaio", "--direct=1",
           f"--size={args.size_bytes}", "--numjobs=1", "--overwrite=1", "--output-format=json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return job[op]["bw_bytes"] / 1e9


def ds_available() -> bool:
    py = DS_VENV / "bin" / "python"
    return py.exists() and subprocess.run([str(py), "-c", "import deepspeed.nvme"], capture_output=True).returncode == 0


def run_ds(args, op: str) -> float:
    size = str(args.size_bytes)
    cmd = [str(DS_VENV / "bin" / "ds_io"), "--folder", args.dir, "--io_size", size, "--block_size",
           str(args.block_bytes), "--queue_depth", str(args.queue_depth), "--loops", "1", "--warmup_loops", "1"]
    if op == "read":
        cmd.append("--read")
        written = Path(args.dir) / f"_aio_write_{size}.pt.0_0"
        if written.exists():  # reuse the write's output instead of ds_io's dd from /dev/urandom
            written.rename(Path(args.dir) / f"_aio_read_{size}.pt.0_0")
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=args.dir)
    m = re.search(rf"Task {op.capitalize()} Speed = ([0-9.eE+-]+) GB/sec", out.stdout)
    if out.returncode != 0 or not m:
        raise RuntimeError(f"ds_io {op} failed (rc {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return float(m.group(1)) * (1 << 30) / 1e9  # ds_io's "GB" is GiB


def one_round(args, buf, use_ds: bool, rnd: int) -> dict:
    steps = [("ours", lambda: run_ours(args, buf, DEFAULT_CHECKSUM)),
             ("fio", lambda: {"write": run_fio(args, "write"), "read": run_fio(args, "read")})]
    if use_ds:
        steps.append(("ds", lambda: {"write": run_ds(args, "write"), "read": run_ds(args, "read")}))
    steps.append(("ours_checksum", lambda: run_ours(args, buf, True)))
    k = rnd % len(steps)
    results = {}
    for name, fn in steps[k:] + steps[:k]:
        results[name] = fn()
        print(f"  round {rnd}: {name:17} write {results[name]['write']:.2f}  read {results[name]['read']:.2f} GB/s",
              flush=True)
    _remove_reference_files(args.dir)
    return results


def _remove_reference_files(directory: str) -> None:
    for p in Path(directory).glob("fio-bench.dat"):
        p.unlink()
    for p in Path(directory).glob("_aio_*.pt.*"):
        p.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="a directory on the drive (not a tmpfs)")
    ap.add_argument("--size", default="1G")
    ap.add_argument("--block-bytes", type=parse_size, default=1 << 20)
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--engine", default="auto")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--no-ds", action="store_true", help="skip DeepSpeed's ds_io even when installed")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.size_bytes = parse_size(args.size)
    os.makedirs(args.dir, exist_ok=True)
    if shutil.which("fio") is None:
        sys.exit("bench/nvme.py: fio not found; apt-get install fio")
    use_ds = not args.no_ds and ds_available()
    buf = aligned_empty(ring_bytes(args.size_bytes, args.block_bytes, args.queue_depth, args.threads))  # bounded
    fill_pattern(buf)
    print(f"nvme bench: {args.size_bytes / 1e9:.2f} GB, block {args.block_bytes} B, queue depth "
          f"{args.queue_depth}, dir {args.dir}, ds_io {'yes' if use_ds else 'absent'}")
    rounds = [one_round(args, buf, use_ds, i) for i in range(args.rounds)]
    med = {name: {op: statistics.median(r[name][op] for r in rounds) for op in ("write", "read")} for name in rounds[0]}
    out = {"read_gbps": med["ours"]["read"], "write_gbps": med["ours"]["write"],
           "fio_read_gbps": med["fio"]["read"], "fio_write_gbps": med["fio"]["write"],
           "ds_read_gbps": med["ds"]["read"] if use_ds else None, "ds_write_gbps": med["ds"]["write"] if use_ds else None,
           "first_write_gbps": statistics.median(r["ours"]["first_write"] for r in rounds),
           "checksum": DEFAULT_CHECKSUM,
           "read_gbps_checksum": med["ours_checksum"]["read"],
           "write_gbps_checksum": med["ours_checksum"]["write"],
           "engine": rounds[0]["ours"]["engine"], "direct": rounds[0]["ours"]["direct"],
           "size_bytes": args.size_bytes, "block_bytes": args.block_bytes, "queue_depth": args.queue_depth,
           "rounds": args.rounds}
    print(f"\n{'':18} {'write GB/s':>10} {'read GB/s':>10} {'write/fio':>10} {'read/fio':>9}")
    for name, label in [("ours", "ours"), ("ours_checksum", "ours + checksum"), ("fio", "fio"), ("ds", "ds_io")]:
        if name in med:
            w, r = med[name]["write"], med[name]["read"]
            print(f"{label:18} {w:10.2f} {r:10.2f} {w / out['fio_write_gbps']:10.2f} {r / out['fio_read_gbps']:9.2f}")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
