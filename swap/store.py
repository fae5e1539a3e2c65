"""The swap store: tensors under stable string keys in one unlinked file per run, moved asynchronously.

key -> Entry(offset, nbytes, per-block checksum). Entries are 4 KiB-granular extents of one data file
(a 10-byte tensor takes 4 KiB, not DeepSpeed's 1 MiB minimum); the file grows at its end with
fallocate, so O_DIRECT writes land in allocated blocks. The file has no name ([Note: unlinked data
file] in swap/rundir.py): its bytes go when the process ends, however it ends; the run directory's
owner.json records its size as it grows, `describe()` and `disk_bytes` say where it is and what it holds.
The store keeps the index of keys and extents; the bytes move as checked blocks (swap/transfer.py, with
swap/integrity.py's digests), and swap/rundir.py's OpenRun holds the run directory and the data file.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from bisect import bisect_left
from dataclasses import dataclass

import torch

from .backends import IOBackend, open_backend
from .buffers import ALIGN_BYTES, aligned_empty, is_aligned, round_up
from .errors import SwapCorruptionError, SwapIOError
from .integrity import digest_bounds, digest_spans
from .pending import PendingTimeout, io_timeout_s
from .rundir import OpenRun, hold_open, let_go
from .transfer import Ticket, Transfers, failed_ticket

# [Note: what a failed write leaves]
# A write removes its key from the index before the first byte moves and puts it back only when every
# block has completed (and verified its length). So a failed write leaves the key missing, never a
# key that reads back a mix of old and new bytes. An overwrite of the same padded size reuses the
# extent in place (no doubled disk use for the common swap-out of the same unit).

# [Note: held entries]
# A background checkpoint reads each unit's states as they were at its step boundary while training goes on
# overwriting them (offload.checkpoint.background). hold(keys) keeps those keys' entries: a write to a held key
# goes to another extent (never in place), and the held extent is neither reused nor freed until released, so
# the hold reads the boundary's bytes wherever the step has got to: copy-on-write at the swap. A released extent
# that was superseded goes back to the free list, where later writes find it (blocks written before: on some
# drives a block's first write is several times slower, bench/RESULTS.md); the file keeps its size.

# [Note: copies]
# An aligned contiguous tensor moves without a copy: its 4 KiB-multiple body goes straight between
# its memory and the file, and only a partial last page (< 4 KiB) bounces through a page-sized buffer,
# so bytes past the tensor (a neighbour in a flat buffer) are never written. Anything else bounces
# through one aligned staging buffer.

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
            if length >= padded:  # first fit
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

    @property
    def free_bytes(self) -> int:
        return sum(length for _, length in self._free)

    def free(self, off: int, padded: int) -> None:
        i = bisect_left(self._free, (off, 0))
        if i < len(self._free) and off + padded == self._free[i][0]:  # merge with the next
            padded += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == off:  # merge with the previous
            off, prev = self._free.pop(i - 1)
            padded += prev
            i -= 1
        self._free.insert(i, (off, padded))


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
        self._owns_backend = isinstance(backend, str)
        self.backend = (open_backend(backend, queue_depth=queue_depth, threads=threads,
                                     background_bytes=background_bytes)
                        if self._owns_backend else backend)
        try:
            run = OpenRun(directory, direct)
        except BaseException:
            if self._owns_backend:
                self.backend.close()
            raise
        self.run_dir, self.direct, self.file_kind, self.path = run.run_dir, run.direct, run.file_kind, run.path
        self._lock = threading.Lock()
        self._index: dict[str, Entry] = {}
        self._held: dict[str, Entry] = {}  # [Note: held entries]
        self._extents = Extents()
        self._transfers = Transfers(run.fd, run.path, self.backend, block_bytes=block_bytes, direct=run.direct,
                                    checksum=checksum)
        self._run = run  # open from here on (until then __del__ has nothing to close)
        hold_open(self, run)

    # ---- public API ------------------------------------------------------------------------------
    def write(self, key: str, tensor: torch.Tensor, *, digests=None) -> Ticket:
        """Start writing `tensor` under `key`; keep `tensor` unchanged until ticket.wait().

        digests: with checksums on, the block digests of `tensor` when the caller already computed them
        (one per span of `digest_bounds`, as `block_digest`); the store then records them unhashed."""
        self._check_open()
        _check_key(key)
        _check_host(tensor, "tensor")
        self._transfers.settle(key, writes_only=False)
        nbytes = tensor.numel() * tensor.element_size()
        nblocks = len(digest_spans(nbytes, self.block_bytes))
        if digests is not None and len(digests) != nblocks:
            raise ValueError(f"digests: {len(digests)} given for {key!r}, its {nbytes} bytes have "
                             f"{nblocks} blocks; compute them over digest_bounds()")
        src = _source(tensor, nbytes)
        offset, err = self._place(key, nbytes)
        if err is not None:
            return failed_ticket(err)
        self._run.record_size_if_needed(lambda: self._extents.end_bytes)
        crcs = None
        if self.checksum:
            crcs = list(digests) if digests is not None else [0] * nblocks

        def finish(first_err):  # [Note: what a failed write leaves]: the key back only when every block moved
            with self._lock:
                if first_err is None:
                    self._index[key] = Entry(offset, nbytes, tuple(crcs) if crcs is not None else None)
                elif nbytes:
                    self._extents.free(offset, round_up(nbytes))
            if first_err is not None:
                raise first_err

        return self._transfers.start(key, True, offset, nbytes, src, crcs if digests is None else None, finish)

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
                start, n = digest_spans(entry.nbytes, self.block_bytes)[i]
                raise SwapCorruptionError(f"checksum mismatch in {key!r} (read {got:#034x}, written {want:#034x})",
                                          path=str(self.path), offset=entry.offset + start, nbytes=n)

    def read(self, key: str, into: torch.Tensor, *, verify: bool = True, urgent: bool = False) -> Ticket:
        """Start reading `key` into the contiguous tensor `into` (same nbytes as written).

        verify=False (checksums on): the blocks are not hashed here; the caller hashes what it reads
        and passes the digests to `check_digests` before it uses or writes back any of it.
        urgent: its blocks go ahead of queued ones that are not ([Note: urgent blocks] in swap/backends.py)."""
        self._check_open()
        _check_host(into, "into")
        self._transfers.settle(key, writes_only=True)
        with self._lock:
            entry = self._index.get(key)
        if entry is None:
            raise KeyError(f"swap key {key!r} not in the store (never written, deleted, or its write failed)")
        return _start_read(self._transfers, key, entry, into, verify, urgent)

    def hold(self, keys) -> "Held":
        """Keeps the entries of `keys` as they are now (their writes in flight settled first), to be read
        while they are overwritten ([Note: held entries]); a key not in the store is missing from the hold
        too. One hold at a time."""
        self._check_open()
        keys = list(keys)
        for key in keys:
            self._transfers.settle(key, writes_only=True)

        def read(key: str, entry: Entry, into: torch.Tensor) -> Ticket:
            self._check_open()
            _check_host(into, "into")
            return _start_read(self._transfers, key, entry, into, True, False, tag=f"{key} (held)", idle=True)

        def release(key: str) -> None:  # the extent freed where a write superseded it
            with self._lock:
                entry = self._held.pop(key, None)
                if entry is not None and entry.nbytes and self._index.get(key) is not entry:
                    self._extents.free(entry.offset, entry.padded_bytes)

        with self._lock:
            if self._held:
                raise RuntimeError("swap: entries are held already (one hold at a time)")
            self._held = {k: self._index[k] for k in keys if k in self._index}
            return Held(dict(self._held), read, release, self._extents.free_bytes)

    def delete(self, key: str) -> None:
        self._transfers.settle(key, writes_only=False)
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is None:
                raise KeyError(f"swap key {key!r} not in the store")
            if entry.nbytes and self._held.get(key) is not entry:  # a held extent is freed by release()
                self._extents.free(entry.offset, entry.padded_bytes)

    def __contains__(self, key: str) -> bool:
        self._transfers.settle(key, writes_only=True)
        with self._lock:
            return key in self._index

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._index)

    def nbytes(self, key: str) -> int:
        self._transfers.settle(key, writes_only=True)
        with self._lock:
            if key not in self._index:
                raise KeyError(f"swap key {key!r} not in the store")
            return self._index[key].nbytes

    @property
    def disk_bytes(self) -> int:
        """Bytes the data file occupies on disk (allocated blocks, as `du` would count them had it a name)."""
        if self._run.closed:
            return 0
        return os.fstat(self._run.fd).st_blocks * 512

    @property
    def fd_path(self) -> str:
        """A path that opens the data file while the store is open (this process's /proc/self/fd entry)."""
        self._check_open()
        return f"/proc/self/fd/{self._run.fd}"

    def describe(self) -> str:
        """One line: where the swap bytes are, how many, and why `ls` does not show them."""
        if self._run.closed:
            return f"swap: closed (its data file in {self.run_dir} is gone)"
        return (f"swap: {self.disk_bytes / 2**20:.1f} MiB in an unlinked data file ({self.file_kind}) in "
                f"{self.run_dir}, held as /proc/{os.getpid()}/fd/{self._run.fd}: `ls` does not show it and its "
                f"bytes go when the process ends; `offload clean --list {self.run_dir.parent}` lists live runs")

    def where(self) -> dict:
        """What `engine.stats()["swap"]` reports: run_dir, file (how it is unlinked), proc_path, disk_bytes."""
        return {"run_dir": str(self.run_dir), "file": self.file_kind,
                "proc_path": None if self._run.closed else f"/proc/{os.getpid()}/fd/{self._run.fd}",
                "disk_bytes": self.disk_bytes}

    def close(self) -> None:
        """Wait for in-flight I/O (up to the I/O timeout in all), stop the backend, close the data file (its
        bytes go) and remove the run directory. Idempotent; errors of the transfers it waits for are their
        waiters' to raise, not close()'s. A transfer stuck past the timeout keeps its thread and the file
        descriptor (a late write must not land in a reused fd), so the bytes stay until the process ends;
        the run directory is removed all the same."""
        if self._run.closed:
            return
        self._run.closed = True
        let_go(self)
        deadline = time.monotonic() + io_timeout_s()
        stuck = False
        for t in self._transfers.in_flight():
            try:
                t.settle(max(0.0, deadline - time.monotonic()))
            except PendingTimeout as e:
                log.warning("swap: closing %s with I/O still pending: %s", self.run_dir, e)
                stuck = True
        if stuck:  # a thread may still be in the kernel with our fd: remove the files, leave fd and threads
            self._run.release(keep_fd=True)
            return
        if self._owns_backend:
            self.backend.close()
        self._transfers.close()
        self._run.release()

    def __enter__(self) -> "SwapStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        run = getattr(self, "_run", None)
        if run is not None and not run.closed:
            self.close()

    # ---- internals -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._run.closed:
            raise ValueError(f"SwapStore at {self.run_dir} is closed; create a new store")

    def _place(self, key: str, nbytes: int) -> tuple[int, SwapIOError | None]:
        """Drop `key` from the index and give it an extent (reused in place when the size matches, unless
        held: [Note: held entries])."""
        padded = round_up(nbytes)
        with self._lock:
            old = self._index.pop(key, None)
            held = old is not None and self._held.get(key) is old
            if old is not None and not held and old.padded_bytes == padded:
                return old.offset, None
            if old is not None and old.nbytes and not held:
                self._extents.free(old.offset, old.padded_bytes)
            if padded == 0:
                return 0, None
            old_end = self._extents.end_bytes
            offset, new_end = self._extents.alloc(padded)
            if new_end > old_end:
                try:
                    _grow(self._run.fd, old_end, new_end)
                except OSError as e:
                    self._extents.free(offset, padded)
                    self._extents.end_bytes = old_end
                    return 0, SwapIOError(e.errno or errno.EIO, "cannot grow swap file", path=str(self.path),
                                          offset=old_end, nbytes=new_end - old_end)
        return offset, None


class Held:
    """SwapStore.hold's: the entries of some keys as they were, readable while the store overwrites them.
    nbytes: what they occupy of the data file; growth: how much the file grows if every one is superseded
    (beyond the free extents it has now)."""

    def __init__(self, entries: dict[str, Entry], read, release, spare_bytes: int):
        self._entries, self._read, self._release = entries, read, release
        self.nbytes = sum(e.padded_bytes for e in entries.values())
        self.growth = max(0, self.nbytes - spare_bytes)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def read(self, key: str, into: torch.Tensor) -> Ticket:
        """Starts reading `key` as it was held into `into` (verified as SwapStore.read verifies)."""
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"swap key {key!r} not held (not in the store when held, or released)")
        return self._read(key, entry, into)

    def release(self, keys) -> None:
        """Ends the hold of `keys` (freeing extents writes superseded); unknown or released keys are ignored."""
        for key in keys:
            if self._entries.pop(key, None) is not None:
                self._release(key)

    def close(self) -> None:
        """Releases every key still held."""
        self.release(list(self._entries))


