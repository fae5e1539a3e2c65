"""SIGTERM and SIGINT ([Note: signals] in offload/signals.py): `offload train` stops with its swap files removed,
a partial report and one line, exit code 128 + signum; a script's engine is closed by `offload.stop_on_signals`,
and without it SIGTERM ends the script at once with no swap bytes left behind."""

import json
import os
import signal
import time

import pytest
import torch

import offload
from offload.swap import clean, list_runs
from tests.process_util import RESET, finish, start, wait_for

RUN_OFFLOAD = RESET + "import runpy; runpy.run_module('offload', run_name='__main__')"


def swap_files(swap_dir):
    return [os.path.join(d, f) for d, _, fs in os.walk(swap_dir) for f in fs]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_offload_train_stops_cleanly_on_a_signal(tmp_path, sig):
    swap_dir, out_dir, name = tmp_path / "swap", tmp_path / "run", signal.Signals(sig).name
    proc = start([RUN_OFFLOAD, "train", "--model", "tiny", "--steps", "100000", "--batch-size", "2",
                  "--seq-len", "32", "--offload-param", "nvme", "--offload-optimizer", "nvme",
                  "--nvme-path", str(swap_dir), "--out", str(out_dir), "--no-progress"], tmp_path)
    wait_for(lambda: any(f.endswith("owner.json") for f in swap_files(swap_dir)), "a swap run", proc, tmp_path)
    wait_for(lambda: "steps x 64 tokens" in (tmp_path / "stdout").read_text(), "training (the header)", proc, tmp_path)
    time.sleep(1.0)  # a few steps
    proc.send_signal(sig)
    stdout, stderr = finish(proc, tmp_path)

    assert proc.returncode == 128 + sig and "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"offload train: stopped by {name} after step ") and " of 100000; " in last, stderr
    assert f"swap files removed; partial report in {out_dir}" in last
    assert f"(stopped by {name} after step" in stdout and "report      " in stdout, stdout  # the summary table
    report = json.loads((out_dir / "report.json").read_text())
    assert report["stopped"]["signal"] == name and report["steps"] == report["stopped"]["steps_done"]
    assert len(report["losses"]) == report["steps"]
    if report["steps"]:  # the swap it used while training, not the closed engine's 0
        assert report["stats"]["tiers"]["nvme"]["peak_bytes"] > 0, report["stats"]["tiers"]["nvme"]
    assert swap_files(swap_dir) == [] and os.listdir(swap_dir) == []


_SCRIPT = """
import sys, time, torch, offload
swap, opt_in = sys.argv[1], sys.argv[2] == "opt-in"
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
cfg = {"offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}, "nvme_path": swap,
       "units": {"min_numel": 1024}}

def train():
    with offload.initialize(model, cfg) as engine:
        print("training", flush=True)
        while True:
            engine.backward(engine(torch.randn(4, 256)).square().mean())
            engine.step()

if opt_in:
    try:
        with offload.stop_on_signals():
            train()
    except offload.Stopped as e:
        print(f"stopped by {e.name}", flush=True)
        sys.exit(e.exit_code)
else:
    train()
"""


@pytest.mark.parametrize("opt_in", [False, True], ids=["default", "stop_on_signals"])
def test_a_script_s_swap_files_go_on_sigterm(tmp_path, opt_in):
    """Without opt-in, SIGTERM keeps its default action: the process ends at once and the unlinked data
    file's bytes go with it, leaving a stale run directory (owner.json only) that clean() removes; with
    offload.stop_on_signals it raises Stopped, `with engine:` closes the engine and the script decides."""
    swap_dir = tmp_path / "swap"
    proc = start([RESET + _SCRIPT, str(swap_dir), "opt-in" if opt_in else "default"], tmp_path)
    wait_for(lambda: "training" in (tmp_path / "stdout").read_text(), "training", proc, tmp_path)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = finish(proc, tmp_path)
    if opt_in:
        assert proc.returncode == 143 and "stopped by SIGTERM" in stdout and "Traceback" not in stderr, stderr
    else:
        assert proc.returncode == -signal.SIGTERM and "Traceback" not in stderr, stderr
        assert [os.path.basename(f) for f in swap_files(swap_dir)] == ["owner.json"]
        [run] = list_runs(swap_dir)
        assert run.stale and run.named_bytes == 0 and clean(swap_dir) == [run]
    assert swap_files(swap_dir) == [] and os.listdir(swap_dir) == []


def test_stop_on_signals_raises_stopped_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with pytest.raises(offload.Stopped) as e:
        with offload.stop_on_signals():
            assert signal.getsignal(signal.SIGTERM) not in before
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises in this thread as soon as Python checks for signals
    assert isinstance(e.value, KeyboardInterrupt)  # `except Exception` does not swallow it
    assert (e.value.signum, e.value.name, e.value.exit_code) == (signal.SIGTERM, "SIGTERM", 143)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


@pytest.fixture
def sigint_handled():
    """SIGINT handled as Python's default does: a suite started as a background job (`make test &`)
    inherits an ignored SIGINT, which stop_on_signals rightly leaves ignored, so a test sending itself
    SIGINT would see nothing arrive."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_swallowed_stop_is_raised_again_by_check_and_at_the_end_of_the_block(sigint_handled):
    with pytest.raises(offload.Stopped):
        with offload.stop_on_signals() as check:
            check()  # nothing arrived yet
            try:  # what a bare `except BaseException: pass` somewhere below would do
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
            except BaseException:
                pass
            with pytest.raises(offload.Stopped) as e:
                check()
            assert e.value.name == "SIGINT"
    # and a block that ends normally after a signal still raises it on the way out


def test_stop_on_signals_leaves_an_ignored_signal_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with offload.stop_on_signals():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_signal_inside_a_swap_submission_is_raised_once_it_is_queued(tmp_path, monkeypatch):
    """[Note: held sections] in swap/pending.py: a SIGTERM between registering a transfer and queueing its
    blocks is raised right after they are queued, so the transfer completes and close() returns at once
    (before: the blocks were never queued and close() waited the whole I/O timeout for them)."""
    from offload.swap import SwapStore

    monkeypatch.setenv("OFFLOAD_IO_TIMEOUT_S", "5")
    store = SwapStore(str(tmp_path))
    queue = store.backend.submit

    def submit(blocks):
        os.kill(os.getpid(), signal.SIGTERM)  # handled at the next instruction: inside the section
        queue(blocks)

    monkeypatch.setattr(store.backend, "submit", submit)
    with pytest.raises(offload.Stopped):
        with offload.stop_on_signals():
            store.write("k", torch.ones(4096))
    t0 = time.monotonic()
    store.close()
    assert time.monotonic() - t0 < 2
