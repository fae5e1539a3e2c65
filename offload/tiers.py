"""Tiers and their accountants: every byte the runtime holds in hbm or dram is charged to one of them.

An accountant knows a budget, the bytes in use and the peak, and refuses an allocation that would go
over the budget with a message naming tier, requested, used and budget. The nvme tier is a directory;
its accountant counts the bytes the swap files hold (budget: the free disk at start).

[Note: reused host memory for hbm]
On the CPU backend hbm is host memory, and a fetched unit's hbm copy used to be fresh memory every time (its
storage resized back from zero: the allocator maps new pages), so the copy into it ran at the speed of page
faults (about 2 GB/s here, against 11-12 GB/s into memory already touched), a step of the 3b preset spending
about 11 s of a core on it. So fetched copies take their memory from a pool of pre-faulted, 4 KiB-aligned
buffers, reused by size (swap.BufferPool): the buffer's memory is put under the unit's own storage
(UntypedStorage._swap_data_ptr_), which keeps the storage object autograd's saved views point at, as the
resize did, and given back on release. Being aligned, an nvme fetch reads straight into it
(offload.residency). What the pool keeps is bounded three ways, because a cached buffer is held while the
step's other memory (gradients, the embedding's step) peaks: on the 3b preset peak RSS rose from 5.76-5.96 GB
(fresh memory) to 6.43-6.55 GB when every fetched copy's buffer stayed cached, and was 6.26 GB with the bounds
that follow (bench/RESULTS.md). Only sizes that several fetched units share are pooled (a model's repeated
blocks; one unit's own size, an embedding's, would sit cached between its uses); cached buffers wait up to the
larger of two buffers of the largest such size (a fetch's buffer is mostly one just given back) and
reuse_bytes, the room the plan leaves for weights kept beyond their use; and the cache lives across steps,
since the next forward takes its buffers again. A model small enough that every block stays from its forward
to its backward (reuse_bytes covers them) gives them all back in the backward and takes them all again in the
next forward: bench-200m emptied its cache when each backward ended and faulted 14 fresh 25 MB copies in on
the compute thread every step (0.06 s each on this VM, 0.5-1.7 s of system time a step), 4.5-5.3 s a step
against 4.0-4.2 with the cache kept (bench/RESULTS.md). Used and cached together stay under the planned peak
of those fetched weights (placement.fetched_peak), as CUDA's caching allocator keeps freed blocks. A request
the pool does not serve at once (an embedding's size, or no buffer free) gets fresh memory, aligned too and
marked for huge pages, and faulted in at once on a thread of its own (swap.buffers.populate, off the GIL), so
that this overlaps whatever the reader thread still has queued before the fetch: its reads wait for it
(fault_in). Faulting in is not free: on a VM that hands freed memory back to its host (virtio-balloon free
page reporting, as here) the 3b preset's 788 MB embedding took 1.4-1.7 s to fault in, most of the time at the
tied head, where it sat on the reader thread behind the last deferred step with the drive idle. It used to be
the allocator's (a resized storage), whose address O_DIRECT cannot use, so every chunk was read into a fresh
aligned staging buffer and copied: the 3b preset's 788 MB embedding, fetched twice a forward, stalled the
forward 0.2-1.9 s each time. On CUDA, and with a torch that lacks UntypedStorage._swap_data_ptr_ (older
releases), storages are resized.
"""

from __future__ import annotations

import threading

import torch

from scheduler.streams import JobThread
from swap import BufferPool, PoolExhaustedError, aligned_empty
from swap.buffers import populate

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
        cached = max(2 * max(hbm_pool_sizes, default=0), reuse_bytes)  # a fetch's next buffer: one given back
        self.hbm_pool = (BufferPool(hbm_pool_bytes, timeout_s=0.0, max_cached_bytes=cached)
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
        drive's speed (faulted in by O_DIRECT as they were submitted, the 3b preset's 788 MB embedding took
        0.2-1.9 s instead of about 0.25). Pooled memory is faulted in already."""
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
