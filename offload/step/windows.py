"""The optimizer step over windows (one chunk of a unit's states each), pipelined.

A WindowPipeline steps windows in the order the caller gives units (all of them after backward, or one
unit at a time during backward as its gradient becomes final) with up to READ_AHEAD windows read ahead
and one written behind (landed before another read starts): the pool's optimizer share is READ_AHEAD + 1
windows' chunks at any model size (offload.plan.memory). Two windows ahead keep a read queued while the previous
window's writes land, so the drive does not idle between them; one window's writes are landed before the
next read starts, which bounds the pool (the measurements behind both choices: bench/RESULTS.md, "writes in
flight"). CPU Adam writes each window's new weights straight into the weight tier's buffer.
"""

from __future__ import annotations

import collections
import time

import torch
from torch.profiler import record_function

from offload.kernels.cpu_adam import StepDigests, adam_step
from offload.plan.memory import OPTIMIZER_READ_AHEAD as READ_AHEAD
from offload.state.optim import KINDS, OptimState
from offload.plan.units import Unit


class WindowPipeline:
    """Steps units' windows with READ_AHEAD windows read ahead (if `read_ahead`) and one written behind.

    order: the unit indices in the order they are expected; a unit stepped out of that order is loaded
    when its turn comes (the read-ahead slots stay with the windows they hold, so the pool bound holds).
    kinds: what a window's read loads (STATES when the gradient comes from the backward itself).
    states, weights: the units' optimizer states and weight handles (by unit index); rt: the runtime."""

    def __init__(self, states: list, weights: list, rt, order: list[int], args: dict, kinds=KINDS,
                 read_ahead: bool = True):
        self.states, self.weights, self.rt = states, weights, rt
        self.order, self.args, self.kinds = order, args, kinds
        self.depth = READ_AHEAD if read_ahead else 0
        self.done: set[int] = set()
        self.failed = False
        self.started = False  # a window's update began: states or weights may differ from before
        self.ahead: collections.deque[tuple[int, int]] = collections.deque()  # (unit index, window) read ahead, in order
        self.last: tuple[int, int] | None = None    # the window written behind
        first = next((u for u in order if states[u].mine), None)
        if self.depth and first is not None:
            self._load((first, states[first].mine[0]))

    def step_unit(self, unit: Unit) -> None:
        if self.failed:
            raise RuntimeError(f"{unit.name}: not stepped, an earlier window's step failed in this step")
        try:
            self._step_unit(unit)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """After a failure (here or elsewhere in the step): every chunk a window, the read-ahead and the
        write-behind hold goes back to the pool, its I/O settled (a failed window's homes were not
        written: see step_window), and no later unit is stepped. Idempotent."""
        self.failed = True
        self.ahead.clear()
        try:
            self._land_last()
        except Exception:  # the first error is the one reported (an interrupt is not held back)
            pass
        for st in self.states:
            for i in range(len(st.windows) if st is not None else 0):
                st.discard(i)

    def _step_unit(self, unit: Unit) -> None:
        st = self.states[unit.index]
        for i in st.mine:  # every window, or over ranks the ones this rank owns ([Note: windows over ranks])
            item = (unit.index, i)
            if item in self.ahead:  # the first, unless units come out of order
                self.ahead.remove(item)
            if not st.loaded(i):
                self._land_last()       # its chunks return before this window takes new ones
                st.load(i, self.kinds)
            st.wait_loaded(i)
            self._land_last()
            self._fill(item)
            self.started = True
            step_window(self.rt, self.states[unit.index], self.weights[unit.index], unit, i, **self.args)
            self.last = item
        st.count_steps()
        self.done.add(unit.index)

    def finish(self) -> None:
        self._land_last()

    def _fill(self, current: tuple[int, int]) -> None:
        """Reads ahead the windows after `current` (or after the last one read ahead) up to the depth."""
        while len(self.ahead) < self.depth:
            nxt = self._next(*(self.ahead[-1] if self.ahead else current), current[0])
            if nxt is None:
                return
            self._load(nxt)

    def _next(self, index: int, i: int, stepping: int) -> tuple[int, int] | None:
        mine = self.states[index].mine
        k = mine.index(i)
        if k + 1 < len(mine):
            return index, mine[k + 1]
        after = self.order[self.order.index(index) + 1:] if index in self.order and index != stepping else self.order
        nxt = next((u for u in after if u not in self.done and u != stepping and u != index and self.states[u].mine), None)
        return None if nxt is None else (nxt, self.states[nxt].mine[0])

    def _load(self, item: tuple[int, int]) -> None:
        self.ahead.append(item)
        self.states[item[0]].load(item[1], self.kinds)

    def _land_last(self) -> None:
        if self.last is not None:
            index, i = self.last
            self.last = None
            self.states[index].wait_stored(i)
            self.weights[index].writer.wait_for_write()


