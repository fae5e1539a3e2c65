"""I/O backends: move aligned blocks between host memory and a file descriptor, asynchronously.

One small Protocol, two backends:
- `libaio`: Linux AIO through the `libaio` package; blocks are batched into io_submit calls with
  at most `queue_depth` in flight; one reaper thread collects completions.
- `threads`: os.preadv/os.pwritev in a pool of `threads` workers (works everywhere).
`auto` takes libaio when libaio.so.1 loads, else threads, and says which in the log.

A backend knows nothing about keys, checksums or files' meaning: it gets `Block`s and calls each
block's `done(block, result)` exactly once, with result = bytes moved or -errno, on its own thread.
That holds on every path ([Note: no wait without an end] in swap/pending.py): `submit` never raises (a
block it cannot take completes with -errno), and when a backend's thread dies or its worker meets an
unexpected error, the blocks it owed complete with -EIO and `block.error` saying why.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from .pending import io_timeout_s, start_thread

# [Note: urgent blocks]
# A block marked `urgent` (a weight fetch the compute will wait for) goes ahead of every queued block that
# is not, in the order urgent blocks came; blocks already with the drive are not preempted. So a fetch
# issued while the optimizer's window pipeline keeps the queue full waits for what is in flight, not for
# the windows queued behind it (a 3b preset's first fetch would otherwise wait behind every deferred
# step's window: bench/RESULTS.md, "fetches first").
# Blocks already with the drive are the rest of its wait, so the libaio backend can also keep the bytes of
# non-urgent blocks in flight under `background_bytes`: at full depth (32 blocks of 8 MiB) a weight fetch
# waits behind 256 MiB of state windows, while 2-4 such blocks in flight already reach the drive's
# bandwidth (stalls with and without the limit: bench/RESULTS.md, "aio.background_bytes").
# Urgent blocks still take any free slot. The swap layer's default is no limit (what `offload bench nvme`
# measures: the drive at full depth); the Engine passes `aio.background_bytes`.

# [Note: idle blocks]
# A block marked `idle` (a background checkpoint's read of held states: [Note: background saves] in
# offload.checkpoint.background) goes after every other waiting block and, with libaio, only while nothing
# else waits, IDLE_IN_FLIGHT at most, in the kernel's idle I/O class (the block layer's schedulers that take
# priorities serve it after other I/O): so the steps' own reads and writes find the drive as if the saver
# read nothing, and the saver reads in the gaps they leave. Its thread's idle class alone did not do that:
# a block is submitted by whichever thread pumps the queue (often the reaper), at that thread's class.
IDLE_IN_FLIGHT = 1
IOPRIO_IDLE = 3 << 13  # IOPRIO_PRIO_VALUE(IOPRIO_CLASS_IDLE, 0): an iocb's aio_reqprio, or ioprio_set's value

log = logging.getLogger("swap")

BACKENDS = ("auto", "libaio", "threads")


@dataclass(eq=False, slots=True)
class Block:
    """One contiguous transfer: `nbytes` between host address `addr` and `fd` at `offset`."""

    write: bool
    fd: int
    offset: int
    addr: int
    nbytes: int
    done: Callable[["Block", int], None]
    urgent: bool = False  # [Note: urgent blocks]
    idle: bool = False  # [Note: idle blocks]
    error: BaseException | None = None  # set by the backend when it fails the block for a reason errno cannot say


class IOBackend(Protocol):
    name: str
    serial_completions: bool  # True when every `done` runs on one thread (callers then keep it light)

    def submit(self, blocks: Sequence[Block]) -> None:
        """Queue blocks (urgent ones first: [Note: urgent blocks]); each one's `done` is called exactly once,
        later, from a backend thread. Never raises."""

    def close(self) -> None:
        """Finish everything in flight, then release the backend's threads and kernel context."""


def host_buffer(addr: int, nbytes: int):
    """A writable buffer-protocol view of raw host memory (for preadv/pwritev and zlib)."""
    return (ctypes.c_char * nbytes).from_address(addr)


def _complete(block: Block, result: int) -> None:
    try:
        block.done(block, result)
    except BaseException:  # a bad callback must not kill the backend thread (the store's never raises)
        log.exception("swap: completion callback failed")


