"""Failure semantics of the step pipeline ([Note: failure semantics] in offload.step.pipeline).

An error before any state changed rolls the micro-step back: training goes on and equals, number for
number, a run that never saw that batch, with nothing leaked (hbm charges, pool chunks, threads, fds).
An error after the optimizer began updating states fails the engine: every later call raises StepFailed,
and close() still succeeds and removes the swap files."""

from __future__ import annotations

import copy
import os
import threading

import pytest
import torch

import offload
from offload.step.pipeline import EngineClosed, Phase, StepFailed
from offload.swap import SwapIOError
from tests.engine_util import MLP, Block, mlp_batches, train


class Boom(Exception):
    pass


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise Boom("in a unit's backward")


class FaultyBlock(Block):
    """A Block (one unit) that raises in its forward or its backward while `fail` says so; the backward
    between fc2 and fc1, so that part of the unit's gradients exist when it raises."""
    fail: str | None = None

    def _f(self, x):
        if self.fail == "forward":
            raise Boom("in a unit's forward")
        h = torch.relu(self.fc1(x))
        return x + self.fc2(_RaiseInBackward.apply(h) if self.fail == "backward" else h)


def faulty_mlp() -> MLP:
    torch.manual_seed(0)
    m = MLP()
    m.blocks[1].__class__ = FaultyBlock  # the same parameters and init: only the forward differs
    return m


def config(tmp_path, place: str, **extra) -> dict:
    return {"precision": "bf16", "offload_param": {"device": place}, "offload_optimizer": {"device": place},
            "nvme_path": str(tmp_path / "swap"), "units": {"min_numel": 512}, "reuse_bytes": 0,
            "optimizer": {"lr": 1e-2}, **extra}


# Threads that start when first needed and stay, at most a fixed number: the swap store's digest pool
# (a ThreadPoolExecutor spawns its second worker only when a check finds the first busy) and the hbm
# fault-in thread. One appearing during a failing micro-step is not a leak, so they are not counted.
LAZY_THREADS = ("swap-digest", "hbm-fault")


def resources(eng) -> dict:
    threads = sorted(t.name for t in threading.enumerate() if not t.name.startswith(LAZY_THREADS))
    return {"hbm": eng.tiers.acct["hbm"].used_bytes, "dram": eng.tiers.acct["dram"].used_bytes,
            "lent chunks": eng.staging.lent, "threads": threads, "fds": len(os.listdir("/proc/self/fd"))}


def swap_files(tmp_path) -> list[str]:
    root = tmp_path / "swap"
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs] if root.exists() else []


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("place", ["cpu", "nvme"])
@pytest.mark.parametrize("where,overlap", [("forward", True), ("backward", False)])
def test_an_error_before_any_state_changed_rolls_the_micro_step_back(tmp_path, place, where, overlap):
    """A unit raising in its forward, or in its backward while no unit was stepped yet (the step after
    backward): training goes on and equals a run that never saw the failing batch."""
    model, batches = faulty_mlp(), mlp_batches(4)
    cfg = config(tmp_path, place, overlap_step=overlap)
    with offload.initialize(copy.deepcopy(model), {**cfg, "nvme_path": str(tmp_path / "ref")}) as ref:
        ref_losses = train(ref, batches[:2] + batches[3:])
        ref_sd = ref.full_state_dict()
    with offload.initialize(model, cfg) as eng:
        losses = train(eng, batches[:2])
        before = resources(eng)
        model.blocks[1].fail = where
        with pytest.raises(Boom, match=f"in a unit's {where}"):
            eng.backward(eng(*batches[2]))
        model.blocks[1].fail = None
        assert eng.phase is Phase.IDLE and eng.micro_step == 0 and eng.step_count == 2
        assert resources(eng) == before
        losses += train(eng, batches[3:])
        assert losses == ref_losses
        assert _equal(eng.full_state_dict(), ref_sd)


