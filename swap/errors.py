"""Errors of the swap layer: every I/O failure names path, offset, byte count and errno."""

from __future__ import annotations

import errno as _errno
import os


class SwapIOError(OSError):
    """An I/O failure on a swap file. `path`, `offset`, `nbytes`, `errno` say exactly where."""

    def __init__(self, err: int, what: str, *, path: str, offset: int, nbytes: int):
        name = _errno.errorcode.get(err, str(err))
        super().__init__(err, f"{what}: {path} offset={offset} bytes={nbytes} errno={name} ({os.strerror(err)})")
        self.path = path
        self.offset = offset
        self.nbytes = nbytes

    def __reduce__(self):  # picklable with its fields (OSError's default would drop them)
        return (_rebuild, (type(self), self.errno, self.strerror, self.path, self.offset, self.nbytes))


class SwapCorruptionError(SwapIOError):
    """A swap entry whose bytes do not match the checksum recorded when it was written."""

    def __init__(self, what: str, *, path: str, offset: int, nbytes: int):
        super().__init__(_errno.EIO, what, path=path, offset=offset, nbytes=nbytes)


def _rebuild(cls, err, strerror, path, offset, nbytes):
    e = cls.__new__(cls)
    OSError.__init__(e, err, strerror)
    e.path, e.offset, e.nbytes = path, offset, nbytes
    return e
