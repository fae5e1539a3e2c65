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
signal.signal(signal.SIGTERM, lambda s, f: sys.exit(7))  # as offload train's handler: Python-level
with SignalWatchdog(grace_s=2.0) if mode != "bare" else open(os.devnull):
    print("ready", flush=True)
    if mode == "busy":
        while True:  # Python code: the handler runs at the next bytecode
            sum(range(1000))
    dist.all_reduce(torch.ones(1))  # blocked in C: the peer never comes
"""


def _start(mode: str):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "PYTHONPATH": REPO}
    return [subprocess.Popen([sys.executable, "-c", SCRIPT, mode], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for r in range(2)]


def _sigterm_rank0(mode: str, wait_s: float):
    procs = _start(mode)
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


def test_without_the_watchdog_python_holds_the_sigterm_until_the_call_returns():
    code, seconds, _ = _sigterm_rank0("bare", wait_s=5)
    assert code is None  # still blocked: what the watchdog is for


def test_a_main_thread_running_python_takes_the_signal_itself():
    code, seconds, err = _sigterm_rank0("busy", wait_s=15)
    assert code == 7, (code, err)  # its own handler's exit, not the watchdog's
    assert "blocked" not in err
