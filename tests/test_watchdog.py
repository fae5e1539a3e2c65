"""[Note: a signal the main thread cannot take] in offload/watchdog.py: SIGTERM reaching a process whose
main thread is blocked in a collective (its peer gone quiet) ends it within the grace period with 143,
where Python's own handler would wait for the call to return; a main thread running Python takes the
signal itself and the watchdog stands down."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import os, signal, sys, time
import torch, torch.distributed as dist
from offload.watchdog import SignalWatchdog
dist.init_process_group("gloo")
rank, mode = dist.get_rank(), sys.argv[1]
if rank == 1:
    time.sleep(60)  # never enters the collective
    sys.exit(0)
if len(sys.argv) > 2:
    from offload.swap import SwapStore
    store = SwapStore(sys.argv[2])  # open: its run directory exists until the process removes it
signal.signal(signal.SIGTERM, lambda s, f: sys.exit(7))  # as offload train's handler: Python-level
with SignalWatchdog(grace_s=2.0) if mode != "bare" else open(os.devnull):
    print("ready", flush=True)
    if mode == "busy":
        while True:  # Python code: the handler runs at the next bytecode
            sum(range(1000))
    dist.all_reduce(torch.ones(1))  # blocked in C: the peer never comes
"""


def _start(mode: str, *swap_dir: str):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "PYTHONPATH": REPO}
    return [subprocess.Popen([sys.executable, "-c", SCRIPT, mode, *swap_dir], env={**env, "RANK": str(r)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]


def _sigterm_rank0(mode: str, wait_s: float, *swap_dir: str):
    procs = _start(mode, *swap_dir)
    try:
        assert procs[0].stdout.readline().strip() == "ready"
        time.sleep(1.0)  # inside the collective (or the loop)
        t0 = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        try:
            procs[0].wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return None, time.monotonic() - t0, ""
        return procs[0].returncode, time.monotonic() - t0, procs[0].stderr.read()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_sigterm_ends_a_main_thread_blocked_in_a_collective_within_the_grace_period():
    code, seconds, err = _sigterm_rank0("watched", wait_s=15)
    assert code == 143, (code, err)
    assert seconds < 8, seconds
    assert "SIGTERM" in err and "blocked in one call" in err and "exiting now with 143" in err, err


def test_a_blocked_main_thread_ended_by_the_watchdog_leaves_no_swap_run_directory(tmp_path):
    """os._exit runs no atexit: the watchdog removes the process's swap run directories itself."""
    from offload.swap import list_runs

    code, _, err = _sigterm_rank0("watched", 15, str(tmp_path / "nvme"))
    assert code == 143, (code, err)
    assert (tmp_path / "nvme").is_dir() and list_runs(tmp_path / "nvme") == [], list_runs(tmp_path / "nvme")


def test_without_the_watchdog_python_holds_the_sigterm_until_the_call_returns():
    code, seconds, _ = _sigterm_rank0("bare", wait_s=5)
    assert code is None  # still blocked: what the watchdog is for


def test_a_main_thread_running_python_takes_the_signal_itself():
    code, seconds, err = _sigterm_rank0("busy", wait_s=15)
    assert code == 7, (code, err)  # its own handler's exit, not the watchdog's
    assert "blocked" not in err


# [Note: a rank whose launcher is gone] in offload/watchdog.py: a launcher that starts its rank in a session of
# its own, as torchrun does, then dies by SIGKILL.
LAUNCHER = r"""
import os, subprocess, sys, time
cmd = [sys.executable, "-c", sys.argv[1], *sys.argv[3:]]
if sys.argv[2] == "wrapper":  # a shell in between that stays (a command follows python's, so it does not exec)
    cmd = ["sh", "-c", '"$@"; echo ended', "sh", *cmd]
rank = subprocess.Popen(cmd, start_new_session=True, env={**os.environ, "TORCHELASTIC_RUN_ID": "test"})
time.sleep(600)
"""
RANK = r"""
import os, signal, sys, time
from offload.swap import SwapStore
from offload.watchdog import LauncherWatch
mode, swap_dir = sys.argv[1], sys.argv[2]
store = SwapStore(swap_dir)
if mode == "handled":  # as offload train: SIGTERM raises, the with-blocks close the store
    signal.signal(signal.SIGTERM, lambda s, f: sys.exit(143))
if mode == "deaf":  # a handler that does not stop the process
    signal.signal(signal.SIGTERM, lambda s, f: print("SIGTERM taken, ignored", file=sys.stderr, flush=True))
if mode == "stopping":  # as offload train after an agreed SIGTERM: Stopped raised, its handler gone
    from offload.signals import Stopped
    try:
        raise Stopped(signal.SIGTERM)
    except Stopped:
        pass
with store, LauncherWatch(label="rank", poll_s=0.2, kill_after_s=2.0):
    print(f"ready {os.getpid()}", file=sys.stderr, flush=True)
    if mode == "stopping":  # closing its engine and writing its report, past the launcher's end
        time.sleep(2.0)
        print("report written", file=sys.stderr, flush=True)
        sys.exit(143)
    while True:
        time.sleep(0.05)
"""


def _orphan(tmp_path, mode: str, between: str = "none") -> tuple[float, str]:
    """Starts a launcher and its rank, kills the launcher with SIGKILL; (seconds until the rank ended, its stderr)."""
    import psutil

    err_path = tmp_path / "rank.err"
    with open(err_path, "w") as err:
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, RANK, between, mode, str(tmp_path / "nvme")],
                                    env={**os.environ, "PYTHONPATH": REPO}, stderr=err)
    rank = None
    try:
        deadline = time.monotonic() + 60
        while "ready" not in err_path.read_text():
            assert launcher.poll() is None and time.monotonic() < deadline, err_path.read_text()
            time.sleep(0.05)
        rank = psutil.Process(int(err_path.read_text().split("ready ")[1].split()[0]))
        launcher.kill()
        launcher.wait()
        t0 = time.monotonic()
        while not _ended(rank) and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        return time.monotonic() - t0, err_path.read_text()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        if rank is not None and not _ended(rank):
            rank.kill()


