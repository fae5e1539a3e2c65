"""A child Python process for the signal tests (tests/test_signals.py, tests/test_swap_unlinked.py): started
with the signal defaults restored and its output into files, waited on for what it should show, and finished
without hanging the test."""

import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# A CI runner's background job may ignore SIGINT, and its children inherit that: the child restores the
# defaults first (in the child itself: a preexec_fn can deadlock after fork in a process with threads).
RESET = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"


def start(argv, tmp_path):
    """python -c CODE ARGS..., its output into files (a pipe nobody reads could fill and block it)."""
    out, err = open(tmp_path / "stdout", "w"), open(tmp_path / "stderr", "w")
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", *argv], stdout=out, stderr=err, env=env)


def wait_for(predicate, what, proc, tmp_path, seconds=120.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {what} (exit code {proc.wait()}): {(tmp_path / 'stderr').read_text()[-3000:]}")
        time.sleep(0.05)


def finish(proc, tmp_path):
    """Waits for the child's exit; a child still running after 120 s is a hang: SIGABRT makes faulthandler
    print every thread's stack, and the test fails with it."""
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        pytest.fail(f"the process did not exit within 120 s; its threads:\n{(tmp_path / 'stderr').read_text()[-6000:]}")
    return (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
