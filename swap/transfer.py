"""Transfers of one data file: a key's bytes moved as I/O blocks through the backend, each block checked.

`Transfers.start` splits a write or read into blocks (`io_spans`; a partial last page moves through a
page-sized buffer, so bytes past the tensor are never written: [Note: copies] in swap/store.py), hands
them to the I/O backend, checks each completed block (its length; with checksums its digest, swap/integrity.py)
and completes the `Ticket` when the last one is in. It keeps the tickets in flight per key, so the store
waits for earlier operations on a key. It knows offsets and bytes, not which key lives where.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from .backends import Block, IOBackend
from .buffers import ALIGN_BYTES, aligned_empty
from .errors import SwapIOError
from .integrity import io_spans, verify_block
from .pending import Pending, held

Finish = Callable[[BaseException | None], None]  # runs once with the first error (None: every block moved)


class Ticket(Pending):
    """One asynchronous write or read. wait() raises SwapIOError / SwapCorruptionError, or PendingTimeout
    after the I/O timeout (swap.pending) naming the key, its bytes and the blocks still outstanding."""

    is_write = False

    def __init__(self, nblocks: int, finish: Finish, what: str = "swap transfer", nbytes: int = 0):
        super().__init__(what, nbytes)
        self._nblocks = self._remaining = nblocks
        self._finish = finish  # runs once, on the thread that completes the last block
        self._errors: list[BaseException] = []
        if nblocks == 0:
            self._run_finish()

    def describe(self) -> str:
        return f"{super().describe()}, {self._remaining} of {self._nblocks} blocks outstanding"

    def block_done(self, err: BaseException | None) -> None:
        """One block completed (with `err`, or None); the last one runs the finish and completes the ticket."""
        with self._lock:
            if err is not None:
                self._errors.append(err)
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self._run_finish()

    def on_finished(self, after: Callable[[], None]) -> None:
        """Runs `after()` once the finish has run (raised or not), before the ticket completes. Call it
        before any block is submitted."""
        finish = self._finish

        def run(first_err):
            try:
                finish(first_err)
            finally:
                after()
        self._finish = run

    def _run_finish(self) -> None:
        error = None
        try:
            self._finish(self._errors[0] if self._errors else None)
        except BaseException as e:  # noqa: BLE001  (delivered to wait(), not lost on a thread)
            error = e
        self._finish = None  # drop buffers and tensors held by the closure
        self.complete(error)


def failed_ticket(err: BaseException) -> Ticket:
    """A write that failed before any block moved: its wait() raises `err`."""
    def finish(_):
        raise err
    return Ticket(0, finish, "failed swap write")


class Transfers:
    """The block-level transfers of one data file (`fd`; `path` is what errors name) through `backend`."""

    def __init__(self, fd: int, path: str, backend: IOBackend, *, block_bytes: int, direct: bool, checksum: bool):
        self._fd, self._path, self._backend = fd, path, backend
        self._block_bytes, self._direct = block_bytes, direct
        self._lock = threading.Lock()
        self._pending: dict[str, set[Ticket]] = {}
        # A backend that completes every block on one thread (libaio's reaper) hands checksums to
        # helpers: computed inline they delayed resubmission and cost about a quarter of the bandwidth.
        serial = checksum and getattr(backend, "serial_completions", False)
        self._digest_pool = ThreadPoolExecutor(2, thread_name_prefix="swap-digest") if serial else None

    def start(self, key: str, write: bool, offset: int, nbytes: int, buf: torch.Tensor, crcs: list[int] | None,
              finish: Finish, urgent: bool = False, idle: bool = False) -> Ticket:
        """Moves `nbytes` between the aligned uint8 `buf` and the file at `offset`; `finish` runs on the thread
        that completes the last block. crcs: one digest per block that a write records and a read compares
        (None: not hashed here). urgent, idle: [Note: urgent blocks], [Note: idle blocks] in swap/backends.py."""
        body = nbytes - nbytes % ALIGN_BYTES
        tail_page = aligned_empty(ALIGN_BYTES) if nbytes > body else None
        if write and tail_page is not None:
            tail_page[: nbytes - body].copy_(buf[body:nbytes])
        spans = io_spans(nbytes, self._block_bytes)

        def finish_with_tail(first_err):
            if tail_page is not None and first_err is None and not write:
                buf[body:nbytes].copy_(tail_page[: nbytes - body])
            if write and first_err is None and not self._direct and nbytes:
                first_err = self._sync(offset, nbytes)
            finish(first_err)

        ticket = Ticket(len(spans) + (tail_page is not None), finish_with_tail,
                        f"swap {'write' if write else 'read'} of {key!r}", nbytes)
        ticket.is_write = write
        if ticket.done():
            return ticket
        blocks = []
        for i, (s, n) in enumerate(spans):
            done = functools.partial(self._block_done, ticket, i, n, crcs, write)
            blocks.append(Block(write, self._fd, offset + s, buf.data_ptr() + s, n, done, urgent, idle))
        if tail_page is not None:
            done = functools.partial(self._block_done, ticket, len(spans), nbytes - body, crcs, write)
            blocks.append(Block(write, self._fd, offset + body, tail_page.data_ptr(), ALIGN_BYTES, done, urgent,
                                idle))
        with held():  # [Note: held sections] in swap/pending.py: registered means queued, whole
            with self._lock:
                self._pending.setdefault(key, set()).add(ticket)
            ticket.on_finished(functools.partial(self._forget, key, ticket))
            self._backend.submit(blocks)
        return ticket

    def settle(self, key: str, *, writes_only: bool) -> None:
        """Wait for earlier operations on `key` (all of them, or only a pending write)."""
        with self._lock:
            tickets = list(self._pending.get(key, ()))
        for t in tickets:
            if not writes_only or t.is_write:
                t.settle()

    def in_flight(self) -> list[Ticket]:
        """Every ticket not finished yet."""
        with self._lock:
            return [t for ts in self._pending.values() for t in ts]

    def close(self) -> None:
        """Stops the digest threads (after the digests they were given)."""
        if self._digest_pool is not None:
            self._digest_pool.shutdown(wait=True)

    def _forget(self, key: str, ticket: Ticket) -> None:
        with self._lock:
            pending = self._pending.get(key)
            if pending is not None:
                pending.discard(ticket)
                if not pending:
                    del self._pending[key]

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
                err = verify_block(crcs, i, valid, write, block, self._path)
        except BaseException as e:  # noqa: BLE001  (a bug or an injected fault: the waiter raises it)
            err = e
        ticket.block_done(err)

    def _check_block(self, ticket, i, valid, crcs, write, block: Block) -> None:
        """verify_block on a digest thread, its outcome (an error included) delivered to the ticket."""
        try:
            err = verify_block(crcs, i, valid, write, block, self._path)
        except BaseException as e:  # noqa: BLE001
            err = e
        ticket.block_done(err)

    def _transfer_error(self, block: Block, result: int, write: bool) -> SwapIOError:
        what = f"short {'write' if write else 'read'}: {max(result, 0)} of {block.nbytes} bytes"
        if result < 0:
            what = f"swap {'write' if write else 'read'} failed"
        if block.error is not None:  # why the backend failed it (e.g. its thread died)
            what += f" ({block.error!r})"
        err = SwapIOError(-result if result < 0 else errno.EIO, what, path=self._path, offset=block.offset,
                          nbytes=block.nbytes)
        err.__cause__ = block.error
        return err

    def _sync(self, offset: int, nbytes: int) -> SwapIOError | None:
        """Buffered I/O (no O_DIRECT): a finished write is on disk, as with O_DIRECT."""
        try:
            os.fdatasync(self._fd)
        except OSError as e:
            return SwapIOError(e.errno or errno.EIO, "fdatasync failed", path=self._path, offset=offset, nbytes=nbytes)
        return None