def step_window(rt, st: OptimState, w, unit: Unit, i: int, lr: float, grad_scale: float) -> None:
    """CPU Adam over window i of one unit's states `st`; the new weights go straight into its weight tier
    (handle `w`)."""
    b, e = st.windows[i]
    hashed = st.digest_bounds(i) is not None  # nvme states with swap checksums, read unverified
    # Until the states are checked the new weights stay out of the live copy (a dram or CPU hbm home).
    home = w.writer.new_weights(i, b, e)
    live = w.home == "dram" or (w.home == "hbm" and w.hbm.device.type == "cpu")
    out = rt.staging.acquire(e - b, home.dtype, f"{unit.name} new weights") if hashed and live else home[:e - b]
    try:
        t0 = time.perf_counter()
        with record_function("offload::cpu_adam"):
            digests = _adam_runs(rt, st, i, out, lr, grad_scale)
        rt.telemetry.span("cpu_adam", f"adam {unit.name}#{i}", t0, time.perf_counter())
        if hashed:  # raises before anything computed from corrupted states is kept
            st.check_digests(i, digests)
        if rt.dtype == torch.float32:
            out.copy_(st.view(i)["master"])
        if hashed and live:
            home[:e - b].copy_(out)
    except BaseException:
        w.writer.discard(home)
        raise
    finally:
        if hashed and live:
            rt.staging.release(out)
    w.writer.commit(i, b, e, home)
    st.store(i)


def _adam_runs(rt, st: OptimState, i: int, out: torch.Tensor, lr: float, grad_scale: float) -> StepDigests | None:
    """The update of window i's slots that had a gradient ([Note: parameters without a gradient]),
    bf16/fp16 weights into `out`; with swap checksums, the states' digests before and after: hashed by
    the step itself in the common case of one run over the window, beside it otherwise."""
    o, t, bounds = rt.cfg.optimizer, st.view(i), st.digest_bounds(i)
    lowp = rt.dtype != torch.float32
    step_fn = adam_step if t["master"].device.type == "cpu" else _device_adam_step
    grad = st.grad(i)

    def adam(b: int, e: int, step: int, **digests):
        return step_fn(t["master"][b:e], grad[b:e], t["exp_avg"][b:e], t["exp_avg_sq"][b:e], step=step, lr=lr,
                       beta1=o.betas[0], beta2=o.betas[1], eps=o.eps, weight_decay=o.weight_decay,
                       adamw=o.type == "adamw", grad_scale=grad_scale, out=out[b:e] if lowp else None, **digests)

    runs, n = st.runs(i), t["master"].numel()
    if len(runs) == 1 and runs[0][:2] == (0, n):
        return adam(*runs[0], **({} if bounds is None else {"digest_bounds": bounds}))
    before = None if bounds is None else st.hash_states(i)
    if lowp:
        out.copy_(t["master"])  # skipped slots keep their weights
    for run in runs:
        adam(*run)
    return None if before is None else StepDigests(before, st.hash_states(i))


def _device_adam_step(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay, adamw,
                      grad_scale, out) -> None:
    """Optimizer states kept in accelerator memory (offload_optimizer none on CUDA): torch's fused op."""
    fused = torch._fused_adamw_ if adamw else torch._fused_adam_
    if grad_scale != 1.0:
        grad = grad / grad_scale
    fused([param], [grad], [exp_avg], [exp_avg_sq], [], [torch.tensor(float(step), device=param.device)],
          lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
          grad_scale=None, found_inf=None)
    if out is not None:
        out.copy_(param)