def _fail_with(blocks, error: BaseException) -> None:
    """Completes `blocks` with -EIO, `error` saying why (the backend cannot move them)."""
    for b in blocks:
        b.error = error
        _complete(b, -errno.EIO)


class _Queue:
    """Blocks waiting for the drive: urgent ones ([Note: urgent blocks]) before the rest, idle ones ([Note: idle
    blocks]) after them, each lane in order."""

    def __init__(self):
        self.urgent: collections.deque = collections.deque()
        self.normal: collections.deque = collections.deque()
        self.idle: collections.deque = collections.deque()

    def __len__(self) -> int:
        return len(self.urgent) + len(self.normal) + len(self.idle)

    def _lane(self, b: Block) -> collections.deque:
        return self.urgent if b.urgent else self.idle if b.idle else self.normal

    def extend(self, blocks) -> None:
        for b in blocks:
            self._lane(b).append(b)

    def pop(self, room: int | None = None, idle: bool = True) -> Block | None:
        """The next block: urgent first, else a non-urgent one of at most `room` bytes (None: any size), an
        idle one only where nothing else waits and `idle` allows; None when there is no such block."""
        if self.urgent:
            return self.urgent.popleft()
        if self.normal:
            return self.normal.popleft() if room is None or self.normal[0].nbytes <= room else None
        if self.idle and idle and (room is None or self.idle[0].nbytes <= room):
            return self.idle.popleft()
        return None

    def push_back(self, b: Block) -> None:
        """A block taken but not submitted: first again in its own lane."""
        self._lane(b).appendleft(b)

    def drain(self) -> list:
        out = [*self.urgent, *self.normal, *self.idle]
        self.urgent.clear()
        self.normal.clear()
        self.idle.clear()
        return out


class ThreadsBackend:
    """os.preadv/os.pwritev from `threads` worker threads; short transfers are continued, not failed."""

    name = "threads"
    serial_completions = False

    def __init__(self, threads: int = 4):
        self.threads = threads
        self._cond = threading.Condition()
        self._queue = _Queue()
        self._closing = False
        self._dead: BaseException | None = None  # why a worker died: every block then fails at once
        self._workers = [start_thread(self._work, f"swap-io_{i}", self._worker_died) for i in range(threads)]

    def submit(self, blocks: Sequence[Block]) -> None:
        with self._cond:
            gone = self._dead or (RuntimeError("ThreadsBackend.submit after close()") if self._closing else None)
            if gone is None:
                self._queue.extend(blocks)
                self._cond.notify(len(blocks))
                return
        _fail_with(blocks, gone)

    def _worker_died(self, error: BaseException) -> None:
        """A worker died outside a transfer (_run completes every block it takes): what waits, and every
        later submit, fails instead of waiting for workers that may all be gone."""
        dead = RuntimeError(f"a swap I/O worker thread died ({error!r})")
        dead.__cause__ = error
        with self._cond:
            self._dead = dead
            owed = self._queue.drain()
        _fail_with(owed, dead)

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:  # closing, and nothing left to do
                    return
                b = self._queue.pop()
            self._run(b)

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
        except BaseException as e:  # noqa: BLE001  (anything else: the block fails, its waiter says why)
            _fail_with([b], e)
            return
        _complete(b, moved)

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for t in self._workers:  # they finish every block queued before close()
            t.join()


