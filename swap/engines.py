"""I/O engines: move aligned blocks between host memory and a file descriptor, asynchronously.

One small Protocol, two engines:
- `libaio`: Linux AIO through the `libaio` package; blocks are batched into io_submit calls with
  at most `queue_depth` in flight; one reaper thread collects completions.
- `threads`: os.preadv/os.pwritev in a pool of `threads` workers (works everywhere).
`auto` takes libaio when libaio.so.1 loads, else threads, and says which in the log.

An engine knows nothing about keys, checksums or files' meaning: it gets `Block`s and calls each
block's `done(block, result)` exactly once, with result = bytes moved or -errno, on its own thread.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

log = logging.getLogger("swap")

ENGINES = ("auto", "libaio", "threads")


@dataclass(eq=False, slots=True)
class Block:
    """One contiguous transfer: `nbytes` between host address `addr` and `fd` at `offset`."""

    write: bool
    fd: int
    offset: int
    addr: int
    nbytes: int
    done: Callable[["Block", int], None]


class IOEngine(Protocol):
    name: str

    def submit(self, blocks: Sequence[Block]) -> None:
        """Queue blocks; each one's `done` is called exactly once, later, from an engine thread."""

    def close(self) -> None:
        """Finish everything in flight, then release the engine's threads and kernel context."""


def host_buffer(addr: int, nbytes: int):
    """A writable buffer-protocol view of raw host memory (for preadv/pwritev and zlib)."""
    return (ctypes.c_char * nbytes).from_address(addr)


def _complete(block: Block, result: int) -> None:
    try:
        block.done(block, result)
    except BaseException:  # a bad callback must not kill the engine thread
        log.exception("swap: completion callback failed")


class ThreadsEngine:
    """os.preadv/os.pwritev from a thread pool; short transfers are continued, not failed."""

    name = "threads"

    def __init__(self, threads: int = 4):
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="swap-io")

    def submit(self, blocks: Sequence[Block]) -> None:
        for b in blocks:
            self._pool.submit(self._run, b)

    @staticmethod
    def _run(b: Block) -> None:
        moved = 0
        try:
            while moved < b.nbytes:
                buf = [host_buffer(b.addr + moved, b.nbytes - moved)]
                n = (os.pwritev if b.write else os.preadv)(b.fd, buf, b.offset + moved)
                if n <= 0:  # end of file on read, or a write that makes no progress
                    break
                moved += n
        except OSError as e:
            _complete(b, -(e.errno or errno.EIO))
            return
        _complete(b, moved)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class LibaioEngine:
    """Linux AIO: batched io_submit, at most `queue_depth` blocks in flight, one reaper thread.

    [Note: who submits]
    The caller's thread submits while fewer than queue_depth blocks are in flight; the rest wait in a
    deque that the reaper drains as completions free slots. So a burst of requests costs one
    io_submit per batch, and the kernel queue stays full without a busy-polling thread.
    """

    name = "libaio"

    def __init__(self, queue_depth: int = 32):
        import libaio  # the package; raises OSError/ImportError when libaio.so.1 is missing

        self._aio = libaio
        self.queue_depth = queue_depth
        self._ctx = libaio.AIOContext(queue_depth)
        self._cond = threading.Condition()
        self._waiting: collections.deque = collections.deque()
        self._in_flight = 0
        self._closing = False
        self._reaper = threading.Thread(target=self._reap, name="swap-libaio", daemon=True)
        self._reaper.start()

    def submit(self, blocks: Sequence[Block]) -> None:
        aio_blocks = [self._to_aio(b) for b in blocks]
        with self._cond:
            if self._closing:
                raise RuntimeError("LibaioEngine.submit after close()")
            self._waiting.extend(aio_blocks)
            refused = self._pump_locked()
        self._fail(refused)

    def _to_aio(self, b: Block):
        mode = self._aio.AIOBLOCK_MODE_WRITE if b.write else self._aio.AIOBLOCK_MODE_READ
        ab = self._aio.AIOBlock(mode, b.fd, [host_buffer(b.addr, b.nbytes)], b.offset)
        ab.swap_block = b
        return ab

    def _pump_locked(self) -> list:
        """Submit waiting blocks into free slots; returns the blocks the kernel refused, with errno."""
        refused = []
        while self._waiting and self._in_flight < self.queue_depth:
            n = min(self.queue_depth - self._in_flight, len(self._waiting))
            batch = [self._waiting.popleft() for _ in range(n)]
            try:
                done = self._ctx.submit(batch)
            except OSError as e:
                if e.errno == errno.EAGAIN and self._in_flight:  # kernel queue full: retry on reap
                    self._waiting.extendleft(reversed(batch))
                    break
                refused.append((batch[0], e.errno or errno.EIO))  # EINVAL, EBADF, ...: fail it alone
                self._waiting.extendleft(reversed(batch[1:]))
                continue
            self._in_flight += done
            self._waiting.extendleft(reversed(batch[done:]))
        if self._in_flight:
            self._cond.notify_all()
        return refused

    @staticmethod
    def _fail(refused: list) -> None:
        for ab, err in refused:
            _complete(ab.swap_block, -err)

    def _reap(self) -> None:
        while True:
            with self._cond:
                while self._in_flight == 0 and not self._closing:
                    self._cond.wait()
                if self._in_flight == 0 and self._closing:
                    return
            try:
                events = self._ctx.getEvents(min_nr=1, nr=self.queue_depth)
            except OSError as e:
                if e.errno == errno.EINTR:
                    continue
                raise
            for ab, res, _res2 in events:
                _complete(ab.swap_block, res)
            with self._cond:
                self._in_flight -= len(events)
                refused = self._pump_locked()
                self._cond.notify_all()
            self._fail(refused)

    def close(self) -> None:
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
        self._reaper.join()
        self._ctx.close()


def libaio_available() -> bool:
    try:
        import libaio  # noqa: F401  (loads libaio.so.1 through ctypes)
    except (ImportError, OSError):
        return False
    return True


def open_engine(name: str = "auto", *, queue_depth: int = 32, threads: int = 4) -> IOEngine:
    """The engine called `name`; `auto` takes libaio when libaio.so.1 loads, else threads."""
    if name not in ENGINES:
        raise ValueError(f"engine={name!r}: unknown I/O engine; use one of {', '.join(ENGINES)}")
    if queue_depth < 1:
        raise ValueError(f"queue_depth={queue_depth}: must be >= 1; 32 suits most NVMe drives")
    if threads < 1:
        raise ValueError(f"threads={threads}: must be >= 1; 4 suits most NVMe drives")
    if name == "auto":
        name = "libaio" if libaio_available() else "threads"
        log.info("swap: I/O engine auto -> %s", name)
    if name == "libaio":
        try:
            return LibaioEngine(queue_depth)
        except (ImportError, OSError) as e:
            raise ValueError(
                f"engine='libaio': cannot load Linux AIO ({e}); install libaio1 and the `libaio` "
                f"package, or use engine='threads'") from e
    return ThreadsEngine(threads)
