"""A checkpoint's data file (rank<r>.bin), written front to back, every range with its crc32, past the page
cache where the file system allows it ([Note: direct checkpoint writes])."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os

import numpy as np
import torch

from offload.checkpoint.format import CREATE_FLAGS, as_bytes, crc32

# [Note: direct checkpoint writes]
# A checkpoint's gigabytes written through the page cache cost the host several times the bytes in CPU
# (copying into the cache, allocating its pages, the kernel's writeback, then fsync): on the 2-core build host
# 2.44 GB took 4.1 CPU-seconds buffered against 0.85 with O_DIRECT from an aligned bounce buffer, the same
# bytes at the same drive speed. That CPU is what a background save takes from the step beside it
# (bench/checkpoint.py). So a data file is opened with O_DIRECT where the file system takes it: ranges are
# copied into a page-aligned buffer of BOUNCE_BYTES and written whole; the last, partial one is padded to
# ALIGN and the file cut back to its true size before the fsync. A range of STRAIGHT_BYTES or more whose memory
# is page-aligned (most of a checkpoint: pool chunks and flat buffers are) starts at a page of the file, the
# few bytes before it zeros, and its whole pages are written straight from its memory, no copy; only its last
# partial page goes through the buffer. Buffered, the file gets the same bytes: the manifest's offsets say
# where each range is, so nothing that reads a checkpoint changes. Where O_DIRECT is refused (tmpfs on older
# kernels, some network and FUSE file systems: EINVAL when it is set or at the first write) the file is
# written through the page cache as before. Every write is at most WRITE_BYTES: a background save's write then
# keeps the step's own I/O waiting behind one such piece at most (a 32 MiB write goes to the drive as eight
# requests at once), and this VM's drive took them no slower: fio, one synchronous O_DIRECT write at a time to
# a new file, 1.50 GB/s in 4 MiB writes, 1.26 GB/s in 32 MiB ones.
BOUNCE_BYTES = 16 << 20
WRITE_BYTES = 4 << 20  # the most one write() asks of the drive
STRAIGHT_BYTES = 64 << 10  # a page-aligned range this large starts at a page of the file: written straight
ALIGN = 4096  # O_DIRECT's alignment for offsets, lengths and memory on any block size up to 4 KiB


class DataFile:
    """One rank's data file, written front to back; every range gets its crc32 ([Note: direct checkpoint
    writes]). `direct`: whether its bytes bypass the page cache."""

    def __init__(self, directory: str, name: str):
        self.name, self.nbytes, self.path = name, 0, os.path.join(directory, name)
        self.fd = os.open(self.path, CREATE_FLAGS, 0o644)
        self.direct = _set_direct(self.fd, True)
        self._bounce = mmap.mmap(-1, BOUNCE_BYTES) if self.direct else None
        self._buf = np.frombuffer(self._bounce, dtype=np.uint8) if self.direct else None
        self._fill = 0  # bytes in the bounce buffer not yet written
        self._flushed = 0  # bytes of the file written

    def write(self, t: torch.Tensor, begin: int, end: int) -> dict:
        data = as_bytes(t)
        if len(data) >= STRAIGHT_BYTES and data.ctypes.data % ALIGN == 0 and self.nbytes % ALIGN:
            self._append(np.zeros(ALIGN - self.nbytes % ALIGN, np.uint8))  # to the next page: written straight
        r = {"begin": begin, "end": end, "file": self.name, "offset": self.nbytes, "nbytes": len(data),
             "crc32": crc32(data)}
        self._append(data)
        return r

    def _append(self, data) -> None:
        """`data` (uint8) at the file's end: whole pages straight from its memory where they can be, the rest
        through the bounce buffer (or the page cache)."""
        done = self._write_straight(data) if self.direct else 0
        while self.direct and done < len(data):
            n = min(len(data) - done, BOUNCE_BYTES - self._fill)
            np.copyto(self._buf[self._fill:self._fill + n], data[done:done + n])
            self._fill, done = self._fill + n, done + n
            if self._fill == BOUNCE_BYTES:
                self._flush(BOUNCE_BYTES)
        if done < len(data):  # through the page cache (also once O_DIRECT was refused at its first write)
            self._write_all(memoryview(data[done:]), len(data) - done)
        self.nbytes += len(data)

    def _write_straight(self, data) -> int:
        """Where the file's end and `data`'s memory are page-aligned (and O_DIRECT has taken a write), data's
        whole pages written from its own memory ([Note: direct checkpoint writes]); the bytes written."""
        n = len(data) // ALIGN * ALIGN
        if (self._fill % ALIGN) or not self._flushed or not n or data.ctypes.data % ALIGN:
            return 0
        if self._fill:  # whole pages waiting in the bounce buffer go first
            self._flush(self._fill)
        self._write_all(memoryview(data[:n]), n)
        return n

    def sync(self) -> None:
        """Everything written reaches the drive (the file cut to its true size first)."""
        if self.direct and self._fill:
            self._flush(-(-self._fill // ALIGN) * ALIGN)
        try:
            if self.direct:
                os.ftruncate(self.fd, self.nbytes)
            os.fsync(self.fd)
        except OSError as e:
            raise OSError(e.errno, f"{e.strerror or e} (flushing {self.nbytes} bytes)", self.path) from e

    def _flush(self, length: int) -> None:
        """The bounce buffer's first `length` bytes (a multiple of ALIGN) to the file."""
        view = memoryview(self._bounce)[:length]
        try:
            self._write_all(view, self._fill)
        except OSError as e:
            if e.errno != errno.EINVAL or self._flushed:
                raise
            self.direct = _set_direct(self.fd, False)  # refused at the first write: through the page cache
            self._write_all(view[:self._fill], self._fill)
        self._fill = 0

    def _write_all(self, view: memoryview, nbytes: int) -> None:
        """`view` written at the file's end (`nbytes` of it count: the rest is O_DIRECT's padding)."""
        try:
            done = 0
            while done < len(view):
                done += os.write(self.fd, view[done:done + WRITE_BYTES])
        except OSError as e:  # a full disk: say which file and where
            if e.errno == errno.EINVAL and self.direct and not self._flushed:
                raise
            raise OSError(e.errno, f"{e.strerror or e} (writing {nbytes} bytes at byte {self._flushed})",
                          self.path) from e
        self._flushed += nbytes

    def __enter__(self) -> "DataFile":
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)
        self._buf = self._bounce = None  # unmapped once nothing holds it (an exception's frames may, a while)


def _set_direct(fd: int, on: bool) -> bool:
    """O_DIRECT set (or cleared) on `fd`; False where the file system refuses it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | flag if on else flags & ~flag)
    except OSError:
        return False
    return on
