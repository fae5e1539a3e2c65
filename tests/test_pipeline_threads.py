"""One pipeline structure on every backend ([Note: one copy stream per direction] in scheduler.streams):
the gradient accumulation, and the optimizer step when it overlaps backward, run on the d2h worker
thread, never on the thread that runs forward and backward. Runs on the device the engine picks (the
CPU here; CUDA where one is visible), so the same assertion covers both."""

import threading

import pytest
import torch

import offload
import offload.step.accumulator as accumulator
import offload.step.windows as step
from tests.engine_util import MLP, mlp_batches


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("place", ["cpu", "nvme"])
def test_accumulation_and_overlapped_step_run_on_the_d2h_worker(tmp_path, monkeypatch, place, overlap):
    where: dict[str, set[str]] = {"accumulate": set(), "step_window": set()}
    real_acc, real_step = accumulator.accumulate, step.step_window

    def accumulate(*a, **kw):
        where["accumulate"].add(threading.current_thread().name)
        return real_acc(*a, **kw)

    def step_window(*a, **kw):
        where["step_window"].add(threading.current_thread().name)
        return real_step(*a, **kw)

    monkeypatch.setattr(accumulator, "accumulate", accumulate)
    monkeypatch.setattr(step, "step_window", step_window)
    cfg = {"precision": "bf16", "offload_param": {"device": place}, "offload_optimizer": {"device": place},
           "nvme_path": str(tmp_path), "units": {"min_numel": 512}, "overlap_step": overlap}
    torch.manual_seed(0)
    with offload.initialize(MLP(), cfg) as eng:
        for x, y in mlp_batches(2):
            x, y = x.to(eng.device), y.to(eng.device)
            eng.backward(eng(x, y))
            eng.step()
    main = threading.current_thread().name
    assert {n.split("_")[0] for n in where["accumulate"]} == {"offload-d2h"}
    assert where["step_window"] and {n.split("_")[0] for n in where["step_window"]} == (
        {"offload-d2h"} if overlap else {main})


class Interrupted(BaseException):
    """What the test's signal handler raises in the main thread (a KeyboardInterrupt or offload's Stopped)."""


def test_an_interrupt_during_backward_waits_for_the_d2h_job_before_rolling_back(tmp_path, monkeypatch):
    """A signal's exception in the main thread while it waits for the last gradient job: the job (an overlapped
    nvme step on the d2h thread) finishes before the failure handling returns its windows' chunks; before,
    the job had left the list of jobs in flight as its wait began and the rollback ran beside it (KeyError
    'grad' in the CI run of 2026-12-04)."""
    import signal
    import sys
    import time

    def interrupt(signum, frame):
        raise Interrupted()

    def main_waits_for_the_jobs() -> bool:
        frame = sys._current_frames().get(main)
        while frame is not None and frame.f_code.co_name != "wait_all":
            frame = frame.f_back
        return frame is not None

    main, real_step, events, last = threading.main_thread().ident, step.step_window, [], []

    def step_window(rt, st, w, unit, i, **kw):
        if unit.index in last and not events:  # the last job of the backward, its first window
            deadline = time.monotonic() + 10
            while not main_waits_for_the_jobs() and time.monotonic() < deadline:
                time.sleep(0.01)
            events.append("interrupt")
            signal.pthread_kill(main, signal.SIGUSR1)
            time.sleep(0.5)
            try:
                return real_step(rt, st, w, unit, i, **kw)
            finally:
                events.append("job done")
        return real_step(rt, st, w, unit, i, **kw)

    monkeypatch.setattr(step, "step_window", step_window)
    old = signal.signal(signal.SIGUSR1, interrupt)
    cfg = {"offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}, "nvme_path": str(tmp_path),
           "units": {"min_numel": 512}, "overlap_step": True}
    try:
        torch.manual_seed(0)
        eng = offload.initialize(MLP(), cfg)
        last.append(min(u.index for u in eng.pipeline.units if u.trainable_numel))
        x, y = mlp_batches(1)[0]
        with pytest.raises(Interrupted):
            eng.backward(eng(x, y))
        assert events == ["interrupt", "job done"], "the rollback ran beside the d2h job"
        assert eng.rt.staging.lent == 0  # every chunk back in the pool
        with pytest.raises(RuntimeError, match="during backward"):
            eng(x, y)  # a window was stepped: the engine says it is no longer usable
        eng.close()
    finally:
        signal.signal(signal.SIGUSR1, old)