@pytest.mark.parametrize("place", ["cpu", "nvme"])
def test_an_error_after_units_were_stepped_fails_the_engine_and_close_still_works(tmp_path, place):
    """With overlap_step the units after the failing one (in backward order) were already stepped: the
    update is half applied, so the engine refuses to go on, saying why and what to do."""
    model, batches = faulty_mlp(), mlp_batches(3)
    with offload.initialize(model, config(tmp_path, place, overlap_step=True)) as eng:
        train(eng, batches[:1])
        model.blocks[1].fail = "backward"
        with pytest.raises(Boom):
            eng.backward(eng(*batches[1]))
        assert eng.phase is Phase.FAILED
        for call in (lambda: eng(*batches[2]), lambda: eng.step(), eng.full_state_dict):
            with pytest.raises(StepFailed, match=r"step 2 \(during backward\) failed .*Boom.*close\(\) it"):
                call()
        assert eng.staging.lent == 0
    assert swap_files(tmp_path) == []
    with pytest.raises(EngineClosed, match="engine is closed"):
        eng(*batches[2])


class FailingWrites:
    """Every write of a SwapStore raises once armed (as a full disk or a dying drive would): its `write`
    replaced on the instance, so every part holding the store sees it; restore() puts it back."""

    def __init__(self, store):
        self.store, self.armed, self._write = store, False, store.write
        store.write = self.write

    def write(self, *a, **kw):
        if self.armed:
            raise SwapIOError(28, "injected write failure", path="swap.data", offset=0, nbytes=4096)
        return self._write(*a, **kw)

    def restore(self) -> None:
        del self.store.write


@pytest.mark.parametrize("overlap", [False, True])
def test_a_swap_error_mid_backward(tmp_path, overlap):
    """nvme states: without overlap_step the backward writes only the gradient accumulator (overwritten
    by the next first micro-step): rolled back, training goes on exactly. With it, the failing writes
    are the step's: the engine fails; close() removes the swap files either way."""
    model, batches = faulty_mlp(), mlp_batches(4)
    cfg = config(tmp_path, "nvme", overlap_step=overlap)
    eng = offload.initialize(model, cfg)
    try:
        losses = train(eng, batches[:2])
        for handle in eng.weights + eng.states:  # the handles read the store through the runtime
            assert handle is None or handle.rt is eng.rt
        before = resources(eng)
        failing = FailingWrites(eng.rt.store)
        failing.armed = True
        with pytest.raises(SwapIOError, match="injected"):
            eng.backward(eng(*batches[2]))
        failing.armed = False
        failing.restore()
        if overlap:
            assert eng.phase is Phase.FAILED
            with pytest.raises(StepFailed, match="SwapIOError"):
                eng(*batches[3])
        else:
            assert eng.phase is Phase.IDLE and resources(eng) == before
            losses += train(eng, batches[3:])
            with offload.initialize(faulty_mlp(), {**cfg, "nvme_path": str(tmp_path / "ref")}) as ref:
                assert losses == train(ref, batches[:2] + batches[3:])
                assert _equal(eng.full_state_dict(), ref.full_state_dict())
    finally:
        eng.close()
    assert swap_files(tmp_path) == []


def test_a_deferred_step_that_fails_fails_the_engine_in_the_forward_that_waited(tmp_path):
    """[Note: split step] nvme states: every other unit's step runs at the next forward, before its fetch. A
    swap write failing there leaves states partly updated: that forward raises the error, every later call
    StepFailed naming the deferred step; close() still removes the swap files."""
    model, batches = faulty_mlp(), mlp_batches(3)
    eng = offload.initialize(model, config(tmp_path, "nvme", split_step=0.5))
    try:
        train(eng, batches[:1])
        assert eng.placement.deferred
        failing = FailingWrites(eng.rt.store)
        failing.armed = True
        with pytest.raises(SwapIOError, match="injected"):
            eng(*batches[1])
        failing.armed = False
        failing.restore()
        assert eng.phase is Phase.FAILED and eng.staging.lent == 0
        for call in (lambda: eng(*batches[2]), eng.full_state_dict, lambda: eng.save_checkpoint(str(tmp_path / "c"))):
            with pytest.raises(StepFailed, match=r"applied at the next fetch \(split_step\) failed .*SwapIOError"):
                call()
    finally:
        eng.close()
    assert swap_files(tmp_path) == []


