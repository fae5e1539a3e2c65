"""The swap store: tensors under stable string keys in one unlinked file per run, moved asynchronously.

key -> Entry(offset, nbytes, per-block checksum). Entries are 4 KiB-granular extents of one data file
(a 10-byte tensor takes 4 KiB, not DeepSpeed's 1 MiB minimum); the file grows at its end with
fallocate, so O_DIRECT writes land in allocated blocks. The file has no name ([Note: unlinked data
file] in swap/rundir.py): its bytes go when the process ends, however it ends; the run directory's
owner.json records its size as it grows, `describe()` and `disk_bytes` say where it is and what it holds.

[Note: what a failed write leaves]
A write removes its key from the index before the first byte moves and puts it back only when every
block has completed (and verified its length). So a failed write leaves the key missing, never a
key that reads back a mix of old and new bytes. An overwrite of the same padded size reuses the
extent in place (no doubled disk use for the common swap-out of the same unit).

[Note: copies]
An aligned contiguous tensor moves without a copy: its 4 KiB-multiple body goes straight between
its memory and the file, and only a partial last page (< 4 KiB) bounces through a page-sized buffer,
so bytes past the tensor (a neighbour in a flat buffer) are never written. Anything else bounces
through one aligned staging buffer.
"""

from __future__ import annotations

import atexit
import errno
import functools
import logging
import os
import shutil
import threading
import time
import weakref
from bisect import bisect_left
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from .buffers import ALIGN_BYTES, aligned_empty, is_aligned, round_up
from .backends import Block, IOBackend, host_buffer, open_backend
from .errors import SwapCorruptionError, SwapIOError
from .pending import Pending, PendingTimeout, held, io_timeout_s
from .rundir import make_run_dir, open_unlinked, supports_direct, write_owner

log = logging.getLogger("swap")

DEFAULT_BLOCK_BYTES = 8 << 20  # training's: the config's aio.block_bytes (tests/test_cli_nvme.py holds them equal)
DEFAULT_QUEUE_DEPTH = 32
DEFAULT_THREADS = 4
# Off by default: hashing takes a core and memory bandwidth from CPU Adam, which runs while
# the optimizer's states stream to and from NVMe (its cost on the swap bandwidth, on the reaper thread
# and on helper threads: bench/RESULTS.md, "NVMe swap", `python bench/nvme.py --size 4G --rounds 3`).
# Short or failed transfers are caught without it and the drive and link carry their own ECC/CRC. Turn
# it on (checksum=True) to also catch silent corruption of the swap files.
DEFAULT_CHECKSUM = False
_MASK64 = (1 << 64) - 1
OWNER_RECORD_S = 1.0  # owner.json's size is rewritten at a growth this long after its last record (or by 1/8)


def block_digest(addr: int, nbytes: int) -> int:
    """128-bit checksum of one I/O block: (xor << 64) | sum of its little-endian 64-bit words.

    [Note: why not crc32]
    zlib.crc32 on one core of a busy 2-core machine is slower than a fast drive, so it becomes the
    bottleneck of swap reads (bench/RESULTS.md, "Figures that code comments carried"). Two numpy
    reductions over a block that is already in cache run several times faster. They catch what goes
    wrong with swap files: flipped bits, zeroed, stale, misdirected or torn blocks, truncation; they do
    not catch 8-byte words swapped inside one block.
    """
    n8 = nbytes - nbytes % 8
    s = x = 0
    if n8:
        s, x = _word_digest(addr, n8)
    if nbytes > n8:
        rest = int.from_bytes(bytes(host_buffer(addr + n8, nbytes - n8)), "little")
        s, x = s + rest, x ^ (rest << 1)
    return (x << 64) | (s & _MASK64)


def _numpy_word_digest(addr: int, n8: int) -> tuple[int, int]:
    """(sum mod 2**64, xor) of the 64-bit words of the n8 bytes at addr, in two numpy passes."""
    words = np.frombuffer(host_buffer(addr, n8), dtype=np.uint64)
    return int(np.add.reduce(words, dtype=np.uint64)), int(np.bitwise_xor.reduce(words))


_word_digest = _numpy_word_digest


