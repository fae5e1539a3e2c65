"""Tiers and their accountants: every byte the runtime holds in hbm or dram is charged to one of them.

An accountant knows a budget, the bytes in use and the peak, and refuses an allocation that would go
over the budget with a message naming tier, requested, used and budget. The nvme tier is a directory;
its accountant counts the bytes the swap files hold (budget: the free disk at start).
"""

from __future__ import annotations

import threading

import torch

from offload.scheduler.streams import JobThread
from offload.swap import BufferPool, PoolExhaustedError, aligned_empty
from offload.swap.buffers import populate, round_up

# [Note: reused host memory for hbm]
# On the CPU backend hbm is host memory, and a copy into memory never touched runs at the speed of page
# faults, several times slower than into memory already touched. So a fetched unit's hbm copy takes a
# pre-faulted, 4 KiB-aligned buffer from a pool (swap.BufferPool), put under the unit's own storage with
# UntypedStorage._swap_data_ptr_ (autograd's saved views keep pointing at that storage object) and given
# back on release; being aligned, it takes an nvme fetch's O_DIRECT reads directly (offload.state.residency).
# A cached buffer is held while the step's other memory peaks, so the pool keeps little: only sizes that
# several fetched units share (a model's repeated blocks; a size one unit has alone would sit cached
# between its uses), cached buffers up to the larger of two of the largest such size (a fetch mostly
# takes one just given back) and reuse_bytes (the room the plan leaves for weights kept beyond their
# use), kept across steps since the next forward takes them again. A fetch whose size has no cached
# buffer takes one of up to twice its size (a 7b model's embedding and head take a decoder layer's).
# Used and cached together stay under the planned peak of fetched weights (placement.fetched_peak) and one
# buffer of the largest shared size, as CUDA's caching allocator keeps freed blocks: a unit that took a larger
# cached buffer than its own holds more than the plan counts for it, and a pool without that headroom refused
# the next unit in flight, which mapped fresh memory instead (more memory, not less). Any other request gets
# fresh memory, aligned too and marked for huge pages, faulted in on a thread of its own from the moment the
# fetch is issued (swap.buffers.populate, off the GIL), beside the reads queued before it; the fetch's reads
# wait for it (fault_in). On CUDA, and with a torch that lacks _swap_data_ptr_, storages are resized instead.
# Figures: bench/RESULTS.md ("reused host memory for hbm"), and docs/design.md "Chunks and budgets".

STORAGE_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")  # [Note: reused host memory for hbm]


class TierBudgetError(MemoryError):
    """An allocation would exceed a tier's budget."""

    def __init__(self, tier: str, requested_bytes: int, used_bytes: int, budget_bytes: int, what: str):
        self.tier, self.requested_bytes = tier, requested_bytes
        self.used_bytes, self.budget_bytes = used_bytes, budget_bytes
        super().__init__(
            f"{tier}: cannot allocate {_fmt(requested_bytes)} for {what}: {_fmt(used_bytes)} used of a "
            f"{_fmt(budget_bytes)} budget; raise budgets.{tier}_bytes, offload more (offload_param / "
            f"offload_optimizer), or use smaller units (units.min_numel)"
        )


def _fmt(n: int) -> str:
    return f"{n / 2**20:.1f} MiB ({n} bytes)"


class Accountant:
    """Bytes charged to one tier, with a budget and a peak. Thread-safe (the copy worker allocates too)."""

    def __init__(self, tier: str, budget_bytes: int):
        self.tier, self.budget_bytes = tier, int(budget_bytes)
        self.used_bytes = self.peak_bytes = 0
        self._lock = threading.Lock()

    def charge(self, nbytes: int, what: str) -> None:
        with self._lock:
            if self.used_bytes + nbytes > self.budget_bytes:
                raise TierBudgetError(self.tier, nbytes, self.used_bytes, self.budget_bytes, what)
            self.used_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def refund(self, nbytes: int) -> None:
        with self._lock:
            assert nbytes <= self.used_bytes, f"{self.tier}: refund of {nbytes} > used {self.used_bytes}"
            self.used_bytes -= nbytes

    def fits(self, nbytes: int) -> bool:
        return self.used_bytes + nbytes <= self.budget_bytes

    def stats(self) -> dict:
        return {"used_bytes": self.used_bytes, "peak_bytes": self.peak_bytes, "budget_bytes": self.budget_bytes}


