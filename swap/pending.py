"""Results that other threads owe: completed exactly once, waited for with an end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Callable, Iterable

# [Note: no wait without an end]
# A transfer completes on another thread (an I/O backend's, a copy stream's). With a plain Event, a
# completion callback that raises or a thread that dies leaves the event unset, and its waiter (or
# close() at interpreter exit) blocks forever. So such a result is a `Pending`: whoever owes it
# completes it exactly once, with an error when anything went wrong; a thread started with
# `start_thread` fails everything it still owed if it dies; and every wait ends after the I/O timeout
# with an error naming what was pending, its bytes and how long it waited. The timeout is generous
# (a drive may stall for seconds, never for minutes) and only says that something is stuck.

# [Note: held sections]
# A signal handler that raises (offload.signals: SIGTERM and Ctrl-C stop a run) interrupts the main
# thread at any instruction. Between registering a transfer and handing all its blocks to the backend,
# that would leave a transfer that never completes: close() then waits for it until the I/O timeout (seen:
# `offload train` stopped by SIGTERM hung in SwapStore.close), or a backend with blocks never queued. Such
# a section runs inside `held()`; a handler that calls `defer(raise_it)` while one is open returns, and the
# section's end calls raise_it instead, once everything it started is queued.

log = logging.getLogger("swap")

IO_TIMEOUT_S = 600.0
TIMEOUT_ENV = "OFFLOAD_IO_TIMEOUT_S"


_held = 0            # held() sections open in the main thread (signal handlers run there only)
_deferred: list = []  # what a handler deferred while one was open


@contextlib.contextmanager
def held():
    """[Note: held sections] A section a deferring signal handler does not interrupt (main thread)."""
    global _held
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _held += 1
    try:
        yield
    finally:
        _held -= 1
        if not _held and _deferred:
            raise_it = _deferred[0]
            _deferred.clear()
            raise_it()


def defer(raise_it: Callable[[], None]) -> bool:
    """For a signal handler: inside a held() section, keeps `raise_it` for the section's end and returns
    True; otherwise returns False (the handler raises now)."""
    if not _held:
        return False
    _deferred.append(raise_it)
    return True


def io_timeout_s() -> float:
    """How long any wait for a transfer may take: IO_TIMEOUT_S, or $OFFLOAD_IO_TIMEOUT_S (tests shorten it)."""
    value = os.environ.get(TIMEOUT_ENV)
    if value is None:
        return IO_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV}={value!r}: must be a positive number of seconds; unset it for "
                         f"the default of {IO_TIMEOUT_S:g}")
    return seconds


class PendingTimeout(TimeoutError):
    """A wait that reached the I/O timeout; `what` says what was pending, `waited_s` how long."""

    def __init__(self, what: str, waited_s: float):
        super().__init__(f"{what}: not done after {waited_s:.1f} s; the thread that owes it is stuck or the "
                         f"drive stopped answering (a slow drive? raise {TIMEOUT_ENV}, default {IO_TIMEOUT_S:g})")
        self.what, self.waited_s = what, waited_s


class Pending:
    """A result another thread owes: `complete(error=None)` once, `wait()` raises that error."""

    def __init__(self, what: str, nbytes: int = 0):
        self.what, self.nbytes = what, nbytes
        self.error: BaseException | None = None
        self._event = threading.Event()
        self._lock = threading.Lock()

    def describe(self) -> str:
        return f"{self.what} ({self.nbytes} bytes)" if self.nbytes else self.what

    def done(self) -> bool:
        return self._event.is_set()

    def complete(self, error: BaseException | None = None) -> bool:
        """Marks it done (with `error`, raised to waiters); the first call wins. Returns whether this one did."""
        with self._lock:
            if self._event.is_set():
                return False
            self.error = error
            self._event.set()
        return True

    def settle(self, timeout: float | None = None) -> None:
        """Waits until done, at most `timeout` (default: io_timeout_s()) seconds, else PendingTimeout.
        Its own error is not raised: that is for whoever waits for the result."""
        limit = io_timeout_s() if timeout is None else timeout
        t0 = time.monotonic()
        if not self._event.wait(limit):
            raise PendingTimeout(self.describe(), time.monotonic() - t0)

    def wait(self, timeout: float | None = None) -> None:
        """settle(), then raises the error it completed with, if any."""
        self.settle(timeout)
        if self.error is not None:
            raise self.error


def fail_all(pendings: Iterable[Pending | None], error: BaseException) -> None:
    """Completes every pending that is not done yet with `error` (what a dead thread still owed)."""
    for p in pendings:
        if p is not None:
            p.complete(error)


def start_thread(target: Callable[[], None], name: str, on_death: Callable[[BaseException], None]) -> threading.Thread:
    """A daemon thread running `target()`. Should `target` raise, `on_death(error)` must fail everything
    the thread still owed (see the Note): its waiters then raise instead of blocking."""

    def run() -> None:
        try:
            target()
        except BaseException as e:  # noqa: BLE001  (handed to the waiters, not lost with the thread)
            log.error("%s: thread died: %r; failing what it owed", name, e)
            on_death(e)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
