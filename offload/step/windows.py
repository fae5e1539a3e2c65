"""The optimizer step over windows (one chunk of a unit's states each), pipelined.

A WindowPipeline steps windows in the order the caller gives units (all of them after backward, or one
unit at a time during backward as its gradient becomes final) with up to READ_AHEAD windows read ahead
and one written behind (landed before another read starts): the pool's optimizer share is READ_AHEAD + 1
windows' chunks at any model size (offload.plan.memory). Two windows ahead keep a read queued while the previous
window's writes land, so the drive does not idle between them; one window's writes are landed before the
next read starts, which bounds the pool (the measurements behind both choices: bench/RESULTS.md, "writes in
flight"). A window's step reads load -> adam -> commit -> store: its states in dram, CPU Adam writing the
new weights straight into the weight tier's buffer, that buffer committed, the states written back. With swap
checksums, the one integrity step around Adam is a WindowCheck.
"""

from __future__ import annotations

import collections
import functools
import time

import torch
from torch.profiler import record_function

from offload.kernels import adam8, split
from offload.kernels.cpu_adam import StepDigests, adam_step, kernel_backend
from offload.kernels.quant8 import BLOCK
from offload.plan.memory import OPTIMIZER_READ_AHEAD as READ_AHEAD
from offload.plan.units import Unit
from offload.state import moments
from offload.state.optim import KINDS, OptimState
from offload.state.runtime import Runtime
from offload.swap.integrity import digest_bounds, tensor_digests