def use_word_digest(fn) -> None:
    """Makes block_digest take its (sum, xor) of 64-bit words from fn(addr, n8) -> (sum, xor), where n8
    is a multiple of 8; None: numpy's two passes again. offload hands in its compiled kernel's single
    pass (offload.kernels.cpu_adam.use_for_swap_digests), which swap cannot import."""
    global _word_digest
    _word_digest = _numpy_word_digest if fn is None else fn


def tensor_digests(t: torch.Tensor, bounds) -> tuple[int, ...]:
    """block_digest of each element span [bounds[i], bounds[i + 1]) of the contiguous tensor `t`
    (bounds from SwapStore.digest_bounds): what `write(digests=)` and `check_digests` take."""
    base, size = t.data_ptr(), t.element_size()
    return tuple(block_digest(base + b * size, (e - b) * size) for b, e in zip(bounds, bounds[1:]))


def io_spans(nbytes: int, block_bytes: int) -> list[tuple[int, int]]:
    """(start, bytes) of the I/O blocks over the 4 KiB-multiple body (a partial last page moves apart)."""
    body = nbytes - nbytes % ALIGN_BYTES
    return [(s, min(block_bytes, body - s)) for s in range(0, body, block_bytes)]


def digest_spans(nbytes: int, block_bytes: int) -> list[tuple[int, int]]:
    """(start, bytes) of what each recorded digest covers: the blocks, then the partial last page."""
    body = nbytes - nbytes % ALIGN_BYTES
    return io_spans(nbytes, block_bytes) + ([(body, nbytes - body)] if nbytes > body else [])


