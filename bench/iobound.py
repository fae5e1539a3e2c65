"""The I/O bound of a training step, shared by bench/e2e.py and bench/scale.py.

    io_bound_s = bytes read from nvme / read bandwidth + bytes written to nvme / write bandwidth

The bytes are the engine's own counters for one step (engine.stats()["last_step"]["links"],
nvme_to_dram and dram_to_nvme), not a formula. The bandwidths are `offload bench nvme` run in the same
benchmark, on the same directory, with the engine's aio settings (engine, block size, queue depth,
threads), in a subprocess so its buffer never adds to a measured process's memory. The bench runs with
checksums off: the bound is what the drive moves through our swap path, and checksums are CPU work the
engine must hide like any other. Reads and writes are added, not overlapped: one drive serves both.

The probe's rates are the drive's on a few GB just written; over a step's tens of GB a drive may hold
other rates. So a bench can also time the step's own requests again with nothing else running
(SwapRecorder, replay): the same keys, sizes and order through the same store, no compute and no
hashing. That is the step's I/O bound on this drive as it is now, measured in the same run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

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


class SwapRecorder:
    """While entered, the requests made through `store` (a SwapStore) as (op "r" | "w", key, nbytes), in
    the order they were submitted: what replay() sends again. Held reads (a background save's) are not
    recorded: they are not the step's."""

    def __init__(self, store):
        self.store, self.ops = store, []

    def __enter__(self) -> "SwapRecorder":
        read, write = self.store.read, self.store.write

        def recorded_read(key, into, **kw):
            self.ops.append(("r", key, into.numel() * into.element_size()))
            return read(key, into, **kw)

        def recorded_write(key, tensor, **kw):
            self.ops.append(("w", key, tensor.numel() * tensor.element_size()))
            return write(key, tensor, **kw)

        self.store.read, self.store.write = recorded_read, recorded_write
        return self

    def __exit__(self, *exc) -> None:
        del self.store.read, self.store.write  # the class's methods again


def replay(store, ops: list, window: int = 8) -> dict:
    """Sends `ops` (SwapRecorder.ops) through `store` again in their order, nothing else running: reads into
    and writes from a ring of `window` host buffers, at most `window` requests in flight (each is split into
    the store's blocks, queue_depth of them in flight), as `offload bench nvme` moves its keys. No hashing:
    writes record zero digests and reads are not verified, so the keys hold garbage afterwards: only for a run
    whose data is no longer needed. Returns {"replay_s", "read_bytes", "written_bytes", "requests"}."""
    from offload.swap.buffers import aligned_empty
    from offload.swap.measure import _cycle

    def submit(op_key, buf):
        op, key = op_key
        if op == "r":
            return store.read(key, buf, verify=False)
        zeros = [0] * (len(store.digest_bounds(buf.numel(), 1)) - 1) if store.checksum else None
        return store.write(key, buf, digests=zeros)

    slots = [aligned_empty(max(n for _, _, n in ops)) for _ in range(window)] if ops else []
    t0 = time.perf_counter()
    _cycle(submit, [((op, key), n) for op, key, n in ops], slots)
    return {"replay_s": time.perf_counter() - t0, "requests": len(ops),
            "read_bytes": sum(n for op, _, n in ops if op == "r"),
            "written_bytes": sum(n for op, _, n in ops if op == "w")}
