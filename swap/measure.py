"""Swap bandwidth as users see it: write then read SIZE bytes through SwapStore's own path.

Used by `offload bench nvme`, `offload tune nvme` and bench/nvme.py. Figures are GB/s (1e9 bytes/s).
"task" times span the first submission to the last completion; "e2e" times add what a user pays
around it: opening the store (run directory, O_DIRECT probe, I/O backend start, and with warm-up the
first write) for the write, closing it (removing the files) for the read. Host buffers are
pre-faulted and not timed. By default the timed write rewrites keys already on disk, as training
does every step and as DeepSpeed's ds_io does after its warm-up loop; the first write into fresh
blocks is reported too (first_write_gbps), as it is slower on thin-provisioned or copy-on-write disks.
"""

from __future__ import annotations

import collections
import errno
import re
import time

import torch

from .buffers import aligned_empty, round_up
from .store import DEFAULT_BLOCK_BYTES, DEFAULT_CHECKSUM, DEFAULT_QUEUE_DEPTH, DEFAULT_THREADS, SwapStore

# [Note: bounded host memory]
# SIZE is what goes to the drive, not what is held in RAM: the bytes move through a ring of RING_SLOTS
# host slots of one key each, a key being one full I/O queue of the store (block_bytes x queue depth, or
# x threads, capped at CHUNK_BYTES), and a slot is written from (or read into) again only after its last
# transfer completed. So one key is in flight while the next is queued behind it, the drive always has a
# full queue, and RSS stays at the ring (512 MiB at most) whatever SIZE is, where one host buffer of SIZE
# would hold all of it (peak RSS both ways: bench/RESULTS.md, "Figures that code comments carried").