class Tiers:
    """The three accountants plus allocation helpers for hbm and dram tensors."""

    def __init__(self, hbm_device: torch.device, hbm_budget: int, dram_budget: int, nvme_budget: int, pin: bool,
                 hbm_pool_bytes: int = 0, hbm_pool_sizes: frozenset = frozenset(), reuse_bytes: int = 0):
        self.hbm_device, self.pin = hbm_device, pin
        self.acct = {"hbm": Accountant("hbm", hbm_budget), "dram": Accountant("dram", dram_budget),
                     "nvme": Accountant("nvme", nvme_budget)}
        self.reusable = hbm_device.type == "cpu" and STORAGE_SWAP
        # [Note: reused host memory for hbm]; timeout 0: a request that does not fit gets fresh memory
        largest = max(hbm_pool_sizes, default=0)
        cached = max(2 * largest, reuse_bytes)  # a fetch's next buffer: one given back
        # headroom: a unit holding a larger cached buffer than its own
        self.hbm_pool = (BufferPool(hbm_pool_bytes + round_up(largest), timeout_s=0.0, max_cached_bytes=cached)
                         if self.reusable and hbm_pool_bytes > 0 else None)
        self.hbm_pool_sizes = hbm_pool_sizes  # nbytes of the fetched units that share their size
        self._faulter: JobThread | None = None  # faults fresh hbm memory in; started by the first that needs it

    def give_hbm_memory(self, t: torch.Tensor, nbytes: int):
        """Puts `nbytes` of memory under hbm tensor t's storage (empty now); returns what to pass to
        take_hbm_memory and fault_in: None (resized storage) or (buffer, faulted: the completion of fresh
        memory's faulting in, None for a pool buffer) ([Note: reused host memory for hbm])."""
        storage = t.untyped_storage()
        if not self.reusable:
            storage.resize_(nbytes)
            return None
        buf = None
        if self.hbm_pool is not None and nbytes in self.hbm_pool_sizes:
            try:
                buf = self.hbm_pool.acquire(nbytes)
            except PoolExhaustedError:
                pass
        fresh = buf is None
        if fresh:  # but aligned: a fetch reads straight into it
            buf = aligned_empty(nbytes, populate=False)
        storage._swap_data_ptr_(buf.untyped_storage())  # t holds the memory now, buf none
        if not fresh:
            return buf, None
        if self._faulter is None:
            self._faulter = JobThread("hbm-fault")
        return buf, self._faulter.submit(populate, t)  # faulted in from now on

    def take_hbm_memory(self, t: torch.Tensor, lent) -> None:
        """Empties hbm tensor t's storage; pooled memory goes back to the pool, fresh memory is unmapped."""
        storage = t.untyped_storage()
        if lent is None:
            storage.resize_(0)
            return
        buf, faulted = lent
        if faulted is not None:
            faulted.settle()  # no page is faulted in after its bytes were refunded (an error: the reader's)
        storage._swap_data_ptr_(buf.untyped_storage())  # t's storage empty again, the buffer whole again
        if faulted is None:
            self.hbm_pool.release(buf)

    @staticmethod
    def fault_in(lent) -> None:
        """Waits until fresh memory given by give_hbm_memory is faulted in, so the reads into it move at the
        drive's speed instead of waiting on O_DIRECT to fault each page in as it submits (bench/RESULTS.md,
        "Figures that code comments carried"). Pooled memory is faulted in already."""
        if lent is not None and lent[1] is not None:
            lent[1].wait()

    def close(self) -> None:
        if self.hbm_pool is not None:
            self.hbm_pool.clear()  # the cached buffers; lent ones stay valid
        if self._faulter is not None:
            self._faulter.close()

    def empty(self, tier: str, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """A 1-D tensor in `tier`, charged to its accountant (refund with `free`)."""
        nbytes = numel * dtype.itemsize
        self.acct[tier].charge(nbytes, what)
        try:
            if tier == "hbm":  # the default allocator: hbm storages are resized to 0 on release
                return torch.empty(numel, dtype=dtype, device=self.hbm_device)
            return aligned_empty(numel, dtype, pin=self.pin and tier == "dram")
        except BaseException:
            self.acct[tier].refund(nbytes)
            raise

    def free(self, tier: str, tensor: torch.Tensor) -> None:
        self.acct[tier].refund(tensor.numel() * tensor.element_size())

    def stats(self) -> dict:
        return {name: a.stats() for name, a in self.acct.items()}


POOL_TIMEOUT_S = 300.0  # a wait this long means a leaked chunk, not a slow drive: fail with the numbers


class ChunkPool:
    """The one dram staging pool: `count` equal chunks of `chunk_bytes`, allocated (pre-faulted; pinned
    with CUDA) at start and charged to the dram accountant once, so its bytes are the bytes the process
    holds. `acquire` hands out a typed view of a chunk and blocks while all are lent (back-pressure)."""

    def __init__(self, tiers: Tiers, chunk_bytes: int, count: int):
        self.tiers, self.chunk_bytes, self.count = tiers, chunk_bytes, count
        self.capacity_bytes = chunk_bytes * count
        self._pool = None
        if count:
            tiers.acct["dram"].charge(self.capacity_bytes, f"chunk pool ({count} x {chunk_bytes} bytes)")
            self._pool = BufferPool(self.capacity_bytes, pin=tiers.pin, timeout_s=POOL_TIMEOUT_S)
            warm = [self._pool.acquire(chunk_bytes) for _ in range(count)]  # pages faulted in once, reused
            for t in warm:
                self._pool.release(t)

    def acquire(self, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if self._pool is None or nbytes > self.chunk_bytes:
            raise PoolExhaustedError(f"chunk pool: {what} needs {nbytes} bytes, the pool has {self.count} chunks of "
                                     f"{self.chunk_bytes} bytes (an engine bug: every transfer is chunked)",
                                     capacity_bytes=self.capacity_bytes, requested_bytes=nbytes, used_bytes=0)
        return self._pool.acquire(self.chunk_bytes).view(dtype)[:numel]

    def release(self, t: torch.Tensor) -> None:
        self._pool.release(t)

    @property
    def lent(self) -> int:
        """Chunks handed out and not yet released."""
        return 0 if self._pool is None else self._pool.used_bytes // self.chunk_bytes

    def close(self) -> None:
        if self._pool is not None:
            self._pool.clear()
            self._pool = None
            self.tiers.acct["dram"].refund(self.capacity_bytes)
