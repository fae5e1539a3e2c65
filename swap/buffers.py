"""Host buffers that O_DIRECT can use whole: 4 KiB-aligned, padded, pre-faulted (pinned with CUDA).
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import time

import numpy as np
import torch

# [Note: why pre-fault]
# io_submit on pages that were never touched stalls on page faults inside the kernel, and reads into
# fresh pages run several times slower than into touched ones. So every buffer handed out here is
# populated before its first I/O: large ones through madvise(MADV_POPULATE_WRITE) (the kernel zero-fills
# them in one pass), small ones by zeroing. Large buffers are also 2 MiB-aligned and marked MADV_HUGEPAGE:
# O_DIRECT pins the user pages of every transfer, and with huge pages that is one page per 2 MiB instead
# of 512, which speeds up 1 MiB reads and writes alike. Figures for both: bench/RESULTS.md, "NVMe swap"
# and "Figures that code comments carried".

# [Note: pinned buffers are our own]
# With CUDA, pinned (page-locked) buffers are the same populated mappings, registered with
# cudaHostRegister, not torch's pinned allocator: that one rounds every request up to a power of two
# (a 40 MiB unit home would hold 64 MiB) and caches freed blocks, so the bytes the process holds would
# not be the bytes the tier accountants count. A registered mapping holds its size rounded to 4 KiB, and
# is unregistered before it is unmapped (_Mapping.__del__ runs before the mapping's own deallocation).

ALIGN_BYTES = 4096
_MMAP_MIN_BYTES = 1 << 20  # below this, a malloc'd block + zero_() is cheaper than an mmap syscall
_HUGE_BYTES = 2 << 20
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; not in Python's mmap module yet
_libc = ctypes.CDLL(None, use_errno=True)  # its madvise runs without the GIL (populate)


def round_up(nbytes: int, align: int = ALIGN_BYTES) -> int:
    return (nbytes + align - 1) // align * align


def is_aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % ALIGN_BYTES == 0


def aligned_empty(numel: int, dtype: torch.dtype = torch.uint8, *, pin: bool = False,
                  populate: bool = True) -> torch.Tensor:
    """A 1-D contiguous tensor of `numel` elements whose data_ptr is 4 KiB-aligned and whose
    storage extends to a multiple of 4 KiB past it; pages are pre-faulted (see the Note above) unless
    `populate` is False: then a large one is faulted in as it is first written (in huge pages where the
    kernel has them), by whoever writes it. Populating here runs under the GIL, so every thread of the
    process waits while the kernel faults the pages in (compacting memory for huge pages, at times for
    seconds); populate() does it off the GIL."""
    if numel < 0:
        raise ValueError(f"numel={numel}: must be >= 0")
    itemsize = torch.empty((), dtype=dtype).element_size()
    padded = max(round_up(numel * itemsize), ALIGN_BYTES)
    pin = pin and torch.cuda.is_available()
    if pin or padded >= _MMAP_MIN_BYTES:
        raw = _mmap_populated(padded, register=pin, populate=populate or pin)  # [Note: pinned buffers are our own]
    else:  # numpy's block, sliced: the storage itself starts aligned, as the mmap path's does
        block = np.empty(padded + ALIGN_BYTES, dtype=np.uint8)
        skip = (-block.ctypes.data) % ALIGN_BYTES
        raw = torch.from_numpy(block[skip : skip + padded])
        raw.zero_()
    return raw.view(dtype)[:numel]


class _Mapping(mmap.mmap):
    """An anonymous mapping that can be registered with CUDA (page-locked, for asynchronous copies); a
    registered one is unregistered when the mapping is collected, before mmap unmaps it."""

    _registered: int | None = None

    def register(self, ptr: int, nbytes: int) -> None:
        err = int(_cudart().cudaHostRegister(ptr, nbytes, 0))
        if err:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes at 0x{ptr:x} failed (cudaError {err}): the "
                               "system would not page-lock that much; lower the dram budget or chunk_bytes")
        self._registered = ptr

    def __del__(self) -> None:
        if self._registered is not None:
            ptr, self._registered = self._registered, None
            _cudart().cudaHostUnregister(ptr)


POPULATE_PIECE_BYTES = 32 << 20  # one madvise call's share (populate)


_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD = -3, -1  # glibc's mallopt parameters
HEAP_THRESHOLD_BYTES = 32 << 20  # where glibc's own threshold rises to on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
_large = {"holders": 0, "lock": threading.Lock()}


def map_large_allocations(threshold_bytes: int = 1 << 20) -> bool:
    """Makes the C library give every allocation of at least `threshold_bytes` its own mapping, unmapped
    when freed (glibc's mallopt M_MMAP_THRESHOLD); False where the C library has no mallopt. A training step
    allocates and frees gigabytes of activations in tensors of a few MB. By default glibc raises its mmap
    threshold to up to 32 MB after the first large free and serves such tensors from its heap, whose free
    chunks keep their pages: on the CPU backend, where activations live in host memory, the process's RSS
    then grew step after step past what was live (bench/RESULTS.md, LoRA on the 7b preset). Setting the
    threshold also stops that adjustment. Process-wide; the engine sets it on the CPU backend only, where
    torch's own tensors of that size go to the compiled library's allocator instead when it loads
    (offload.kernels.cpu_adam.open_host_cache): this keeps what other libraries allocate honest. Counted:
    release_large_allocations() ends one."""
    with _large["lock"]:
        _large["holders"] += 1
        return _mallopt_threshold(threshold_bytes)


def release_large_allocations() -> None:
    """Ends one map_large_allocations(); with none left, the threshold goes to HEAP_THRESHOLD_BYTES, where
    glibc's own adjustment takes it after the first large free (setting it stopped that adjustment for good),
    and the heap's trim threshold to twice that, as that adjustment sets it: blocks under it come from the
    heap again, reused without their pages faulted in anew each time (with every such block mapped afresh,
    torch work after an engine closed ran 2.2x slower: bench/RESULTS.md)."""
    with _large["lock"]:
        _large["holders"] = max(0, _large["holders"] - 1)
        if _large["holders"] == 0 and _mallopt_threshold(HEAP_THRESHOLD_BYTES):
            _libc.mallopt(ctypes.c_int(_M_TRIM_THRESHOLD), ctypes.c_int(2 * HEAP_THRESHOLD_BYTES))


def _mallopt_threshold(nbytes: int) -> bool:
    mallopt = getattr(_libc, "mallopt", None)
    return bool(mallopt is not None and mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(nbytes)) == 1)


def populate(t: torch.Tensor) -> bool:
    """Faults in the pages under host tensor t now, on the calling thread, without holding the GIL
    (MADV_POPULATE_WRITE through ctypes); False where the kernel lacks it (the first write faults them).
    In pieces of POPULATE_PIECE_BYTES: one call holds the process's mmap lock while it faults, so every
    other thread's mmap or munmap (a tensor allocated or freed) waits for it; on a VM whose host backs
    fresh memory slowly, one call over a whole embedding would stall the compute thread for seconds
    (bench/RESULTS.md, "fresh copies faulted in beside the reader")."""
    begin = t.data_ptr() - t.data_ptr() % ALIGN_BYTES
    end = begin + round_up(t.data_ptr() + t.numel() * t.element_size() - begin)
    for at in range(begin, end, POPULATE_PIECE_BYTES):
        length = min(POPULATE_PIECE_BYTES, end - at)
        if _libc.madvise(ctypes.c_void_p(at), ctypes.c_size_t(length), _MADV_POPULATE_WRITE) != 0:
            return False
    return True


def _cudart():
    return torch.cuda.cudart()


def _mmap_populated(padded: int, register: bool = False, populate: bool = True) -> torch.Tensor:
    """Anonymous memory, 2 MiB-aligned and marked for transparent huge pages when large, populated (unless
    not `populate`); registered with CUDA (pinned) when `register`."""
    huge = padded >= 2 * _HUGE_BYTES
    region = _Mapping(-1, padded + (_HUGE_BYTES if huge else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP disabled: 4 KiB pages still work
            pass
    skip = (-torch.frombuffer(region, dtype=torch.uint8).data_ptr()) % (_HUGE_BYTES if huge else ALIGN_BYTES)
    # the storage itself starts aligned (offload.state.tiers puts it under another storage); keeps `region` alive
    raw = torch.frombuffer(memoryview(region)[skip : skip + padded], dtype=torch.uint8)
    try:
        if populate:
            region.madvise(_MADV_POPULATE_WRITE)  # the kernel faults everything in, in one call
    except (OSError, ValueError):  # kernels before 5.14
        raw.zero_()
    if register:
        region.register(raw.data_ptr(), padded)
    return raw


def _storage_id(t: torch.Tensor) -> int:
    # Every raw buffer has its own storage; a zero-byte view has data_ptr 0 but keeps its storage.
    return t.untyped_storage().data_ptr()


class PoolExhaustedError(MemoryError):
    """A BufferPool could not serve a request within its timeout (or ever)."""

    def __init__(self, msg: str, *, capacity_bytes: int, requested_bytes: int, used_bytes: int):
        super().__init__(msg)
        self.capacity_bytes = capacity_bytes
        self.requested_bytes = requested_bytes
        self.used_bytes = used_bytes


SLACK_RATIO = 2  # BufferPool: a request takes a cached buffer at most this many times its size


class BufferPool:
    """Aligned host buffers under a fixed byte capacity, with back-pressure.

    acquire() waits while the pool is full and fails after `timeout_s` naming capacity, requested
    and in-use bytes. Released buffers are cached by padded size and reused, up to `max_cached_bytes`
    (default: the capacity); cached-but-free memory is dropped when a request of another size needs the
    room, so used + cached <= capacity always. A request with no cached buffer of its size takes the
    smallest cached one up to twice its size (SLACK_RATIO) before it maps a new one: a new buffer is
    faulted in, page by page, at the speed of the kernel zeroing it (swap/buffers.py, [Note: why
    pre-fault]), so models whose fetched units come in two sizes (an embedding beside its decoder
    layers) would otherwise map one afresh every few fetches. used_bytes counts what is lent whole.
    """

    def __init__(self, capacity_bytes: int, *, pin: bool = False, timeout_s: float = 30.0,
                 max_cached_bytes: int | None = None):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes={capacity_bytes}: must be > 0; give the pool some bytes")
        self.capacity_bytes = int(capacity_bytes)
        self.max_cached_bytes = self.capacity_bytes if max_cached_bytes is None else int(max_cached_bytes)
        self.pin = pin
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._free: dict[int, list[torch.Tensor]] = {}  # padded size -> cached raw buffers
        self._cached_bytes = 0
        self._lent: dict[int, tuple[torch.Tensor, int]] = {}  # storage address -> (raw buffer, padded)
        self.used_bytes = 0
        self.peak_bytes = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of exactly `nbytes` (4 KiB-aligned, storage padded to 4 KiB)."""
        padded = max(round_up(nbytes), ALIGN_BYTES)
        if nbytes < 0 or padded > self.capacity_bytes:
            raise PoolExhaustedError(
                f"BufferPool: requested {nbytes} bytes ({padded} padded) but capacity is "
                f"{self.capacity_bytes} bytes (in use {self.used_bytes}); raise the pool's capacity",
                capacity_bytes=self.capacity_bytes, requested_bytes=nbytes, used_bytes=self.used_bytes)
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while self.used_bytes + padded > self.capacity_bytes:
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                raise PoolExhaustedError(
                    f"BufferPool: timed out after {self.timeout_s}s waiting for {nbytes} bytes; "
                    f"capacity {self.capacity_bytes} bytes, in use {self.used_bytes}; release "
                    f"buffers sooner or raise the capacity",
                    capacity_bytes=self.capacity_bytes, requested_bytes=nbytes, used_bytes=self.used_bytes)
            raw = self._take_locked(padded)
            held = raw.numel()
            self.used_bytes += held
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)
            self._lent[_storage_id(raw)] = (raw, held)
        return raw[:nbytes]

    def _take_locked(self, padded: int) -> torch.Tensor:
        """A cached buffer of `padded` bytes or of the fewest bytes up to SLACK_RATIO x that, else a new one.
        A cached one keeps used + cached as it was; a new one has room (the caller waited for it)."""
        fits = [size for size, cached in self._free.items() if cached and padded <= size <= SLACK_RATIO * padded]
        if fits:
            size = min(fits)
            self._cached_bytes -= size
            return self._free[size].pop()
        # Drop cached buffers of other sizes until the new one fits under the capacity.
        for size in sorted(self._free, reverse=True):
            while self._free[size] and self.used_bytes + self._cached_bytes + padded > self.capacity_bytes:
                self._free[size].pop()
                self._cached_bytes -= size
        return aligned_empty(padded, torch.uint8, pin=self.pin)

    def release(self, t: torch.Tensor) -> None:
        with self._cond:
            lent = self._lent.pop(_storage_id(t), None)
            if lent is None:
                raise ValueError(
                    f"BufferPool.release: tensor at 0x{t.data_ptr():x} was not acquired from this pool "
                    f"or was already released")
            raw, padded = lent
            self.used_bytes -= padded
            if self._cached_bytes + padded <= self.max_cached_bytes:  # else dropped: its memory goes back
                self._free.setdefault(padded, []).append(raw)
                self._cached_bytes += padded
            self._cond.notify_all()

    def clear(self) -> None:
        """Drop cached free buffers (buffers still lent out stay valid)."""
        with self._cond:
            self._free.clear()
            self._cached_bytes = 0