CHUNK_BYTES = 256 << 20  # the largest key: a ring slot ([Note: bounded host memory])
RING_SLOTS = 2           # one key in flight while the next is queued
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int) -> int:
    """'4G', '4GiB', '512M', '1048576' -> bytes (binary units, as fio and ds_io read them)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"size={text!r}: not a size; write e.g. 4G, 512M, 64K or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def fill_pattern(buf: torch.Tensor) -> None:
    """Cheap non-constant contents (an int64 counter), so nothing can compress or dedupe it."""
    words = buf[: buf.numel() // 8 * 8].view(torch.int64)
    step = CHUNK_BYTES // 8
    for s in range(0, words.numel(), step):
        torch.arange(s, min(s + step, words.numel()), out=words[s : s + step])


def key_bytes(block_bytes: int, queue_depth: int, threads: int) -> int:
    """Bytes per key (one ring slot): one full I/O queue of the store, at most CHUNK_BYTES."""
    return min(CHUNK_BYTES, round_up(block_bytes * max(queue_depth, threads)))


def ring_bytes(size_bytes: int, block_bytes: int, queue_depth: int, threads: int) -> int:
    """The host memory measure() moves SIZE through ([Note: bounded host memory])."""
    return min(round_up(size_bytes), RING_SLOTS * key_bytes(block_bytes, queue_depth, threads))


def _cycle(submit, keys: list[tuple[str, int]], slots: list[torch.Tensor]) -> None:
    """submit(key, view of a slot) for every (key, nbytes) in turn, each slot reused only after its last
    transfer completed; returns when every transfer completed."""
    flight: collections.deque = collections.deque()
    for i, (key, nbytes) in enumerate(keys):
        if len(flight) == len(slots):
            flight.popleft().wait()
        flight.append(submit(key, slots[i % len(slots)][:nbytes]))
    while flight:
        flight.popleft().wait()


def measure(directory, size_bytes: int, *, engine: str = "auto", block_bytes: int = DEFAULT_BLOCK_BYTES,
            queue_depth: int = DEFAULT_QUEUE_DEPTH, threads: int = DEFAULT_THREADS,
            checksum: bool = DEFAULT_CHECKSUM, buffer: torch.Tensor | None = None, warmup: bool = True) -> dict:
    """Write then read `size_bytes`; returns a dict of settings, times and GB/s.

    The bytes move through a bounded ring of host memory ([Note: bounded host memory]): `buffer` (filled
    with fill_pattern; sweep() shares one), else ring_bytes() allocated here. With `warmup` the timed
    write is the second one, rewriting every key in place; the first write, into freshly allocated file
    blocks, is reported as first_write_gbps."""
    if size_bytes <= 0:
        raise ValueError(f"size={size_bytes}: must be > 0 bytes")
    ring = buffer if buffer is not None else aligned_empty(ring_bytes(size_bytes, block_bytes, queue_depth, threads))
    if buffer is None:
        fill_pattern(ring)
    per_key = min(key_bytes(block_bytes, queue_depth, threads), ring.numel())
    slots = [ring[s:s + per_key] for s in range(0, ring.numel() - per_key + 1, per_key)]
    keys = [(f"chunk.{i}", min(per_key, size_bytes - s)) for i, s in enumerate(range(0, size_bytes, per_key))]
    # The last key read into each slot must bring back the bytes written from it: its last 4 KiB are
    # zeroed before the reads and compared after.
    last = {i % len(slots): slots[i % len(slots)][:n][-4096:] for i, (_, n) in enumerate(keys)}
    probes = {i: v.clone() for i, v in last.items()}

    t_open = time.perf_counter()
    store = SwapStore(directory, backend=engine, block_bytes=block_bytes, queue_depth=queue_depth,
                      threads=threads, checksum=checksum)
    try:
        t0 = time.perf_counter()
        _cycle(store.write, keys, slots)
        t1 = time.perf_counter()
        first_write_s = t1 - t0
        if warmup:  # time the rewrite in place, the steady state of training (and ds_io's method)
            t0 = time.perf_counter()
            _cycle(store.write, keys, slots)
            t1 = time.perf_counter()
        for v in last.values():
            v.zero_()
        t2 = time.perf_counter()
        _cycle(store.read, keys, slots)
        t3 = time.perf_counter()
        engine_name, direct = store.backend.name, store.direct
    finally:
        store.close()
    t_closed = time.perf_counter()
    if not all(torch.equal(last[i], probes[i]) for i in last):
        raise OSError(errno.EIO, f"swap bench: bytes read back from {directory} differ from bytes written: the drive, "
                      "its filesystem or the I/O backend returned wrong data; run it again with --engine threads to "
                      "tell the backend from the drive, and check the drive")
    gb = size_bytes / 1e9
    return {
        "dir": str(directory), "size_bytes": size_bytes, "engine": engine_name, "block_bytes": block_bytes,
        "queue_depth": queue_depth, "threads": threads, "direct": direct, "checksum": checksum,
        "write_gbps": gb / (t1 - t0), "read_gbps": gb / (t3 - t2),
        "write_task_s": t1 - t0, "read_task_s": t3 - t2,
        "write_e2e_s": t1 - t_open, "read_e2e_s": t_closed - t2,
        "write_e2e_gbps": gb / (t1 - t_open), "read_e2e_gbps": gb / (t_closed - t2),
        "warmup": warmup, "first_write_gbps": gb / first_write_s, "host_bytes": ring.numel(),
    }


def format_table(r: dict) -> str:
    mode = "O_DIRECT" if r["direct"] else "buffered (page cache NOT bypassed: figures overstate the drive)"
    head = (f"swap bench: {r['size_bytes'] / 1e9:.2f} GB in {r['dir']}, engine {r['engine']}, "
            f"block {r['block_bytes']} B, queue depth {r['queue_depth']}, threads {r['threads']}, "
            f"{mode}, checksum {'on' if r['checksum'] else 'off'}"
            + (f"\nwrite = rewrite in place after a warm-up write (first write {r['first_write_gbps']:.2f} GB/s)"
               if r["warmup"] else ""))
    rows = [f"{'':6} {'task s':>8} {'task GB/s':>10} {'e2e s':>8} {'e2e GB/s':>9}"]
    for op in ("write", "read"):
        rows.append(f"{op:6} {r[f'{op}_task_s']:8.3f} {r[f'{op}_gbps']:10.2f} "
                    f"{r[f'{op}_e2e_s']:8.3f} {r[f'{op}_e2e_gbps']:9.2f}")
    return "\n".join([head] + rows + [COLUMNS.format(ring=r["host_bytes"] / 2**20)])


COLUMNS = """\
task: from the first request submitted to the last completed: the drive through our I/O queue (what the
      I/O bound of a training step uses); e2e: task plus what a user pays around it: opening the store
      (run directory, O_DIRECT probe, I/O backend start, and the warm-up write) before the write, closing it
      (removing the files) after the read. Host memory: a {ring:.0f} MiB ring, whatever the size."""


SWEEP_BLOCK_BYTES = (256 << 10, 1 << 20, 4 << 20, 8 << 20)
SWEEP_QUEUE_DEPTHS = (8, 32, 64)
SWEEP_THREADS = (1, 2, 4, 8)


def sweep_configs(engines=("libaio", "threads")) -> list[dict]:
    """block size x queue depth for libaio, block size x threads for threads (each backend ignores
    the other's knob, so sweeping it would only repeat runs)."""
    configs = []
    for engine in engines:
        for block in SWEEP_BLOCK_BYTES:
            if engine == "libaio":
                configs += [dict(engine=engine, block_bytes=block, queue_depth=q, threads=DEFAULT_THREADS)
                            for q in SWEEP_QUEUE_DEPTHS]
            else:
                configs += [dict(engine=engine, block_bytes=block, queue_depth=DEFAULT_QUEUE_DEPTH, threads=t)
                            for t in SWEEP_THREADS]
    return configs


def sweep(directory, size_bytes: int, configs: list[dict], *, checksum: bool = DEFAULT_CHECKSUM,
          progress=None) -> tuple[list[dict], dict]:
    """Measure every config on one shared ring (the largest any config needs); best = shortest write + read
    of the same bytes."""
    buf = aligned_empty(max(ring_bytes(size_bytes, c["block_bytes"], c["queue_depth"], c["threads"]) for c in configs))
    fill_pattern(buf)
    results = []
    for i, cfg in enumerate(configs):
        results.append(measure(directory, size_bytes, checksum=checksum, buffer=buf, **cfg))
        if progress is not None:
            progress(i, results[-1])
    best = min(results, key=lambda r: r["write_task_s"] + r["read_task_s"])
    return results, best


def aio_section(r: dict) -> dict:
    """The runtime's `aio` config section (API.md keys) for one measured result."""
    return {"engine": r["engine"], "block_bytes": r["block_bytes"], "queue_depth": r["queue_depth"],
            "threads": r["threads"]}
