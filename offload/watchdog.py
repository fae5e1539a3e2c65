"""A stop signal the main thread cannot take: `offload train` ends the process itself."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import psutil

from offload.signals import stopping
from offload.swap import remove_run_dirs

# [Note: a signal the main thread cannot take]
# Python runs a signal handler in the main thread, between two bytecodes. A main thread blocked in one C
# call (a collective whose peer is gone, a long wait for I/O) never gets there: SIGTERM then does nothing
# until the call returns, and torchrun or a job scheduler escalates to SIGKILL after its grace period
# (torchrun: 30 s). The watchdog learns of the signal from the interpreter itself (signal.set_wakeup_fd:
# the C-level handler writes the signal number to a pipe at once) and watches the main thread's Python
# frame: if it moves within `grace_s`, the main thread is running Python and takes the signal as usual
# (`offload train` saves its checkpoint and exits 143), and the watchdog stands down; if it stays frozen
# for `grace_s`, the process ends at once with 128 + the signal number, saying where it was stuck. Swap
# data files have no name, so their bytes go with the process ([Note: unlinked data file] in swap/rundir.py),
# and the process removes its run directories before it ends (os._exit runs no atexit).
#
# [Note: a rank whose launcher is gone]
# torchrun starts each rank in a session of its own (its SubprocessHandler passes start_new_session=True), so
# a signal to torchrun's process group, `kill -9 -PGID` included, never reaches the ranks. When torchrun stops
# on SIGTERM or SIGINT it forwards SIGTERM to every rank (and SIGKILL 30 s later); killed with SIGKILL it
# forwards nothing, and its ranks would train on to the end with no one to stop them. So each rank watches
# its launcher: `LauncherWatch` records, at the start, the chain from this process up to it (the launcher is
# the parent of the rank's session leader: the rank itself, or a wrapper script that runs it) and checks
# every `poll_s` that each process in the chain still has the parent it had. A dead parent's children are
# given to init or a subreaper, so a broken link means the launcher (or a wrapper in between) is gone,
# whatever became of its pid. The rank then does what torchrun would have done: it sends itself SIGTERM
# (`offload train` stops, or saves a checkpoint first with --save-every, closing the engine and removing
# its swap), and ends itself `kill_after_s` later if that has not stopped it; where no Python handler takes
# SIGTERM it ends at once, as SIGTERM's default action would, its run directories removed first.
# PR_SET_PDEATHSIG would not do: it fires on the death of the parent *thread* that forked the rank, must be
# set by the launcher between fork and exec (set later by the rank, it misses a parent already gone), and
# sees only the direct parent, not a launcher behind a wrapper script.

GRACE_S = 10.0  # longer than any one op of a training step: a frozen frame this long is stuck, not busy
POLL_S = 0.5  # how often a rank checks that its launcher is still there
KILL_AFTER_S = 30.0  # as torchrun: SIGKILL this long after the SIGTERM that did not stop a rank


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
        _say(f"{self.label}: {signal.Signals(signum).name}: the main thread has been blocked in one call for "
             f"{self.grace_s:g} s ({at}: a collective whose peer is gone, or an I/O wait), so it cannot stop "
             f"itself; exiting now with {128 + signum}, without a checkpoint (the swap files go with the process)")
        _exit_now(128 + signum)


class LauncherWatch:
    """Context manager: under torchrun (TORCHELASTIC_RUN_ID in the environment), a daemon thread that stops
    this rank once its launcher is gone ([Note: a rank whose launcher is gone]); elsewhere it does nothing."""

    def __init__(self, label: str = "offload", poll_s: float = POLL_S, kill_after_s: float = KILL_AFTER_S):
        self.label, self.poll_s, self.kill_after_s = label, poll_s, kill_after_s
        self.chain = launcher_chain() if "TORCHELASTIC_RUN_ID" in os.environ else None
        self._done = threading.Event()

    def __enter__(self) -> "LauncherWatch":
        if self.chain is not None:
            threading.Thread(target=self._watch, name="offload-launcher-watch", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.stand_down()

    def stand_down(self) -> None:
        """Stops watching: the process is stopping on its own."""
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(self.poll_s):
            if not _intact(self.chain):
                if not stopping():  # stopping already (a Stopped raised, its handler gone): it ends on its own
                    self._stop()
                return

    def _stop(self) -> None:
        gone = f"{self.label}: its launcher (pid {self.chain[-1]}) is gone, so nothing supervises this rank any more"
        if not callable(signal.getsignal(signal.SIGTERM)):  # SIG_DFL or SIG_IGN: no Python code would take it
            _say(f"{gone}; exiting now with 143, as SIGTERM's default action would")
            _exit_now(143)
        _say(f"{gone}; stopping it as the launcher would have: SIGTERM")
        os.kill(os.getpid(), signal.SIGTERM)
        if not self._done.wait(self.kill_after_s):
            _say(f"{self.label}: still running {self.kill_after_s:g} s after that SIGTERM; exiting now with 137")
            _exit_now(128 + signal.SIGKILL)


def launcher_chain() -> list[int]:
    """[this process, its parent, ..., the launcher]: the launcher is the parent of this process's session
    leader when that leader is this process or an ancestor (torchrun starts a rank in its own session),
    else the parent."""
    chain, leader = [os.getpid()], os.getsid(0)
    for parent in psutil.Process().parents():
        chain.append(parent.pid)
        if chain[-2] == leader:
            return chain
    return [os.getpid(), os.getppid()]


def _intact(chain: list[int]) -> bool:
    """Whether each process of `chain` still has the next one as its parent."""
    try:
        return all(psutil.Process(child).ppid() == parent for child, parent in zip(chain, chain[1:]))
    except psutil.NoSuchProcess:
        return False


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr was a pipe to the launcher, gone with it
        pass


def _exit_now(code: int) -> None:
    """Ends the process at once (os._exit: no atexit, no finally), its swap run directories removed first."""
    remove_run_dirs()
    os._exit(code)


def _where(thread_id: int):
    frame = sys._current_frames().get(thread_id)
    return None if frame is None else (id(frame), frame.f_lasti)