class LibaioBackend:
    """Linux AIO: batched io_submit, at most `queue_depth` blocks in flight, one reaper thread.

    [Note: why the raw bindings]
    The `libaio` package's AIOBlock builds an iovec array, a ctypes buffer and a dict entry per
    transfer; on a busy 2-core machine that Python work, not the drive, caps 1 MiB writes well below
    fio's rate (bench/RESULTS.md, "Figures that code comments carried"). So this backend keeps
    `queue_depth` preallocated iocbs (the package's ctypes structures and io_submit/io_getevents
    bindings) and only fills in five fields per block.

    [Note: who submits]
    The caller's thread submits while fewer than queue_depth blocks are in flight; the rest wait in a
    deque that the reaper drains as completions free slots. So a burst of requests costs one
    io_submit per batch, and the kernel queue stays full without a busy-polling thread.
    """

    name = "libaio"
    serial_completions = True  # every `done` runs on the one reaper thread

    def __init__(self, queue_depth: int = 32, background_bytes: int | None = None):
        from libaio import libaio as aio  # ctypes bindings; raises OSError when libaio.so.1 is missing

        self._aio = aio
        self.queue_depth = queue_depth
        self.background_bytes = background_bytes  # [Note: urgent blocks]; None: no limit
        self._background_in_flight = 0
        self._idle_in_flight = 0  # [Note: idle blocks]
        self._ctx = aio.io_context_t()
        aio.io_queue_init(queue_depth, ctypes.byref(self._ctx))
        self._iocbs = (aio.iocb * queue_depth)()
        self._ptrs = [ctypes.pointer(cb) for cb in self._iocbs]
        self._submit_array = (aio.iocb_p * queue_depth)()
        self._events = (aio.io_event * queue_depth)()
        self._slot_block: list[Block | None] = [None] * queue_depth
        self._free_slots = list(range(queue_depth))
        self._cond = threading.Condition()
        self._waiting = _Queue()
        self._closing = False
        self._dead: BaseException | None = None  # why the reaper died: every block then fails at once
        self._ctx_live = True
        self._reaper = start_thread(self._reap, "swap-libaio", self._reaper_died)

    @property
    def _in_flight(self) -> int:
        return self.queue_depth - len(self._free_slots)

    def submit(self, blocks: Sequence[Block]) -> None:
        with self._cond:
            gone = self._dead or (RuntimeError("LibaioBackend.submit after close()") if self._closing else None)
            if gone is None:
                self._waiting.extend(blocks)
                refused = self._pump_locked()
        if gone is not None:
            _fail_with(blocks, gone)
            return
        _fail(refused)

    def _pump_locked(self) -> list:
        """Submit waiting blocks into free slots; returns (block, errno) pairs the kernel refused."""
        refused, aio = [], self._aio
        while self._waiting and self._free_slots:
            taken = self._take_locked()
            if not taken:
                break
            n = len(taken)
            slots = [self._free_slots.pop() for _ in range(n)]
            for j, (slot, b) in enumerate(zip(slots, taken)):
                if not b.urgent:
                    self._background_in_flight += b.nbytes
                self._idle_in_flight += b.idle
                cb = self._iocbs[slot]
                cb.data = slot + 1  # 0 would read back as None
                cb.u.c.flags = aio.IOCB_FLAG_IOPRIO if b.idle else 0
                cb.aio_reqprio = IOPRIO_IDLE if b.idle else 0
                cb.aio_lio_opcode = aio.IO_CMD_PWRITE if b.write else aio.IO_CMD_PREAD
                cb.aio_fildes = b.fd
                cb.u.c.buf = b.addr
                cb.u.c.nbytes = b.nbytes
                cb.u.c.offset = b.offset
                self._slot_block[slot] = b
                self._submit_array[j] = self._ptrs[slot]
            done, err = 0, 0
            try:
                done = aio.io_submit(self._ctx, n, self._submit_array)
            except OSError as e:
                err = e.errno or errno.EIO
            if done == 0 and self._in_flight > n and err in (0, errno.EAGAIN):
                for slot in reversed(slots):  # kernel busy: retry after the next reap
                    self._waiting.push_back(self._release(slot))
                break
            if done == 0:  # EBADF, EINVAL, ...: the first block alone fails; the rest are retried
                refused.append((self._release(slots[0]), err or errno.EIO))
                slots, done = slots[1:], 0
            for slot in reversed(slots[done:]):  # not taken by the kernel: back to the queue front
                self._waiting.push_back(self._release(slot))
        if self._in_flight:
            self._cond.notify_all()
        return refused

    def _take_locked(self) -> list[Block]:
        """Waiting blocks for the free slots: urgent ones first, the rest while background_bytes allows
        (one at least, when none is in flight, so a block larger than the limit still moves)."""
        taken, background, limit = [], self._background_in_flight, self.background_bytes
        idle = self._idle_in_flight
        while len(taken) < len(self._free_slots):
            b = self._waiting.pop(None if limit is None or background == 0 else max(limit - background, 0),
                                  idle=idle < IDLE_IN_FLIGHT)
            if b is None:
                break
            taken.append(b)
            background += 0 if b.urgent else b.nbytes
            idle += b.idle
        return taken

    def _release(self, slot: int) -> Block:
        b, self._slot_block[slot] = self._slot_block[slot], None
        self._free_slots.append(slot)
        if not b.urgent:
            self._background_in_flight -= b.nbytes
        self._idle_in_flight -= b.idle
        return b

    def _reap(self) -> None:
        while True:
            with self._cond:
                while self._in_flight == 0 and not self._closing:
                    self._cond.wait()
                if self._in_flight == 0 and self._closing:
                    return
            try:
                n = self._aio.io_getevents(self._ctx, 1, self.queue_depth, self._events, None)
            except OSError as e:
                if e.errno == errno.EINTR:
                    continue
                raise
            done = [(self._events[i].data - 1, self._events[i].res) for i in range(n)]
            blocks = [(self._slot_block[slot], res) for slot, res in done]
            with self._cond:
                for slot, _ in done:
                    self._release(slot)
                refused = self._pump_locked()
                self._cond.notify_all()
            for b, res in blocks:
                _complete(b, res)
            _fail(refused)

    def _reaper_died(self, error: BaseException) -> None:
        """Nothing reaps any more: destroying the context waits until the kernel is done with the blocks in
        flight (so their buffers may be reused), then they, those still waiting and every later submit fail."""
        dead = RuntimeError(f"the libaio reaper thread died ({error!r})")
        dead.__cause__ = error
        with self._cond:
            self._dead = dead
            owed = [b for b in self._slot_block if b is not None] + self._waiting.drain()
            self._slot_block = [None] * self.queue_depth
        self._release_context()
        _fail_with(owed, dead)

    def _release_context(self) -> None:
        if self._ctx_live:
            self._ctx_live = False
            self._aio.io_queue_release(self._ctx)

    def close(self) -> None:
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
        self._reaper.join(io_timeout_s())
        if self._reaper.is_alive():  # blocked on I/O the kernel never completes: leave the context to exit
            log.warning("swap: libaio reaper still waiting for I/O after %.0f s; closing without it", io_timeout_s())
            return
        self._release_context()