def test_a_failed_step_after_backward_fails_the_engine(tmp_path, monkeypatch):
    """An error in step() once the first window began updating: failed, with the step named."""
    import offload.step.windows as step_mod

    model, batches = faulty_mlp(), mlp_batches(2)
    with offload.initialize(model, config(tmp_path, "cpu", overlap_step=False)) as eng:
        train(eng, batches[:1])
        eng.backward(eng(*batches[1]))
        calls = []
        real = step_mod.step_window

        def second_window_fails(*a, **kw):
            calls.append(1)
            if len(calls) == 2:
                raise Boom("in the step")
            return real(*a, **kw)

        monkeypatch.setattr(step_mod, "step_window", second_window_fails)
        with pytest.raises(Boom):
            eng.step()
        assert eng.phase is Phase.FAILED and eng.staging.lent == 0
        with pytest.raises(StepFailed, match="step 2 failed"):
            eng.backward(eng(*batches[1]))


def test_a_step_that_fails_before_changing_anything_can_be_retried(tmp_path, monkeypatch):
    import offload.step.windows as step_mod

    model, batches = faulty_mlp(), mlp_batches(2)
    with offload.initialize(copy.deepcopy(model), config(tmp_path, "cpu", overlap_step=False)) as ref:
        ref_losses, ref_sd = train(ref, batches), ref.full_state_dict()
    with offload.initialize(model, config(tmp_path, "cpu", overlap_step=False)) as eng:
        train(eng, batches[:1])
        loss = eng(*batches[1])
        eng.backward(loss)
        real = step_mod.step_window
        monkeypatch.setattr(step_mod.WindowPipeline, "_step_unit", lambda self, unit: (_ for _ in ()).throw(Boom("x")))
        with pytest.raises(Boom):
            eng.step()
        monkeypatch.undo()
        assert step_mod.step_window is real and eng.phase is Phase.IDLE
        assert eng.step() is True
        assert [ref_losses[0], loss.item()] == ref_losses and _equal(eng.full_state_dict(), ref_sd)


@pytest.mark.parametrize("place", ["cpu", "nvme"])
def test_gradient_accumulation_first_micro_step_rolls_back_a_later_one_fails(tmp_path, place):
    """With 2 micro-steps per step: an error in the first one's backward rolls back (the accumulators are
    overwritten by the next first micro-step); in the second, the accumulators already held the first
    one's gradients and some were added to: the engine fails rather than step on a partial sum."""
    model, batches = faulty_mlp(), mlp_batches(6)
    cfg = config(tmp_path, place, gradient_accumulation_steps=2)
    with offload.initialize(copy.deepcopy(model), {**cfg, "nvme_path": str(tmp_path / "ref")}) as ref:
        ref_losses, ref_sd = train(ref, batches[:2] + batches[3:5]), ref.full_state_dict()
    with offload.initialize(model, cfg) as eng:
        losses = train(eng, batches[:2])
        model.blocks[1].fail = "backward"
        with pytest.raises(Boom):
            eng.backward(eng(*batches[2]))  # the first micro-step of step 2
        model.blocks[1].fail = None
        assert eng.phase is Phase.IDLE and eng.micro_step == 0
        losses += train(eng, batches[3:5])
        assert losses == ref_losses and _equal(eng.full_state_dict(), ref_sd)
        eng.backward(eng(*batches[5]))
        model.blocks[1].fail = "backward"
        with pytest.raises(Boom):
            eng.backward(eng(*batches[5]))  # the second micro-step of step 3
        assert eng.phase is Phase.FAILED
        with pytest.raises(StepFailed, match="step 3"):
            eng.step()


def test_an_interrupt_between_freeing_a_fetched_copy_and_its_transition_is_not_refunded_twice(tmp_path, monkeypatch):
    """An interrupt (Ctrl-C, or the Stopped a SIGTERM raises) lands anywhere on the compute thread: here after
    release() emptied a fetched copy and refunded it, before the state's transition. The failure path's
    reset() releases it again: the copy is refunded once and the weights are at home."""
    from offload.state.residency import HOME_STATE

    with offload.initialize(faulty_mlp(), config(tmp_path, "cpu")) as eng:
        hbm = eng.tiers.acct["hbm"]
        w = next(w for w in eng.weights if w is not None and w.home != "hbm")
        before = hbm.used_bytes
        w.fetch()
        w.wait_for_fetch()
        assert hbm.used_bytes == before + w.nbytes
        real = w._set

        def interrupted(target, expect):
            monkeypatch.setattr(w, "_set", real)
            raise KeyboardInterrupt

        monkeypatch.setattr(w, "_set", interrupted)
        with pytest.raises(KeyboardInterrupt):
            w.release()
        w.reset()
        assert w.state is HOME_STATE[w.home] and hbm.used_bytes == before
