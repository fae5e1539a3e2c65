"""Stopping on SIGTERM and SIGINT with the engine closed, for callers that ask (`offload train` does)."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable, Iterator

from offload.swap.pending import defer

# [Note: signals]
# SLURM and Kubernetes stop a job with SIGTERM (and SIGKILL after a grace period); Ctrl-C sends SIGINT.
# Inside `stop_on_signals()` both raise `Stopped` in the main thread at its next Python instruction, so
# `with engine:` blocks and `finally` clauses run: engine.close() stops the engine's threads and removes
# its swap files, and the caller decides how to end (`offload train` prints its partial report and exits
# with 128 + the signal number). `Stopped` is a KeyboardInterrupt: code that treats Ctrl-C as "stop"
# treats SIGTERM the same way, and `except Exception` does not swallow it. An exception raised by a signal
# handler can still be lost (a bare `except BaseException: pass` that was running, a finalizer), so the
# signal is also recorded: the `check()` the block receives raises Stopped again (a loop calls it once a
# step), and so does the end of a block that finished normally after a signal. Inside a swap submission
# (between registering a transfer and queueing its blocks: [Note: held sections] in swap/pending.py) the
# handler defers its exception to the section's end, so no transfer is left that nobody will complete.
# Outside it the library handles no signal: SIGTERM keeps its default action and ends the process at once,
# even inside a long C call (a handler in Python would wait for that call to return), and the swap data
# file's bytes go with the process since it has no name ([Note: unlinked data file] in swap/rundir.py; the
# stale run directory left, owner.json only, goes with `offload clean`). Ctrl-C raises KeyboardInterrupt as
# usual, and the run directories go at interpreter exit.

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_STOPPING = threading.Event()  # a Stopped was raised: the process is stopping on a signal's account


def stopping() -> bool:
    """Whether this process is stopping on a signal's account (a Stopped was raised): what a watch that would
    stop it leaves alone (offload.watchdog.LauncherWatch)."""
    return _STOPPING.is_set()


class Stopped(KeyboardInterrupt):
    """Raised by `stop_on_signals` when one of its signals arrives; `signum`, `name`, `exit_code` (128 + signum)."""

    def __init__(self, signum: int):
        _STOPPING.set()
        self.signum = int(signum)
        self.name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _raise(signum: int) -> None:
    raise Stopped(signum)


@contextlib.contextmanager
def stop_on_signals(signums=SIGNALS) -> Iterator[Callable[[], None]]:
    """Inside the block, each of `signums` (default SIGTERM and SIGINT) raises Stopped in the main thread;
    the previous handlers come back when it ends. Yields `check()`, which raises Stopped if a signal
    arrived (see the Note: its exception may have been lost); a block that ends normally after a signal
    raises it too. Catch Stopped outside the block. A signal the process ignores (nohup, a background
    job's SIGINT) stays ignored, as Python itself leaves an ignored SIGINT alone. Python runs signal
    handlers in the main thread only, so in another thread this changes nothing."""
    received: list[int] = []

    def check() -> None:
        if received:
            raise Stopped(received[0])

    if threading.current_thread() is not threading.main_thread():
        yield check
        return

    def handler(signum, frame):
        received.append(signum)
        if not defer(lambda: _raise(signum)):  # inside a swap submission: at its end ([Note: held sections])
            raise Stopped(signum)

    previous = {s: signal.signal(s, handler) for s in signums if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield check
    finally:
        for s, h in previous.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)
    check()