class WindowPipeline:
    """Steps units' windows with READ_AHEAD windows read ahead (if `read_ahead`) and one written behind.

    order: the unit indices in the order they are expected; a unit stepped out of that order is loaded
    when its turn comes (the read-ahead slots stay with the windows they hold, so the pool bound holds).
    kinds: what a window's read loads (STATES when the gradient comes from the backward itself).
    states, weights: the units' optimizer states and weight handles (by unit index); rt: the runtime."""

    def __init__(self, states: list, weights: list, rt: Runtime, order: list[int], args: dict, kinds=KINDS,
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
            self._read_ahead((first, states[first].mine[0]))

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
        self._drop_weights_ahead()
        for st in self.states:
            for i in range(len(st.chunks) if st is not None else 0):
                st.discard(i)

    def _step_unit(self, unit: Unit) -> None:
        st = self.states[unit.index]
        gate = self.rt.before_update  # a background checkpoint still writing this unit's states
        if gate is not None:
            gate(unit.index)
        for i in st.mine:  # every window, or over ranks the ones this rank owns ([Note: windows over ranks])
            self._load((unit.index, i))
            self.started = True
            step_window(self.rt, st, self.weights[unit.index], unit, i, **self.args)  # adam -> commit -> store
            self.last = (unit.index, i)
        st.count_steps()
        self.done.add(unit.index)

    def finish(self) -> None:
        self._land_last()
        self._drop_weights_ahead()  # none normally: every unit read ahead was stepped

    def _drop_weights_ahead(self) -> None:
        for index in self.order:
            self.weights[index].writer.drop_ahead()

    def _load(self, item: tuple[int, int]) -> None:
        """Window `item` (unit index, window) in dram, read now unless it was read ahead; the window written
        behind has landed and the next ones are read ahead."""
        st, i = self.states[item[0]], item[1]
        if item in self.ahead:  # the first, unless units come out of order
            self.ahead.remove(item)
        if not st.loaded(i):
            self._land_last()       # its chunks return before this window takes new ones
            st.load(i, self.kinds)
        st.wait_loaded(i)
        self._land_last()
        self._fill(item)

    def _fill(self, current: tuple[int, int]) -> None:
        """Reads ahead the windows after `current` (or after the last one read ahead) up to the depth."""
        while len(self.ahead) < self.depth:
            nxt = self._next(*(self.ahead[-1] if self.ahead else current), current[0])
            if nxt is None:
                return
            self._read_ahead(nxt)

    def _next(self, index: int, i: int, stepping: int) -> tuple[int, int] | None:
        mine = self.states[index].mine
        k = mine.index(i)
        if k + 1 < len(mine):
            return index, mine[k + 1]
        after = self.order[self.order.index(index) + 1:] if index in self.order and index != stepping else self.order
        nxt = next((u for u in after if u not in self.done and u != stepping and u != index and self.states[u].mine), None)
        return None if nxt is None else (nxt, self.states[nxt].mine[0])

    def _read_ahead(self, item: tuple[int, int]) -> None:
        """Starts reading window `item`'s states, and where the step needs its nvme weights as they are (a
        split master's, or frozen weights sharing the chunk), those ([Note: updates beside residency])."""
        self.ahead.append(item)
        st, i = self.states[item[0]], item[1]
        st.load(i, self.kinds)
        if st.home == "nvme" or st.split:  # the plan's read-ahead windows hold a new-weights chunk each (plan.memory)
            self.weights[item[0]].writer.read_ahead(i, st.chunks[i][1], current=st.split)

    def _land_last(self) -> None:
        if self.last is not None:
            index, i = self.last
            self.last = None
            self.states[index].wait_stored(i)
            self.weights[index].writer.wait_for_write()


def step_window(rt: Runtime, st: OptimState, w, unit: Unit, i: int, lr: float, grad_scale: float) -> None:
    """Window i of one unit's states `st`, loaded: adam -> commit -> store. CPU Adam writes the new weights
    into the weight tier's buffer (handle `w`), which is committed; the states are written back (behind)."""
    b, e = st.chunks[i]
    home = w.writer.new_weights(i, b, e, current=st.split)  # a split master is joined with the weights
    live = w.home == "dram" or (w.home == "hbm" and w.hbm.device.type == "cpu")  # written in place
    check = WindowCheck(st, i)
    try:
        _adam(rt, st, unit, i, check.output(home[:e - b], live), check, lr, grad_scale, home[:e - b])
    except BaseException:
        w.writer.discard(home)
        raise
    finally:
        check.close()
    w.writer.commit(i, b, e, home)
    st.store(i)


def _adam(rt: Runtime, st: OptimState, unit: Unit, i: int, out: torch.Tensor, check: WindowCheck, lr: float,
          grad_scale: float, current: torch.Tensor) -> None:
    """CPU Adam over window i, the new weights into `out`, checked (a corrupted read raises before anything
    computed from it is kept), then kept in the weight tier's buffer. `current`: the window's weights before
    the step (a split master's high halves)."""
    t0 = time.perf_counter()
    with record_function("offload::cpu_adam"):
        digests = (_split_runs(rt, st, i, out, check, lr, grad_scale, current) if st.split else
                   _adam_runs(rt, st, i, out, check, lr, grad_scale))
    rt.telemetry.span("cpu_adam", f"adam {unit.name}#{i}", t0, time.perf_counter())
    check.verify(digests)
    if rt.dtype == torch.float32:
        out.copy_(st.view(i)["master"])
    check.keep()


def _split_runs(rt: Runtime, st: OptimState, i: int, out: torch.Tensor, check: WindowCheck, lr: float,
                grad_scale: float, current: torch.Tensor) -> StepDigests | None:
    """_adam_runs with a split master ([Note: split master] in offload/kernels/split.py): the window's fp32
    master joined from `current` and its record into a pool chunk, stepped, its record written back (by the
    compiled step chunk by chunk in its pass where the window is one run, else around it); the digests (with
    swap checksums) are the stored states', hashed beside the step."""
    t, n, runs = st.view(i), current.numel(), st.runs(i)
    before = check.hash() if check.bounds is not None else None
    master = rt.staging.acquire(n, torch.float32, f"{st.unit.name} master")
    try:
        if len(runs) == 1 and runs[0][:2] == (0, n) and kernel_backend() == "compiled" and current.device.type == "cpu":
            _adam_runs(rt, st, i, out, check, lr, grad_scale, {**t, "master": master},
                       (current, *split.parts(t["master"], n)))
        else:
            split.join(current, t["master"], master)
            _adam_runs(rt, st, i, out, check, lr, grad_scale, {**t, "master": master})
            split.split_(master, t["master"])
    finally:
        rt.staging.release(master)
    return None if before is None else StepDigests(before, check.hash())


def _fused(parts: tuple | None, b: int, e: int) -> dict:
    """The split= argument of a step over elements [b, e) of a window whose split master is joined in the pass."""
    return {} if parts is None else {"split": (parts[0][b:e], parts[1][b:e], parts[2][b // 8:e // 8])}


def _adam_runs(rt: Runtime, st: OptimState, i: int, out: torch.Tensor, check: WindowCheck, lr: float,
               grad_scale: float, joined: dict | None = None, parts: tuple | None = None) -> StepDigests | None:
    """The update of window i's slots that had a gradient ([Note: parameters without a gradient]),
    bf16/fp16 weights into `out`; with swap checksums, the states' digests before and after: hashed by
    the step itself in the common case of one run over the window, beside it otherwise. joined: the states
    with a split master's fp32 master (whose caller hashes them); parts: its (weights, low halves, tie bits)
    where the kernel joins and splits it in the pass (one run over the window)."""
    o, t = rt.settings.optimizer, st.view(i) if joined is None else joined
    bounds = check.bounds if joined is None else None
    lowp = rt.dtype != torch.float32
    step_fn = adam_step if t["master"].device.type == "cpu" else _device_adam_step
    grad = st.grad(i)

    def adam(b: int, e: int, step: int, m=None, v=None, **digests):
        m = t["exp_avg"][b:e] if m is None else m
        v = t["exp_avg_sq"][b:e] if v is None else v
        return step_fn(t["master"][b:e], grad[b:e], m, v, step=step, lr=lr,
                       beta1=o.betas[0], beta2=o.betas[1], eps=o.eps, weight_decay=o.weight_decay,
                       adamw=o.type == "adamw", grad_scale=grad_scale, out=out[b:e] if lowp else None, **digests,
                       **_fused(parts, b, e))

    runs, n = st.runs(i), t["master"].numel()
    if st.int8:
        return _adam8_runs(st, i, t, grad, out if lowp else None, check if bounds is not None else None, runs, adam, lr,
                           grad_scale, parts)
    if len(runs) == 1 and runs[0][:2] == (0, n):
        return adam(*runs[0], **({} if bounds is None else {"digest_bounds": bounds}))
    before = None if bounds is None else check.hash()
    if lowp:
        out.copy_(t["master"])  # skipped slots keep their weights
    for run in runs:
        adam(*run)
    return None if before is None else StepDigests(before, check.hash())


def _adam8_runs(st: OptimState, i: int, t: dict, grad: torch.Tensor, out, check: WindowCheck | None, runs, adam,
                lr: float, grad_scale: float, parts: tuple | None) -> StepDigests | None:
    """Window i with int8 moments ([Note: int8 optimizer states]): each run's 8-bit blocks through the int8
    step over their codes and scales, its small parameters' elements through the fp32 step over their small_m
    and small_v; digests (`check`: with swap checksums) hashed beside the step."""
    o, n = st.rt.settings.optimizer, t["master"].numel()
    before = check.hash() if check is not None else None
    if out is not None and not (len(runs) == 1 and runs[0][:2] == (0, n)):
        out.copy_(t["master"])  # skipped slots keep their weights
    nb = n // BLOCK
    for b, e, step in runs:
        for lo, hi, side in moments.segments(st.small[i], b, e):
            if side is not None:  # fp32 moments of small parameters
                adam(lo, hi, step, m=t["small_m"][side:side + hi - lo], v=t["small_v"][side:side + hi - lo])
                continue
            bl, bh = lo // BLOCK, hi // BLOCK
            adam8.adam8_step(t["master"][lo:hi], grad[lo:hi], t["exp_avg"][lo:hi], t["absmax"][bl:bh],
                             t["exp_avg_sq"][lo:hi], t["absmax"][nb + bl:nb + bh], step=step, lr=lr, beta1=o.betas[0],
                             beta2=o.betas[1], eps=o.eps, weight_decay=o.weight_decay, adamw=o.type == "adamw",
                             grad_scale=grad_scale, out=None if out is None else out[lo:hi], **_fused(parts, lo, hi))
    return None if before is None else StepDigests(before, check.hash())


class WindowCheck:
    """The swap-integrity step around CPU Adam for window i of `st` ([Note: swap digests in the step] in
    offload/kernels/csrc/cpu_adam.cpp), and nothing where the states are not hashed (OptimState.hashed: nvme
    states with swap checksums, read unverified). It plans the spans the step hashes (`bounds`), hashes the
    states where the step cannot (`hash`), checks what was read against what was written and hands the
    updated states' digests to their write-back (`verify`). Until then the new weights stay out of a live
    copy (a dram or CPU hbm home): `output` lends a pool chunk in its place, `keep` copies it home."""

    def __init__(self, st: OptimState, i: int):
        b, e = st.chunks[i]
        self.st, self.i = st, i
        self.bounds = _digest_bounds(e - b, 4, st.rt.store.block_bytes) if st.hashed else None  # fp32 states'
        self.kinds = [k for k in st.layout(i) if k != "grad"]
        self._home = self._scratch = None

    def output(self, home: torch.Tensor, live: bool) -> torch.Tensor:
        """Where Adam writes the window's new weights: `home` (the weight tier's buffer), or while the
        states are unchecked and `home` is live, a pool chunk (close() returns it)."""
        if self.bounds is None or not live:
            return home
        self._home = home
        self._scratch = self.st.rt.staging.acquire(home.numel(), home.dtype, f"{self.st.unit.name} new weights")
        return self._scratch

    def hash(self) -> tuple[tuple[int, ...], ...]:
        """Swap digests of the window's staged states, one tuple a kind (when the step cannot hash them)."""
        t, block = self.st.view(self.i), self.st.rt.store.block_bytes
        return tuple(tensor_digests(t[k], _digest_bounds(t[k].numel(), t[k].element_size(), block)) for k in self.kinds)

    def verify(self, digests: StepDigests | None) -> None:
        """Raises SwapCorruptionError if what was read differs from what was written; keeps the new states'
        digests for their write-back (OptimState.store)."""
        if self.bounds is None:
            return
        st, staged = self.st, self.st.staged(self.i)
        for kind, before in zip(self.kinds, digests.before):
            if kind in staged.unverified:
                st.rt.store.check_digests(st.key(kind, self.i), before)
        staged.checked(dict(zip(self.kinds, digests.after)))

    def keep(self) -> None:
        """The checked new weights into the live home."""
        if self._scratch is not None:
            self._home.copy_(self._scratch)

    def close(self) -> None:
        if self._scratch is not None:
            self.st.rt.staging.release(self._scratch)
            self._scratch = None


@functools.lru_cache(maxsize=64)
def _digest_bounds(numel: int, itemsize: int, block_bytes: int) -> tuple[int, ...]:
    """Element bounds of the swap digests of a window's state (`itemsize`-byte elements, a store of
    `block_bytes` blocks)."""
    return tuple(digest_bounds(numel, itemsize, block_bytes))


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
