"""A stop signal the main thread cannot take: `offload train` ends the process itself.

[Note: a signal the main thread cannot take]
Python runs a signal handler in the main thread, between two bytecodes. A main thread blocked in one C
call (a collective whose peer is gone, a long wait for I/O) never gets there: SIGTERM then does nothing
until the call returns, and torchrun or a job scheduler escalates to SIGKILL after its grace period
(torchrun: 30 s). The watchdog learns of the signal from the interpreter itself (signal.set_wakeup_fd:
the C-level handler writes the signal number to a pipe at once) and watches the main thread's Python
frame: if it moves within `grace_s`, the main thread is running Python and takes the signal as usual
(`offload train` saves its checkpoint and exits 143), and the watchdog stands down; if it stays frozen
for `grace_s`, the process ends at once with 128 + the signal number, saying where it was stuck. Swap
data files have no name, so their bytes go with the process ([Note: unlinked data file] in swap/rundir.py).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

GRACE_S = 10.0  # longer than any one op of a training step: a frozen frame this long is stuck, not busy


class SignalWatchdog:
    """Context manager: inside it, a SIGTERM the main thread cannot take within `grace_s` ends the process
    (os._exit(128 + signum)). Only from the main thread, with a Python handler installed for the signal
    (the interpreter writes to the wakeup pipe only then); elsewhere it does nothing."""

    def __init__(self, grace_s: float = GRACE_S, signums=(signal.SIGTERM,), label: str = "offload"):
        self.grace_s, self.signums, self.label = grace_s, set(int(s) for s in signums), label
        self._pipe = None
        self._previous_fd = -1

    def __enter__(self) -> "SignalWatchdog":
        if threading.current_thread() is not threading.main_thread():
            return self
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            self._previous_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:  # not the main interpreter
            os.close(r), os.close(w)
            return self
        self._pipe = (r, w)
        threading.Thread(target=self._watch, args=(r, threading.main_thread().ident), name="offload-signal-watchdog",
                         daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._previous_fd)
        r, w = self._pipe
        self._pipe = None
        os.close(w)  # the watcher reads end-of-file and returns; it closes the read end

    def _watch(self, r: int, main_id: int) -> None:
        try:
            while True:
                data = os.read(r, 64)
                if not data:
                    return
                for signum in data:
                    if signum in self.signums and self._frozen(main_id):
                        self._end(signum, main_id)
        finally:
            os.close(r)

    def _frozen(self, main_id: int) -> bool:
        """Whether the main thread's Python frame stays where it is for grace_s."""
        where = _where(main_id)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline:
            time.sleep(0.05)
            if _where(main_id) != where:
                return False
        return True

    def _end(self, signum: int, main_id: int) -> None:
        frame = sys._current_frames().get(main_id)
        at = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}" if frame else "unknown"
        print(f"{self.label}: {signal.Signals(signum).name}: the main thread has been blocked in one call for "
              f"{self.grace_s:g} s ({at}: a collective whose peer is gone, or an I/O wait), so it cannot stop "
              f"itself; exiting now with {128 + signum}, without a checkpoint (the swap files go with the process)",
              file=sys.stderr, flush=True)
        os._exit(128 + signum)


def _where(thread_id: int):
    frame = sys._current_frames().get(thread_id)
    return None if frame is None else (id(frame), frame.f_lasti)
