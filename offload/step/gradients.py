"""The gradient path: from autograd's accumulation to the units' accumulators in their state tier.

[Note: the gradient path]
Each trainable parameter's post-accumulate hook hands its final gradient to its unit; when the unit has all
of them (or backward ends: `flush_rest`), `flush` moves them hbm -> the unit's accumulator on the d2h
thread as one job (the accumulator and, over ranks, its reduce-scatter: offload.step.accumulator), which
also runs the optimizer's work the step mode puts beside it ([Note: step modes] in
offload.plan.modes): the delayed update before the accumulation, the overlapped step after it. The gradients
stay charged to hbm until their job consumed them; `make_room` is the one place that waits for jobs to
free hbm: before a gradient job (within the planned reserve) and before a fetch (offload.step.prefetch).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from offload.plan.modes import StepMode
from offload.plan.units import Unit
from offload.state.runtime import Runtime
from offload.step import accumulator


@dataclass(frozen=True)
class Backward:
    """What one backward's gradient jobs need to know: its mode, whether it is the first / last micro-step of
    its accumulation window, and the window pipeline that steps units beside the jobs (OVERLAPPED, SPLIT:
    this step; DELAYED: the previous one's update), else None."""
    mode: StepMode
    first: bool
    last: bool
    pipe: object = None


class GradientPath:
    def __init__(self, rt: Runtime, units: list[Unit], states: list):
        self.rt, self.units, self.states = rt, units, states
        self.hbm = rt.tiers.acct["hbm"]
        self.reserve = rt.settings.grad_reserve
        self.backward: Backward | None = None       # the backward running, set by begin()
        self.grad_sq: dict[int, float] = {}         # unit index -> its gradient's squared norm (the step's norm)
        self.touched: set[int] = set()              # units whose accumulator this micro-step changed
        self._waiting = {u.index: [] for u in units}  # a unit's parameters whose gradient is final
        self._flushed: set[int] = set()
        self._jobs: list[tuple] = []                # (completion, hbm bytes) of gradient jobs in flight

    def begin(self, backward: Backward) -> None:
        self.backward, self._flushed, self.touched = backward, set(), set()

    def hook(self, unit: Unit):
        """The post-accumulate-grad hook of each of `unit`'s trainable parameters."""
        n_trainable = sum(s.trainable for s in unit.slots)

        def hook(param: torch.Tensor) -> None:
            waiting = self._waiting[unit.index]
            waiting.append(param)
            if len(waiting) == n_trainable:
                self.flush(unit)

        return hook

    def flush_rest(self) -> None:
        """At the end of backward: units with parameters that got no gradient flush what they have."""
        for u in self.units:
            if u.trainable_numel and u.index not in self._flushed:
                self.flush(u)

    def flush(self, unit: Unit) -> None:
        """Hands this unit's final gradients of the micro-step to the d2h thread (module note)."""
        params, self._waiting[unit.index] = self._waiting[unit.index], []
        self._flushed.add(unit.index)
        offsets = {s.param: s.offset for s in unit.slots}
        grads = [(offsets[p], p.grad.reshape(-1)) for p in params if p.grad is not None]
        for p in params:
            p.grad = None
        nbytes = sum(g.numel() * g.element_size() for _, g in grads)
        self.make_room(nbytes, gradients=True)
        self.hbm.charge(nbytes, f"{unit.name} gradients")  # they exist in hbm until the d2h job consumed them
        try:
            done = self.rt.d2h.submit(self._job, unit, grads, nbytes, self.backward, tensors=[g for _, g in grads])
        except BaseException:  # not queued (a closed or dead thread): the job's own refund will not run
            self.hbm.refund(nbytes)
            raise
        self._jobs.append((done, nbytes))

    def _job(self, unit: Unit, grads: list, nbytes: int, bw: Backward) -> None:
        """On the d2h thread: the delayed update, the accumulation, the overlapped step (module note)."""
        try:
            if bw.mode is StepMode.DELAYED:  # the previous update, before the accumulator takes this gradient
                bw.pipe.step_unit(unit)
            t0 = time.perf_counter()
            if self.rt.world > 1 and not self.rt.sharded:  # sharded: reduced by window (offload.step.accumulator)
                average_over_ranks(grads, self.rt)
            if not bw.first:
                self.touched.add(unit.index)  # holds earlier micro-steps' gradients: changed from here
            deferred = bw.mode is StepMode.SPLIT and unit.index in self.rt.settings.deferred
            sq = accumulator.accumulate(self.states[unit.index], grads, bw.first, bw.last,
                                        keep=bw.mode.overlapped and not deferred, deferred=deferred)
            self.rt.telemetry.link("hbm_to_dram", nbytes, time.perf_counter() - t0)
            if sq is not None:
                self.grad_sq[unit.index] = sq
            if bw.mode.overlapped:
                if not math.isfinite(sq):
                    raise FloatingPointError(f"{unit.name}: gradients are not finite ({self.rt.settings.precision}); "
                                             "lower the learning rate or enable gradient_clipping")
                if not deferred:
                    bw.pipe.step_unit(unit)  # nvme states read the gradient from `grads` window by window
        finally:
            grads.clear()
            self.hbm.refund(nbytes)

    def make_room(self, nbytes: int, gradients: bool = False) -> bool:
        """Waits for the oldest gradient jobs until `nbytes` fit the hbm budget (gradients: also within the
        planned reserve for gradients in flight). Returns whether they fit."""
        while not self.hbm.fits(nbytes) or (gradients and sum(n for _, n in self._jobs) + nbytes > self.reserve):
            if not self._jobs:
                break
            self._wait_oldest()
        return self.hbm.fits(nbytes)

    def wait_all(self) -> None:
        while self._jobs:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        """The oldest job leaves the list once finished: if the wait is interrupted (a signal's Stopped),
        settle() still waits for it before the failure handling touches what it uses."""
        self._jobs[0][0].wait()
        self._jobs.pop(0)

    def settle(self) -> None:
        """After a failure: every job in flight finished (each refunds its hbm charge), errors ignored."""
        for done, _ in self._jobs:
            settle(done)
        self._jobs = []

    def drop(self) -> None:
        """After a failed backward: the micro-step's gradients, wherever they are, are gone."""
        self.settle()
        for u in self.units:  # gradients autograd produced and no job took
            self._waiting[u.index] = []
            for s in u.slots:
                s.param.grad = None
        for st in self.states:
            if st is not None:
                st.drop_gradients()
        self.grad_sq.clear()


def settle(done) -> None:
    try:
        done.wait()
    except Exception:  # reported by whoever waited first (an interrupt is not held back)
        pass


def average_over_ranks(grads: list, rt: Runtime) -> None:
    """zero_stage 0 over several ranks (data parallel): each gradient becomes the mean over the ranks, in
    place, before it enters the accumulator, so every rank holds the same accumulators, takes the same
    global decisions (norm, clipping, fp16 overflow) and applies the same update, as DDP does. Summed in
    fp32 and divided (gloo's AVG and its bf16 sums are missing or slow in some torch versions), one
    parameter at a time: the fp32 copy of a low-precision gradient is at most the largest parameter, charged
    to hbm while it exists (the placement plans it). Runs on the d2h thread, in the same unit order on
    every rank, which keeps the collectives matched."""
    import torch.distributed as dist

    t0, nbytes, hbm = time.perf_counter(), 0, rt.tiers.acct["hbm"]
    for _, g in grads:
        copy = g.dtype != torch.float32
        if copy:
            hbm.charge(g.numel() * 4, "gradient all-reduce buffer")
        try:
            buf = g.float() if copy else g
            rt.ranks.run("all_reduce", "a gradient", lambda: dist.all_reduce(buf, group=rt.ranks.grad))
            buf.div_(rt.world)
            if copy:
                g.copy_(buf)
        finally:
            if copy:
                hbm.refund(g.numel() * 4)
        nbytes += g.numel() * 4
    rt.telemetry.collective("all_reduce", nbytes, time.perf_counter() - t0)