def _fail(refused: list) -> None:
    for b, err in refused:
        _complete(b, -err)


_announced: set[str] = set()


def libaio_available() -> bool:
    try:
        import libaio  # noqa: F401  (loads libaio.so.1 through ctypes)
    except (ImportError, OSError):
        return False
    return True


def open_backend(name: str = "auto", *, queue_depth: int = 32, threads: int = 4,
                 background_bytes: int | None = None) -> IOBackend:
    """The backend called `name`; `auto` takes libaio when libaio.so.1 loads, else threads. background_bytes
    (libaio; None: no limit) caps the non-urgent bytes in flight ([Note: urgent blocks]); the threads
    backend has at most `threads` blocks in flight anyway."""
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r}: unknown I/O backend; use one of {', '.join(BACKENDS)}")
    if queue_depth < 1:
        raise ValueError(f"queue_depth={queue_depth}: must be >= 1; 32 suits most NVMe drives")
    if threads < 1:
        raise ValueError(f"threads={threads}: must be >= 1; 4 suits most NVMe drives")
    if background_bytes is not None and background_bytes < 1:
        raise ValueError(f"background_bytes={background_bytes}: must be >= 1, or None for no limit")
    if name == "auto":
        name = "libaio" if libaio_available() else "threads"
        if name not in _announced:  # said once per process, not once per store
            _announced.add(name)
            log.info("swap: I/O backend auto -> %s%s", name, "" if name == "libaio" else " (libaio.so.1 did not load)")
    if name == "libaio":
        try:
            return LibaioBackend(queue_depth, background_bytes)
        except (ImportError, OSError) as e:
            raise ValueError(
                f"backend='libaio': cannot load Linux AIO ({e}); install libaio1 and the `libaio` "
                f"package, or use backend='threads' (the config's aio.engine)") from e
    return ThreadsBackend(threads)
