"""Swap I/O failures as a drive delivers them, under a real Engine: the swap store's I/O backend is
tests/swap_util.py's FaultyBackend around the real one, completing the chosen blocks with -EIO or
-ENOSPC on a backend thread, so the error reaches the engine through the ticket it waits on (not from a
mock's write()). In a forward's weight fetch, in the backward's write-back of the gradient accumulator and
in the optimizer's window writes: the error names the errno and the swap file; the micro-step rolls back
(nothing changed yet) or the engine fails (states partly updated); close() leaves no thread and no fd;
the last checkpoint loads into a new engine, which continues as a run that never failed."""

from __future__ import annotations

import copy
import errno
import os
import threading
import time

import pytest
import torch

import offload
from offload import swap
from offload.step.pipeline import Phase, StepFailed
from offload.swap import SwapIOError, SwapStore
from tests.engine_util import MLP, mlp_batches, train
from tests.swap_util import FaultyBackend

STATES = ("master", "exp_avg", "exp_avg_sq")


class Faults:
    """Which blocks fail: once `when(kind, write)` is set, every block of a swap key whose kind (the key's
    middle part: weight.bfloat16, grad, master, ...) and direction it accepts completes with -errno."""

    def __init__(self):
        self.when, self.errno, self.failed = None, errno.EIO, 0
        self.current = threading.local()  # the key whose blocks the calling thread is submitting

    def __call__(self, block):
        key = getattr(self.current, "key", None)
        if self.when is None or key is None or not self.when(key.split("/")[1], block.write):
            return None
        self.failed += 1
        return -self.errno


@pytest.fixture
def faults(monkeypatch):
    """Every SwapStore opened meanwhile runs its blocks through a FaultyBackend asking `faults`."""
    f = Faults()
    real_open_backend, real_write, real_read = swap.store.open_backend, SwapStore.write, SwapStore.read
    monkeypatch.setattr(swap.store, "open_backend", lambda *a, **k: FaultyBackend(real_open_backend(*a, **k), f))

    def submitting(real):
        def call(self, key, *args, **kwargs):  # a store submits a key's blocks on the calling thread
            f.current.key = key
            try:
                return real(self, key, *args, **kwargs)
            finally:
                f.current.key = None
        return call

    monkeypatch.setattr(SwapStore, "write", submitting(real_write))
    monkeypatch.setattr(SwapStore, "read", submitting(real_read))
    return f


def config(path, gas: int) -> dict:
    return {"precision": "bf16", "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"},
            "nvme_path": str(path), "units": {"min_numel": 512}, "reuse_bytes": 0, "optimizer": {"lr": 1e-2},
            "gradient_accumulation_steps": gas, "aio": {"engine": "threads"}}


def swap_io_error(e: BaseException) -> SwapIOError | None:
    while e is not None and not isinstance(e, SwapIOError):
        e = e.__cause__ or e.__context__
    return e


def threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate())


def settled(before: list[str], timeout_s: float = 10.0) -> list[str]:
    """The thread names once the FaultyBackend's completion threads (which end at once) are gone."""
    deadline = time.monotonic() + timeout_s
    while threads() != before and time.monotonic() < deadline:
        time.sleep(0.05)
    return threads()


# where: (gradient_accumulation_steps, which blocks fail, the call that raises, the outcome [Note: failure
# semantics] prescribes). The optimizer's windows are written during the backward: each unit's step starts
# as soon as its gradients are final (overlap_step), so some units are stepped when a later write fails.
WHERE = {
    "forward fetch": (1, lambda kind, write: kind.startswith("weight") and not write, "forward", "rolled back"),
    "backward write-back": (2, lambda kind, write: kind == "grad" and write, "backward", "rolled back"),
    "optimizer window writes": (1, lambda kind, write: kind in STATES and write, "backward", "failed"),
}


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
@pytest.mark.parametrize("where", WHERE)
def test_a_swap_error_on_a_backend_thread(tmp_path, faults, where, err):
    gas, when, call, outcome = WHERE[where]
    torch.manual_seed(0)
    model, batches = MLP(), mlp_batches(4 * gas)
    with offload.initialize(copy.deepcopy(model), config(tmp_path / "ref", gas)) as ref:
        straight = train(ref, batches)
    before_threads, before_fds = threads(), len(os.listdir("/proc/self/fd"))
    eng = offload.initialize(copy.deepcopy(model), config(tmp_path / "swap", gas))
    try:
        train(eng, batches[:2 * gas])
        ckpt = eng.save_checkpoint(str(tmp_path / "ckpts"))
        faults.when, faults.errno = when, err
        with pytest.raises(Exception) as raised:
            x, y = batches[2 * gas]
            raising = "forward"
            loss = eng(x, y)
            raising = "backward"
            eng.backward(loss)
        faults.when = None
        assert raising == call
        assert faults.failed > 0
        e = swap_io_error(raised.value)
        assert e is not None, f"{where}: {raised.value!r} is not a swap I/O error"
        assert e.errno == err and str(tmp_path / "swap") in e.path and errno.errorcode[err] in str(e)
        if outcome == "rolled back":  # nothing had changed: the engine goes on as before the micro-step
            assert eng.phase is Phase.IDLE and eng.step_count == 2 and eng.micro_step == 0
            assert train(eng, batches[2 * gas:]) == straight[2 * gas:]
        else:
            assert eng.phase is Phase.FAILED
            with pytest.raises(StepFailed, match="SwapIOError"):
                eng(*batches[0])
    finally:
        eng.close()
    assert settled(before_threads) == before_threads
    assert len(os.listdir("/proc/self/fd")) == before_fds
    with offload.initialize(copy.deepcopy(model), config(tmp_path / "again", gas)) as again:
        again.load_checkpoint(ckpt)
        assert train(again, batches[2 * gas:]) == straight[2 * gas:]