def _start_read(transfers: Transfers, key: str, entry: Entry, into: torch.Tensor, verify: bool, urgent: bool,
                tag: str | None = None, idle: bool = False) -> Ticket:
    """Starts reading `entry` (key's) into `into`; tag: the name its transfer goes by (default the key); idle:
    [Note: idle blocks] in swap/backends.py (a held entry's read: a background checkpoint's)."""
    if not into.is_contiguous():
        raise ValueError(f"into: must be contiguous (shape {tuple(into.shape)}, strides {into.stride()}); "
                         f"read into a contiguous buffer and copy")
    nbytes = into.numel() * into.element_size()
    if nbytes != entry.nbytes:
        raise ValueError(f"into: has {nbytes} bytes but key {key!r} holds {entry.nbytes}; "
                         f"read into a tensor of the same byte size")
    dst, staged = _destination(into, nbytes)

    def finish(first_err):
        if first_err is not None:
            raise first_err
        _copy_out(into, dst, staged, nbytes)

    return transfers.start(tag or key, False, entry.offset, nbytes, dst, entry.crcs if verify else None, finish,
                           urgent, idle)


def _check_key(key) -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"key={key!r}: must be a non-empty string (a stable name such as 'layers.3/bf16')")


def _check_host(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.layout != torch.strided:
        raise ValueError(f"{name}: the swap store moves dense host tensors, got "
                         f"{type(t).__name__} on {getattr(t, 'device', '?')}; copy it to a CPU buffer first")


def _source(tensor: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The bytes to write: `tensor` itself as aligned uint8 when possible, else an aligned staging copy."""
    if tensor.is_contiguous() and is_aligned(tensor):
        return _as_bytes(tensor)
    staging = aligned_empty(nbytes)
    if nbytes:
        staging.view(tensor.dtype).view(tensor.shape).copy_(tensor)
    return staging


def _destination(into: torch.Tensor, nbytes: int) -> tuple[torch.Tensor, bool]:
    """Where to read into: `into` as aligned uint8, else an aligned staging buffer; (buffer, staged?)."""
    if is_aligned(into):
        return _as_bytes(into), False
    return aligned_empty(nbytes), True


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
