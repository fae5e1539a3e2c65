"""One pipeline structure on every backend ([Note: one copy stream per direction] in scheduler.streams):
the gradient accumulation, and the optimizer step when it overlaps backward, run on the d2h worker
thread, never on the thread that runs forward and backward. Runs on the device the engine picks (the
CPU here; CUDA where one is visible), so the same assertion covers both."""

import threading

import pytest
import torch

import offload
import offload.optim as optim
import offload.windows as step
from tests.engine_util import MLP, mlp_batches


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("place", ["cpu", "nvme"])
def test_accumulation_and_overlapped_step_run_on_the_d2h_worker(tmp_path, monkeypatch, place, overlap):
    where: dict[str, set[str]] = {"accumulate": set(), "step_window": set()}
    real_acc, real_step = optim.OptimState.accumulate, step.step_window

    def accumulate(self, *a, **kw):
        where["accumulate"].add(threading.current_thread().name)
        return real_acc(self, *a, **kw)

    def step_window(*a, **kw):
        where["step_window"].add(threading.current_thread().name)
        return real_step(*a, **kw)

    monkeypatch.setattr(optim.OptimState, "accumulate", accumulate)
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