def digest_bounds(numel: int, itemsize: int, block_bytes: int) -> list[int]:
    """SwapStore.digest_bounds for a store of `block_bytes` blocks, without one."""
    starts = [s for s, _ in digest_spans(numel * itemsize, block_bytes)]
    if any(b % itemsize for b in starts):
        raise ValueError(f"itemsize={itemsize}: blocks of {block_bytes} bytes do not split into items")
    return [b // itemsize for b in starts] + [numel]


@dataclass(frozen=True, slots=True)
class Entry:
    offset: int
    nbytes: int
    crcs: tuple[int, ...] | None  # one block_digest per I/O block, None when checksums are off

    @property
    def padded_bytes(self) -> int:
        return round_up(self.nbytes)


class Extents:
    """First-fit allocator of 4 KiB-granular extents in one file; coalesces on free."""

    def __init__(self):
        self.end_bytes = 0
        self._free: list[tuple[int, int]] = []  # sorted (offset, length)

    def alloc(self, padded: int) -> tuple[int, int]:
        """(offset, new end of file). The caller grows the file when the end moved."""
        for i, (off, length) in enumerate(self._free):
            if length >= padded:
                if length == padded:
                    del self._free[i]
                else:
                    self._free[i] = (off + padded, length - padded)
                return off, self.end_bytes
        if self._free and sum(self._free[-1]) == self.end_bytes:  # extend the free tail
            off, _ = self._free.pop()
        else:
            off = self.end_bytes
        self.end_bytes = off + padded
        return off, self.end_bytes

    def free(self, off: int, padded: int) -> None:
        i = bisect_left(self._free, (off, 0))
        if i < len(self._free) and off + padded == self._free[i][0]:  # merge with the next
            padded += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == off:  # merge with the previous
            off, prev = self._free.pop(i - 1)
            padded += prev
            i -= 1
        self._free.insert(i, (off, padded))


class Ticket(Pending):
    """One asynchronous write or read. wait() raises SwapIOError / SwapCorruptionError, or PendingTimeout
    after the I/O timeout (swap.pending) naming the key, its bytes and the blocks still outstanding."""

    is_write = False

    def __init__(self, nblocks: int, finish, what: str = "swap transfer", nbytes: int = 0):
        super().__init__(what, nbytes)
        self._nblocks = self._remaining = nblocks
        self._finish = finish  # runs once, on the thread that completes the last block
        self._errors: list[BaseException] = []
        if nblocks == 0:
            self._run_finish()

    def describe(self) -> str:
        return f"{super().describe()}, {self._remaining} of {self._nblocks} blocks outstanding"

    def _block_done(self, err: BaseException | None) -> None:
        with self._lock:
            if err is not None:
                self._errors.append(err)
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self._run_finish()

    def _run_finish(self) -> None:
        error = None
        try:
            self._finish(self._errors[0] if self._errors else None)
        except BaseException as e:  # noqa: BLE001  (delivered to wait(), not lost on a thread)
            error = e
        self._finish = None  # drop buffers and tensors held by the closure
        self.complete(error)


# [Note: files at exit]
# The data file's bytes need no cleanup: they go with the process ([Note: unlinked data file] in
# swap/rundir.py). What close() removes is the run directory with its owner.json; stores still open are
# closed at interpreter exit (atexit: also after an uncaught exception or Ctrl-C's KeyboardInterrupt). The
# store installs no signal handler: a SIGTERM keeps its default action and ends the process at once, even
# inside a long C call, leaving a stale run directory (owner.json only) that `offload clean` removes; a
# process that ends itself with os._exit (offload.watchdog) removes its run directories first (remove_run_dirs).
# A forked child (a DataLoader worker) closes its copy of the parent's data files and forgets the stores,
# so it neither holds their bytes after the parent ended nor removes the parent's run directories.
_open_stores: "weakref.WeakSet[SwapStore]" = weakref.WeakSet()


def _forget_stores_in_child() -> None:
    for store in list(_open_stores):
        store._forget_after_fork()
    _open_stores.clear()


os.register_at_fork(after_in_child=_forget_stores_in_child)


@atexit.register
def _close_all_at_exit() -> None:
    for store in list(_open_stores):
        store.close()


def remove_run_dirs() -> None:
    """Removes the run directory of every store this process holds open, leaving the stores as they are: for
    a process about to end with os._exit (which runs no atexit), whose data files' bytes go with it."""
    for store in list(_open_stores):
        store._remove_files()


class SwapStore:
    """Tensors under string keys in a private run directory; see the module docstring."""

    def __init__(self, directory, *, backend: str | IOBackend = "auto", block_bytes: int = DEFAULT_BLOCK_BYTES,
                 queue_depth: int = DEFAULT_QUEUE_DEPTH, threads: int = DEFAULT_THREADS,
                 checksum: bool = DEFAULT_CHECKSUM, direct: bool | None = None,
                 background_bytes: int | None = None):
        if block_bytes < ALIGN_BYTES or block_bytes % ALIGN_BYTES:
            raise ValueError(f"block_bytes={block_bytes}: must be a positive multiple of {ALIGN_BYTES}; "
                             f"1048576 (1 MiB) suits most NVMe drives")
        self.block_bytes = block_bytes
        self.checksum = checksum
        self._closed = True  # until construction succeeds (so __del__ of a half-built store is a no-op)
        self._owns_backend = isinstance(backend, str)
        self.backend = (open_backend(backend, queue_depth=queue_depth, threads=threads,
                                     background_bytes=background_bytes)
                        if self._owns_backend else backend)
        try:
            self.run_dir, self._owner = make_run_dir(directory)
            try:
                self.direct = self._choose_direct(direct)
                self._fd, self.file_kind = open_unlinked(self.run_dir, os.O_RDWR | (os.O_DIRECT if self.direct else 0))
                # What errors name: the directory the bytes are in and where the process holds them.
                self.path = f"{self.run_dir}/(unlinked data file, /proc/{os.getpid()}/fd/{self._fd})"
                self._owner_lock, self._owner_time = threading.Lock(), time.monotonic()
                with self._owner_lock:
                    self._update_owner(fd=self._fd, data=self.file_kind)
            except BaseException:
                if getattr(self, "_fd", None) is not None:
                    os.close(self._fd)
                self._remove_files()
                raise
        except BaseException:
            if self._owns_backend:
                self.backend.close()
            raise
        self._closed = False
        self._lock = threading.Lock()
        self._index: dict[str, Entry] = {}
        self._extents = Extents()
        self._pending: dict[str, set[Ticket]] = {}
        # A backend that completes every block on one thread (libaio's reaper) hands checksums to
        # helpers: computed inline they delayed resubmission and cost about a quarter of the bandwidth.
        serial = checksum and getattr(self.backend, "serial_completions", False)
        self._digest_pool = ThreadPoolExecutor(2, thread_name_prefix="swap-digest") if serial else None
        _open_stores.add(self)

    def _choose_direct(self, direct: bool | None) -> bool:
        ok = supports_direct(self.run_dir)
        if direct and not ok:
            raise ValueError(f"direct=True: {self.run_dir.parent} refuses O_DIRECT (a tmpfs?); "
                             f"use direct=None to fall back to buffered I/O, or a directory on a disk")
        return ok if direct is None else bool(direct)

    # ---- public API ------------------------------------------------------------------------------
    def write(self, key: str, tensor: torch.Tensor, *, digests=None) -> Ticket:
        """Start writing `tensor` under `key`; keep `tensor` unchanged until ticket.wait().

        digests: with checksums on, the block digests of `tensor` when the caller already computed them
        (one per span of `digest_bounds`, as `block_digest`); the store then records them unhashed."""
        self._check_open()
        _check_key(key)
        _check_host(tensor, "tensor")
        self._settle(key, writes_only=False)
        nbytes = tensor.numel() * tensor.element_size()
        if digests is not None and len(digests) != self._nblocks(nbytes):
            raise ValueError(f"digests: {len(digests)} given for {key!r}, its {nbytes} bytes have "
                             f"{self._nblocks(nbytes)} blocks; compute them over digest_bounds()")
        src, staged = self._source(tensor, nbytes)
        offset, err = self._place(key, nbytes)
        if err is not None:
            return self._failed(err)
        self._record_size_if_needed()
        crcs = None
        if self.checksum:
            crcs = list(digests) if digests is not None else [0] * self._nblocks(nbytes)

        def finish(first_err):
            self._finish_write(key, offset, nbytes, crcs, first_err, src, staged)

        return self._start(key, True, offset, nbytes, src, crcs if digests is None else None, finish)

    def digest_bounds(self, numel: int, itemsize: int) -> list[int]:
        """Element offsets where the checksummed blocks of a `numel`-element tensor start, then numel:
        the spans a caller hashes for `write(digests=)` and `check_digests` (see `block_digest`)."""
        return digest_bounds(numel, itemsize, self.block_bytes)

    def check_digests(self, key: str, digests) -> None:
        """Raises SwapCorruptionError naming the first block whose digest (hashed by the caller from what
        `read(key, verify=False)` delivered) differs from the one recorded when `key` was written."""
        with self._lock:
            entry = self._index.get(key)
        if entry is None or entry.crcs is None:
            raise ValueError(f"check_digests({key!r}): no digests recorded (key missing, or checksums off)")
        if len(digests) != len(entry.crcs):
            raise ValueError(f"digests: {len(digests)} given for {key!r}, {len(entry.crcs)} recorded")
        for i, (got, want) in enumerate(zip(digests, entry.crcs)):
            if got != want:
                start, n = self._digest_spans(entry.nbytes)[i]
                raise SwapCorruptionError(f"checksum mismatch in {key!r} (read {got:#034x}, written {want:#034x})",
                                          path=str(self.path), offset=entry.offset + start, nbytes=n)

    def read(self, key: str, into: torch.Tensor, *, verify: bool = True, urgent: bool = False) -> Ticket:
        """Start reading `key` into the contiguous tensor `into` (same nbytes as written).

        verify=False (checksums on): the blocks are not hashed here; the caller hashes what it reads
        and passes the digests to `check_digests` before it uses or writes back any of it.
        urgent: its blocks go ahead of queued ones that are not ([Note: urgent blocks] in swap/backends.py)."""
        self._check_open()
        _check_host(into, "into")
        if not into.is_contiguous():
            raise ValueError(f"into: must be contiguous (shape {tuple(into.shape)}, strides {into.stride()}); "
                             f"read into a contiguous buffer and copy")
        self._settle(key, writes_only=True)
        with self._lock:
            entry = self._index.get(key)
        if entry is None:
            raise KeyError(f"swap key {key!r} not in the store (never written, deleted, or its write failed)")
        nbytes = into.numel() * into.element_size()
        if nbytes != entry.nbytes:
            raise ValueError(f"into: has {nbytes} bytes but key {key!r} holds {entry.nbytes}; "
                             f"read into a tensor of the same byte size")
        dst, staged = self._destination(into, nbytes)

        def finish(first_err):
            if first_err is not None:
                raise first_err
            _copy_out(into, dst, staged, nbytes)

        return self._start(key, False, entry.offset, nbytes, dst, entry.crcs if verify else None, finish, urgent)

    def delete(self, key: str) -> None:
        self._settle(key, writes_only=False)
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is None:
                raise KeyError(f"swap key {key!r} not in the store")
            if entry.nbytes:
                self._extents.free(entry.offset, entry.padded_bytes)

    def __contains__(self, key: str) -> bool:
        self._settle(key, writes_only=True)
        with self._lock:
            return key in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._index)

    def nbytes(self, key: str) -> int:
        self._settle(key, writes_only=True)
        with self._lock:
            if key not in self._index:
                raise KeyError(f"swap key {key!r} not in the store")
            return self._index[key].nbytes

    @property
    def disk_bytes(self) -> int:
        """Bytes the data file occupies on disk (allocated blocks, as `du` would count them had it a name)."""
        if self._closed:
            return 0
        return os.fstat(self._fd).st_blocks * 512

    @property
    def fd_path(self) -> str:
        """A path that opens the data file while the store is open (this process's /proc/self/fd entry)."""
        self._check_open()
        return f"/proc/self/fd/{self._fd}"

    def describe(self) -> str:
        """One line: where the swap bytes are, how many, and why `ls` does not show them."""
        if self._closed:
            return f"swap: closed (its data file in {self.run_dir} is gone)"
        return (f"swap: {self.disk_bytes / 2**20:.1f} MiB in an unlinked data file ({self.file_kind}) in "
                f"{self.run_dir}, held as /proc/{os.getpid()}/fd/{self._fd}: `ls` does not show it and its "
                f"bytes go when the process ends; `offload clean --list {self.run_dir.parent}` lists live runs")

    def where(self) -> dict:
        """What `engine.stats()["swap"]` reports: run_dir, file (how it is unlinked), proc_path, disk_bytes."""
        return {"run_dir": str(self.run_dir), "file": self.file_kind,
                "proc_path": None if self._closed else f"/proc/{os.getpid()}/fd/{self._fd}",
                "disk_bytes": self.disk_bytes}

    def close(self) -> None:
        """Wait for in-flight I/O (up to the I/O timeout in all), stop the backend, close the data file (its
        bytes go) and remove the run directory. Idempotent; errors of the transfers it waits for are their
        waiters' to raise, not close()'s. A transfer stuck past the timeout keeps its thread and the file
        descriptor (a late write must not land in a reused fd), so the bytes stay until the process ends;
        the run directory is removed all the same."""
        if self._closed:
            return
        self._closed = True
        _open_stores.discard(self)
        deadline = time.monotonic() + io_timeout_s()
        with self._lock:
            tickets = [t for ts in self._pending.values() for t in ts]
        stuck = False
        for t in tickets:
            try:
                t.settle(max(0.0, deadline - time.monotonic()))
            except PendingTimeout as e:
                log.warning("swap: closing %s with I/O still pending: %s", self.run_dir, e)
                stuck = True
        if stuck:  # a thread may still be in the kernel with our fd: remove the files, leave fd and threads
            self._remove_files()
            return
        if self._owns_backend:
            self.backend.close()
        if self._digest_pool is not None:
            self._digest_pool.shutdown(wait=True)
        os.close(self._fd)
        self._remove_files()

    def __enter__(self) -> "SwapStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.close()

    # ---- internals -------------------------------------------------------------------------------
    def _remove_files(self) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def _forget_after_fork(self) -> None:
        """In a forked child: close the inherited data file and never touch the run directory."""
        self._closed = True
        try:
            os.close(self._fd)
        except OSError:
            pass

    def _update_owner(self, **changes) -> None:
        """Rewrite owner.json with `changes` (swap/rundir.py); the caller holds _owner_lock."""
        if any(self._owner.get(k) != v for k, v in changes.items()):
            self._owner = {**self._owner, **changes}
            write_owner(self.run_dir, self._owner)

    def _record_size_if_needed(self) -> None:
        """After the file grew: its new size into owner.json, for `offload clean --list` where it cannot read
        the size from /proc (swap/rundir.py). Rewriting owner.json costs about 1 ms (create, write, rename),
        and a model's first writes grow the file thousands of times, so it is rewritten only when the size
        grew by an eighth since the last record or that record is older than OWNER_RECORD_S. A failure to
        write it is logged (the swap itself is fine)."""
        end, recorded = self._extents.end_bytes, self._owner["bytes"]
        if end == recorded:  # the common case: rewritten in place
            return
        if end < recorded + recorded // 8 and time.monotonic() - self._owner_time < OWNER_RECORD_S:
            return
        try:
            with self._owner_lock:  # the size read under the lock: a later writer never records an older one
                self._update_owner(bytes=self._extents.end_bytes)
                self._owner_time = time.monotonic()
        except OSError as e:
            log.warning("swap: cannot record the data file's size in %s/owner.json: %s", self.run_dir, e)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"SwapStore at {self.run_dir} is closed; create a new store")

    def _nblocks(self, nbytes: int) -> int:
        return len(self._digest_spans(nbytes))

    def _settle(self, key: str, *, writes_only: bool) -> None:
        """Wait for earlier operations on `key` (all of them, or only a pending write)."""
        with self._lock:
            tickets = list(self._pending.get(key, ()))
        for t in tickets:
            if not writes_only or t.is_write:
                t.settle()

    def _place(self, key: str, nbytes: int) -> tuple[int, SwapIOError | None]:
        """Drop `key` from the index and give it an extent (reused in place when the size matches)."""
        padded = round_up(nbytes)
        with self._lock:
            old = self._index.pop(key, None)
            if old is not None and old.padded_bytes == padded:
                return old.offset, None
            if old is not None and old.nbytes:
                self._extents.free(old.offset, old.padded_bytes)
            if padded == 0:
                return 0, None
            old_end = self._extents.end_bytes
            offset, new_end = self._extents.alloc(padded)
            if new_end > old_end:
                try:
                    _grow(self._fd, old_end, new_end)
                except OSError as e:
                    self._extents.free(offset, padded)
                    self._extents.end_bytes = old_end
                    return 0, SwapIOError(e.errno or errno.EIO, "cannot grow swap file", path=str(self.path),
                                          offset=old_end, nbytes=new_end - old_end)
        return offset, None

    def _source(self, tensor: torch.Tensor, nbytes: int) -> tuple[torch.Tensor, bool]:
        """The bytes to write, as an aligned uint8 tensor when possible; (tensor, staged?)."""
        if tensor.is_contiguous() and is_aligned(tensor):
            return _as_bytes(tensor), False
        staging = aligned_empty(nbytes)
        if nbytes:
            staging.view(tensor.dtype).view(tensor.shape).copy_(tensor)
        return staging, True

    @staticmethod
    def _destination(into: torch.Tensor, nbytes: int) -> tuple[torch.Tensor, bool]:
        if is_aligned(into):
            return _as_bytes(into), False
        return aligned_empty(nbytes), True

    def _spans(self, nbytes: int) -> list[tuple[int, int]]:
        return io_spans(nbytes, self.block_bytes)

    def _digest_spans(self, nbytes: int) -> list[tuple[int, int]]:
        return digest_spans(nbytes, self.block_bytes)

    def _start(self, key, write, offset, nbytes, buf, crcs, finish, urgent: bool = False) -> Ticket:
        body = nbytes - nbytes % ALIGN_BYTES
        tail_page = aligned_empty(ALIGN_BYTES) if nbytes > body else None
        if write and tail_page is not None:
            tail_page[: nbytes - body].copy_(buf[body:nbytes])
        spans = self._spans(nbytes)

        def finish_with_tail(first_err):
            if tail_page is not None and first_err is None and not write:
                buf[body:nbytes].copy_(tail_page[: nbytes - body])
            finish(first_err)

        ticket = Ticket(len(spans) + (tail_page is not None), finish_with_tail,
                        f"swap {'write' if write else 'read'} of {key!r}", nbytes)
        ticket.is_write = write
        if ticket.done():
            return ticket
        blocks = []
        for i, (s, n) in enumerate(spans):
            done = functools.partial(self._block_done, ticket, i, n, crcs, write)
            blocks.append(Block(write, self._fd, offset + s, buf.data_ptr() + s, n, done, urgent))
        if tail_page is not None:
            done = functools.partial(self._block_done, ticket, len(spans), nbytes - body, crcs, write)
            blocks.append(Block(write, self._fd, offset + body, tail_page.data_ptr(), ALIGN_BYTES, done, urgent))
        with held():  # [Note: held sections] in swap/pending.py: registered means queued, whole
            with self._lock:
                self._pending.setdefault(key, set()).add(ticket)
            ticket._finish = self._unpending(key, ticket, ticket._finish)
            self.backend.submit(blocks)
        return ticket

    def _unpending(self, key, ticket, finish):
        def run(first_err):
            try:
                finish(first_err)
            finally:
                with self._lock:
                    pending = self._pending.get(key)
                    if pending is not None:
                        pending.discard(ticket)
                        if not pending:
                            del self._pending[key]
        return run

    def _block_done(self, ticket, i, valid, crcs, write, block: Block, result: int) -> None:
        """Runs on a backend thread per block: length check, then the checksum (record or verify).
        Whatever fails in here reaches the ticket: a block that never reports would hang its waiter."""
        try:
            if result != block.nbytes:
                err = self._transfer_error(block, result, write)
            elif crcs is None:
                err = None
            elif self._digest_pool is not None:  # keep the single reaper thread free to reap and resubmit
                self._digest_pool.submit(self._check_block, ticket, i, valid, crcs, write, block)
                return
            else:
                err = self._verify(i, valid, crcs, write, block)
        except BaseException as e:  # noqa: BLE001  (a bug or an injected fault: the waiter raises it)
            err = e
        ticket._block_done(err)

    def _check_block(self, ticket, i, valid, crcs, write, block: Block) -> None:
        """_verify on a digest thread, its outcome (an error included) delivered to the ticket."""
        try:
            err = self._verify(i, valid, crcs, write, block)
        except BaseException as e:  # noqa: BLE001
            err = e
        ticket._block_done(err)

    def _transfer_error(self, block: Block, result: int, write: bool) -> SwapIOError:
        what = f"short {'write' if write else 'read'}: {max(result, 0)} of {block.nbytes} bytes"
        if result < 0:
            what = f"swap {'write' if write else 'read'} failed"
        if block.error is not None:  # why the backend failed it (e.g. its thread died)
            what += f" ({block.error!r})"
        err = SwapIOError(-result if result < 0 else errno.EIO, what, path=str(self.path), offset=block.offset,
                          nbytes=block.nbytes)
        err.__cause__ = block.error
        return err

    def _verify(self, i, valid, crcs, write, block: Block) -> SwapCorruptionError | None:
        digest = block_digest(block.addr, valid)
        if write:
            crcs[i] = digest
        elif digest != crcs[i]:
            return SwapCorruptionError(f"checksum mismatch (read {digest:#034x}, written {crcs[i]:#034x})",
                                       path=str(self.path), offset=block.offset, nbytes=block.nbytes)
        return None

    def _finish_write(self, key, offset, nbytes, crcs, first_err, src, staged) -> None:
        if first_err is None and not self.direct and nbytes:
            try:
                os.fdatasync(self._fd)  # buffered fallback: a finished write is on disk, as with O_DIRECT
            except OSError as e:
                first_err = SwapIOError(e.errno or errno.EIO, "fdatasync failed", path=str(self.path),
                                        offset=offset, nbytes=nbytes)
        with self._lock:
            if first_err is None:
                self._index[key] = Entry(offset, nbytes, tuple(crcs) if crcs is not None else None)
            elif nbytes:
                self._extents.free(offset, round_up(nbytes))
        if first_err is not None:
            raise first_err

    @staticmethod
    def _failed(err: BaseException) -> Ticket:
        def finish(_):
            raise err
        return Ticket(0, finish, "failed swap write")


def _check_key(key) -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"key={key!r}: must be a non-empty string (a stable name such as 'layers.3/bf16')")


def _check_host(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.layout != torch.strided:
        raise ValueError(f"{name}: the swap store moves dense host tensors, got "
                         f"{type(t).__name__} on {getattr(t, 'device', '?')}; copy it to a CPU buffer first")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.reshape(-1).view(torch.uint8)


def _copy_out(into: torch.Tensor, dst: torch.Tensor, staged: bool, nbytes: int) -> None:
    if staged and nbytes:
        _as_bytes(into).copy_(dst[:nbytes])


def _grow(fd: int, old_end: int, new_end: int) -> None:
    try:
        os.posix_fallocate(fd, old_end, new_end - old_end)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, new_end)
