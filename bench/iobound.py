"""The I/O bound of a training step, shared by bench/e2e.py and bench/scale.py.

    io_bound_s = bytes read from nvme / read bandwidth + bytes written to nvme / write bandwidth

The bytes are the engine's own counters for one step (engine.stats()["last_step"]["links"],
nvme_to_dram and dram_to_nvme), not a formula. The bandwidths are `offload bench nvme` run in the same
benchmark, on the same directory, with the engine's aio settings (engine, block size, queue depth,
threads), in a subprocess so its buffer never adds to a measured process's memory. The bench runs with
checksums off: the bound is what the drive moves through our swap path, and checksums are CPU work the
engine must hide like any other. Reads and writes are added, not overlapped: one drive serves both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # this checkout's offload and swap, as the subprocesses get them (PYTHONPATH=REPO)
    sys.path.insert(0, REPO)
NVME_LINKS = ("nvme_to_dram", "dram_to_nvme")  # read, written


def add_io_arguments(ap) -> None:
    from offload.swap.measure import parse_size

    ap.add_argument("--io-size", type=parse_size, default="2G",
                    help="bytes `offload bench nvme` writes then reads in --dir for the step's I/O bound "
                         "(default 2G; 0 skips the measurement)")


def measure_swap(directory: str, size_bytes: int, engine_config: dict) -> dict:
    """{"swap_read_gbps", "swap_write_gbps", ...} of `offload bench nvme` with the engine's aio settings."""
    from offload.plan.config import load_config

    aio = load_config({"aio": engine_config.get("aio", {})}).aio
    cmd = [sys.executable, "-m", "offload", "bench", "nvme", "--dir", directory, "--size", str(size_bytes),
           "--engine", aio.engine, "--block-bytes", str(aio.block_bytes), "--queue-depth", str(aio.queue_depth),
           "--threads", str(aio.threads), "--no-checksum", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO})
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"swap_read_gbps": r["read_gbps"], "swap_write_gbps": r["write_gbps"], "swap_engine": r["engine"],
            "swap_block_bytes": r["block_bytes"], "swap_direct": r["direct"]}


def step_nvme_bytes(links: dict) -> dict:
    """{"nvme_to_dram": bytes read, "dram_to_nvme": bytes written} of one step's link stats."""
    return {k: links[k]["bytes"] for k in NVME_LINKS}


def io_bound_s(nvme_bytes: dict, bw: dict) -> float:
    """bytes read / read bandwidth + bytes written / write bandwidth (GB/s = 1e9 B/s)."""
    return (nvme_bytes["nvme_to_dram"] / (bw["swap_read_gbps"] * 1e9)
            + nvme_bytes["dram_to_nvme"] / (bw["swap_write_gbps"] * 1e9))


def ledger_bytes_per_param(precision: str = "bf16") -> int:
    """What a step must move each way per parameter with weights and states on nvme: the ledger's weight
    and optimizer terms, read once and written once (bf16: 2 B weight + 12 B fp32 master, m, v = 14).
    The gradient term is left out: the accumulator lives in dram within the step and never reaches the drive."""
    from offload.estimate import ledger_terms

    terms = ledger_terms(0, "nvme", "nvme", precision)
    return sum(t.bytes_per_param for t in terms if t.name in ("weights", "optimizer"))


def describe(nvme_bytes: dict, bw: dict, params: int, precision: str = "bf16") -> str:
    """One line: the bound, its formula with the figures, and the bytes per parameter against the ledger."""
    read, written = nvme_bytes["nvme_to_dram"], nvme_bytes["dram_to_nvme"]
    return (f"io bound {io_bound_s(nvme_bytes, bw):.2f} s = bytes read / read bw + bytes written / write bw = "
            f"{read / 1e9:.2f} GB / {bw['swap_read_gbps']:.2f} GB/s + {written / 1e9:.2f} GB / "
            f"{bw['swap_write_gbps']:.2f} GB/s ({read / params:.1f} B/param read, {written / params:.1f} written; "
            f"ledger {ledger_bytes_per_param(precision)} each way)")