def _ended(process) -> bool:
    """Whether a process that is not our child has ended (gone, or a zombie its new parent has not reaped)."""
    import psutil

    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("mode,between", [("default", "none"), ("handled", "none"), ("handled", "wrapper")])
def test_a_rank_whose_launcher_is_killed_stops_and_leaves_no_swap(tmp_path, mode, between):
    """The rank stops within a second or two: at once where nothing handles SIGTERM (143, as its default action),
    else through its handler (the store closed by its with-block); a shell in between does not hide the launcher."""
    from offload.swap import list_runs

    seconds, err = _orphan(tmp_path, mode, between)
    assert seconds < 5, (seconds, err)
    assert "rank: its launcher (pid" in err and "is gone" in err, err
    assert ("exiting now with 143" in err) == (mode == "default"), err
    assert list_runs(tmp_path / "nvme") == [], list_runs(tmp_path / "nvme")


def test_a_rank_that_does_not_stop_on_its_sigterm_is_ended_kill_after_s_later(tmp_path):
    from offload.swap import list_runs

    seconds, err = _orphan(tmp_path, "deaf")
    assert 2 <= seconds < 7, (seconds, err)
    assert "SIGTERM taken, ignored" in err and "still running 2 s after that SIGTERM; exiting now with 137" in err, err
    assert list_runs(tmp_path / "nvme") == []


def test_a_rank_stopping_on_its_own_when_its_launcher_goes_is_left_to_finish(tmp_path):
    """A rank already stopping on a signal's account (a Stopped raised: over ranks, another rank's SIGTERM agreed;
    its handler gone) is not ended by the watch halfway through closing its engine and writing its report."""
    seconds, err = _orphan(tmp_path, "stopping")
    assert "report written" in err and "exiting now" not in err, err
    assert seconds < 5, (seconds, err)


def test_outside_torchrun_the_launcher_is_not_watched(monkeypatch):
    from offload.watchdog import LauncherWatch, launcher_chain

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert LauncherWatch().chain is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert LauncherWatch().chain == launcher_chain() and launcher_chain()[0] == os.getpid()
