"""The step pipeline: a training step's control flow as one phase machine."""

from __future__ import annotations

import enum
import math
import time

import torch
from torch.profiler import record_function

from offload.plan.modes import StepMode, step_mode
from offload.plan.units import Unit
from offload.scheduler.telemetry import overlap_fraction
from offload.scheduler.trace import CyclicTrace
from offload.state.optim import KINDS, STATES
from offload.state.runtime import Runtime
from offload.step.gradients import Backward, GradientPath, settle
from offload.step.prefetch import Prefetcher
from offload.step.scale import LossScale, lr_factor
from offload.step.windows import WindowPipeline

# [Note: phases]
#     idle -> forward -> backward -> idle          one micro-step (gradients leave hbm as they become final)
#     idle -> stepping -> idle                     step() at the accumulation boundary
#     forward -> forward                           several forwards before a backward (evaluation, or losses
#                                                  summed over two forwards)
#     idle -> forward -> idle                      a model with nothing trainable (a frozen reference model):
#                                                  no backward follows, the forward is the whole step (end_forward)
#     any -> failed                                an error after the optimizer began changing states
#     any -> closed
# The pipeline owns what one step holds in flight: the gradient jobs on the d2h thread, each unit's
# gradients waiting for the rest of the unit, the optimizer's window pipeline (read-ahead, write-behind)
# and the delayed update, so that a failure is handled in one place.
#
# [Note: failure semantics]
# An error before any state changed (in forward; in backward before a unit was stepped, and, with
# gradient accumulation, in the first micro-step of a window) rolls the micro-step back: its partial
# gradients are dropped, every gradient job is settled (each refunds its hbm charge), the optimizer's
# read-ahead returns its chunks, fetched weights are released, and the engine is as before that micro-step,
# so training can go on (it equals a run that never saw that batch). An error after the optimizer began
# updating states (a step in step() or during backward, the delayed update, or an accumulator that held
# earlier micro-steps' gradients) leaves weights and states partly updated: the pipeline enters `failed`,
# and every further forward, backward, step or state read raises StepFailed naming the step and the cause;
# close() still works and removes the swap files.
#
# [Note: split step]
# With the overlapped step and optimizer states on nvme, all of a step's state I/O (read 12 B, write 14 B
# per parameter) would fall in the backward, beside its compute, while the forward reads only the weights:
# where both phases are busy the step takes the forward's compute plus the backward's I/O. With split_step
# (a fraction, default 0.25) the placement defers that share of the fetched units, spread evenly over the
# forward order (placement.deferred): in backward such a unit's gradient goes to its nvme accumulator in the
# compute dtype (2 B write) and its step waits (StepMode.SPLIT, offload.plan.modes); at the next forward's first
# fetch (Prefetcher.before_fetch), every deferred unit's step is queued on the d2h thread in forward order
# (a window pipeline of its own), and each unit's fetch waits for its own step (WeightHandle.update) on the
# reader thread, so the steps run ahead of the forward's compute. It is the same update (the same gradient, lr and scale) applied before the unit's next use, so
# the numbers are those of the step in backward (the parity tests compare them bit for bit). Whatever
# reads or saves states (full_state_dict, state_dict, checkpoints, flush, close) applies the waiting steps
# first (DeferredSteps.finish); a failed deferred step fails the engine as a failed step does.


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"
    STEPPING = "stepping"
    FAILED = "failed"
    CLOSED = "closed"


P = Phase
TRANSITIONS = {
    (P.IDLE, P.FORWARD), (P.FORWARD, P.FORWARD), (P.FORWARD, P.IDLE),   # FORWARD -> IDLE: rolled back, or frozen
    (P.FORWARD, P.BACKWARD), (P.IDLE, P.BACKWARD),  # IDLE: the loss of a forward run on engine.module itself
    (P.BACKWARD, P.IDLE),                           # done, or rolled back (the forward's graph is spent)
    (P.IDLE, P.STEPPING), (P.FORWARD, P.STEPPING), (P.STEPPING, P.IDLE),
    *((p, P.FAILED) for p in (P.IDLE, P.FORWARD, P.BACKWARD, P.STEPPING)),  # IDLE: a deferred step ([Note: split step])
    *((p, P.CLOSED) for p in P),
}


class StepFailed(RuntimeError):
    """The engine's weights and optimizer states are partly updated by a step that failed."""


class EngineClosed(RuntimeError):
    pass


class StepPipeline:
    """Forward/backward/step control over `weights` and `states` (the units' handles) on runtime `rt`, with
    its parts: `prefetch` (offload.step.prefetch, which the module hooks call), `grads` (offload.step.gradients) and
    `deferred` ([Note: split step]). policy: the residency policy the prefetcher carries out.

    One micro-step, in order: begin_forward, then the hooks fetch each unit through `prefetch` (whose first
    fetch queues the last step's deferred units); backward: the step mode is chosen once (offload.plan.modes),
    its window pipeline started, autograd runs (each unit's gradients go through `grads`, the overlapped
    step or the delayed update beside them on the d2h thread), the fetched copies are released and the
    jobs waited for; step() at the accumulation boundary, unless the backward took it, runs every unit's
    windows (run_step)."""

    def __init__(self, rt: Runtime, units: list[Unit], weights, states, trace, policy, room: int | None = None):
        self.rt, self.units, self.weights, self.states, self.trace = rt, units, weights, states, trace
        self.generation_trace = CyclicTrace(trace.lookahead)  # [Note: generation] in offload.step.generation
        self.grads = GradientPath(rt, units, states)
        self.deferred = DeferredSteps(rt, units, weights, states, self._deferred_failed)
        self.prefetch = Prefetcher(weights, policy, rt.tiers.acct["hbm"], self.grads.make_room, self.deferred.start,
                                   lambda: self.in_backward, room)
        self.scale = LossScale(rt.settings)
        self.stats = StepStats(rt.telemetry)
        self.phase = P.IDLE
        self.failure: str | None = None
        self.step_count = self.micro_step = 0
        self.last_grad_norm: float | None = None
        self.lr_value: float | None = None          # set through Engine.lr: replaces lr_schedule from then on
        self._pending: dict | None = None           # delayed_update: the accepted update not applied yet
        self._mode = StepMode.PLAIN                 # the last backward's: OVERLAPPED or SPLIT took the step

    # -- phases ------------------------------------------------------------------------------------
    def _to(self, target: Phase) -> None:
        if (self.phase, target) not in TRANSITIONS:
            raise RuntimeError(f"offload: {target.value} while {self.phase.value} (no such transition)")
        self.phase = target

    def check_usable(self, what: str) -> None:
        if self.phase is P.CLOSED:
            raise EngineClosed(f"engine is closed: {what} needs a live engine (its buffers and swap files are "
                               "gone); create a new one with offload.initialize")
        if self.phase is P.FAILED:
            raise StepFailed(f"offload: {what} refused: {self.failure}")

    def _fail(self, where: str, error: BaseException) -> None:
        self.fail(f"{where} failed after the optimizer began updating states ({type(error).__name__}: "
                  f"{error}); weights and optimizer states are partly updated, so this engine trains no "
                  "further. close() it (the swap files are removed) and restart from your last saved "
                  "weights or checkpoint")

    def fail(self, failure: str) -> None:
        """Enters `failed` with `failure` (what every later call is refused with), from outside a step too
        (a checkpoint load that failed after it began writing states). A closed pipeline stays closed, a failed
        one keeps its first failure."""
        if self.phase in (P.CLOSED, P.FAILED):
            return
        self.failure = failure
        self._to(P.FAILED)

    def _deferred_failed(self, error: BaseException) -> None:
        self._fail(f"the step of step {self.step_count} applied at the next fetch (split_step)", error)

    @property
    def in_backward(self) -> bool:
        return self.phase is P.BACKWARD

    # -- forward -----------------------------------------------------------------------------------
    def begin_forward(self) -> Phase:
        """Returns the phase to roll back to if this forward raises."""
        self.check_usable("forward")
        self.rt.ranks.step = self.step_count + 1  # named by a collective's error (offload.state.ranks)
        before = self.phase
        if before is not P.BACKWARD:  # a forward inside backward (recomputation) belongs to the backward
            self._to(P.FORWARD)
        return before

    def end_forward(self) -> None:
        """The forward of a model with nothing trainable ends its step, as a backward ends a training one: what
        it fetched is released and its order recorded, so the next forward prefetches along it."""
        self.prefetch.release_all()
        self.trace.end_step()
        self._to(P.IDLE)

    def forward_failed(self, before: Phase) -> None:
        if before is P.BACKWARD:
            return  # the backward's own failure handling rolls it back
        self.prefetch.release_all()
        self.trace.abandon_step()
        try:
            self.deferred.finish()  # the previous step's: applied whatever this forward did
        except Exception:  # the engine failed (StepFailed from now on); the forward's error is the one raised
            return
        self._to(before)

    # -- backward: gradients to their accumulators, and the step pipelined with them -----------------
    def backward(self, loss: torch.Tensor) -> None:
        self.check_usable("backward")
        self.rt.ranks.step = self.step_count + 1
        settings = self.rt.settings
        self.deferred.finish()  # normally done already: each deferred unit's fetch waited for its step
        self._to(P.BACKWARD)
        gas = settings.gradient_accumulation_steps
        mode = step_mode(settings, self.rt.sharded, self.micro_step, self._pending is not None, self.rt.settings.deferred)
        args = {"lr": self.lr, "grad_scale": self.scale.value} if mode.overlapped else self._pending
        pipe = beside_backward(self.rt, self.units, self.states, self.weights, mode, args)
        self.grads.begin(Backward(mode, self.micro_step % gas == 0, self.micro_step % gas == gas - 1, pipe))
        scale = self.scale.value / gas
        t_start = time.perf_counter()
        try:
            with record_function("offload::backward"):
                (loss * scale if scale != 1.0 else loss).backward()
                self.grads.flush_rest()
                self.prefetch.release_all()
                self.grads.wait_all()
                if pipe is not None:
                    pipe.finish()
        except BaseException as e:
            self._backward_failed(e, pipe)
            raise
        finally:
            self.rt.telemetry.span("compute", "backward", t_start, time.perf_counter())
        self.trace.end_step()
        self._mode = mode
        if mode is StepMode.DELAYED:
            self._pending = None
        elif mode.overlapped:
            self._took_step(args)
        self.micro_step += 1
        self._to(P.IDLE)

    def _took_step(self, args: dict) -> None:
        """An overlapped backward stepped its units: counted as the step (step() then only ends the window)."""
        self.stats.mark()
        self.grads.grad_sq.clear()
        self.last_grad_norm = None
        self.step_count += 1
        if self.rt.settings.deferred:
            self.deferred.defer(args)

    def _backward_failed(self, error: BaseException, pipe: WindowPipeline | None) -> None:
        """Settles everything the micro-step has in flight; rolls it back unless a state changed."""
        self.grads.settle()
        changed = bool(self.grads.touched) or (pipe is not None and pipe.started)
        if pipe is not None:
            pipe.abort()
        self.grads.drop()
        self.prefetch.release_all()
        self.trace.abandon_step()
        if changed:
            self._fail(f"step {self.step_count + 1} (during backward)", error)
        else:
            self._to(P.IDLE)

    # -- step ----------------------------------------------------------------------------------------
    @property
    def lr(self) -> float:
        """The learning rate of the next optimizer step."""
        if self.lr_value is not None:
            return self.lr_value
        return self.rt.settings.optimizer.lr * lr_factor(self.rt.settings.lr_schedule, self.step_count)

    def step(self) -> bool:
        """The optimizer step at the accumulation boundary (a no-op between boundaries). Returns True when
        parameters were updated (False: between boundaries, or an fp16 overflow)."""
        self.check_usable("step")
        if self.micro_step == 0:
            raise RuntimeError("step() called before backward(): call engine.backward(loss) first")
        settings = self.rt.settings
        if self.micro_step % settings.gradient_accumulation_steps != 0:
            return False
        if self._mode.overlapped:  # taken unit by unit during backward
            self._mode = StepMode.PLAIN
            self.micro_step = 0
            return True
        sq = sum(self.grads.grad_sq.values())
        if self.rt.sharded:  # each rank summed the windows it owns: the global norm, the same on every rank
            sq = sum_over_ranks(sq, self.rt)
        if not math.isfinite(sq):
            self.micro_step = 0
            self.grads.grad_sq.clear()
            self.scale.overflow(settings, self.step_count)
            return False
        grad_norm = math.sqrt(sq) / self.scale.value
        clip = settings.gradient_clipping
        clip_coef = min(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else 1.0
        update = {"lr": self.lr, "grad_scale": self.scale.value / clip_coef}
        if settings.delayed_update:  # applied unit by unit during the next backward (or by flush())
            self._pending = update
        else:
            self._to(P.STEPPING)
            t0 = time.perf_counter()
            try:
                self.run_step(update, f"step {self.step_count + 1}")
            except BaseException:
                if self.phase is P.STEPPING:  # nothing changed: the gradients stay, step() may be retried
                    self._to(P.IDLE)
                raise
            self.rt.telemetry.span("compute", "step", t0, time.perf_counter())
            self._to(P.IDLE)
        self.micro_step = 0
        self.grads.grad_sq.clear()
        self.last_grad_norm = grad_norm
        self.step_count += 1
        self.stats.mark()
        self.scale.good_step(settings)
        return True

    def run_step(self, update: dict, where: str) -> None:
        """The step after backward: every trainable unit's windows in turn, reading window j+1's states
        ahead while window j updates and writing window j-1's behind. A failure after the first window
        began updating puts the pipeline in `failed`."""
        self.prefetch.release_all()  # no fetched copy may outlive the update of its home ([Note: updates beside residency])
        trainable = [u for u in self.units if u.trainable_numel]
        pipe = WindowPipeline(self.states, self.weights, self.rt, [u.index for u in trainable], update,
                              read_ahead=self.rt.settings.read_ahead)
        sharing = False
        try:
            with record_function("offload::step"):
                for unit in trainable:
                    pipe.step_unit(unit)
                pipe.finish()
            if self.rt.sharded:
                sharing = True
                with record_function("offload::share_new_weights"):
                    for unit in trainable:  # stage 3's partitioned units: each rank keeps its own chunks
                        if not self.weights[unit.index].partitioned:
                            share_new_weights(self.rt, unit, self.states[unit.index], self.weights[unit.index])
        except BaseException as e:
            pipe.abort()
            if pipe.started or sharing:
                self._fail(where, e)
            raise

    def flush(self) -> None:
        """delayed_update: applies the accepted update that would land during the next backward, now (and
        split_step's deferred steps)."""
        self.check_usable("flush")
        self.deferred.finish()
        if self._pending is not None:
            self._to(P.STEPPING)
            try:
                self.run_step(self._pending, f"the delayed update of step {self.step_count}")
            except BaseException:
                if self.phase is P.STEPPING:
                    self._to(P.IDLE)
                raise
            self._pending = None
            self._to(P.IDLE)

    # -- checkpoints (offload.checkpoint.saving and loading) --------------------------------------------------
    def checkpoint_state(self) -> dict:
        """The counters, the loss scaler and the accepted update not applied yet (delayed_update), as a
        checkpoint saves them. Only between steps (a forward without its backward changes no state): after the
        last backward of an accumulation window and before its step() the step is half taken (or, overlapped,
        taken and not counted). Deferred steps ([Note: split step]) are applied first."""
        self.check_usable("checkpoint")
        self.deferred.finish()
        gas = self.rt.settings.gradient_accumulation_steps
        if self.phase not in (P.IDLE, P.FORWARD) or (self.micro_step and self.micro_step % gas == 0):
            raise RuntimeError(f"offload: checkpoint while {self.phase.value}, {self.micro_step} backward(s) since "
                               "the last step: save or load between steps (after engine.step())")
        return {"step_count": self.step_count, "micro_step": self.micro_step, "loss_scale": self.scale.value,
                "good_steps": self.scale.good_steps, "skipped_steps": self.scale.skipped_steps,
                "last_grad_norm": self.last_grad_norm, "pending_update": self._pending}

    def restore(self, state: dict) -> None:
        """Sets what checkpoint_state() returned, once the units' states hold the checkpoint's."""
        self.checkpoint_state()  # the same precondition
        self.step_count, self.micro_step = state["step_count"], state["micro_step"]
        self.scale.value, self.scale.good_steps = state["loss_scale"], state["good_steps"]
        self.scale.skipped_steps, self.last_grad_norm = state["skipped_steps"], state["last_grad_norm"]
        self._pending = state["pending_update"]

    # -- close ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Settles the jobs in flight and returns the optimizer pipeline's chunks; always succeeds."""
        self.grads.settle()
        self.deferred.close()
        self.phase = P.CLOSED


class DeferredSteps:
    """[Note: split step] The steps of the placement's deferred units, queued on the d2h thread in forward
    order before the next forward's first fetch; each unit's fetch waits for its own (WeightHandle.update).
    on_failure(error): a deferred step failed (the engine fails: states are partly updated)."""

    def __init__(self, rt: Runtime, units: list[Unit], weights, states, on_failure):
        self.rt, self.units, self.weights, self.states, self.on_failure = rt, units, weights, states, on_failure
        self._args: dict | None = None     # the step's lr and grad_scale, while its deferred units wait
        self._queued: tuple | None = None  # (window pipeline, completions) once started

    def defer(self, args: dict) -> None:
        self._args = args

    def start(self) -> None:
        """Queues the deferred units' steps (idempotent; a no-op when none wait)."""
        if self._args is None or self._queued is not None:
            return
        order = self.rt.settings.deferred  # in forward order
        pipe = WindowPipeline(self.states, self.weights, self.rt, list(order), self._args, KINDS,
                              read_ahead=self.rt.settings.read_ahead)
        jobs: list = []
        self._queued = (pipe, jobs)
        for u in (self.units[i] for i in order):
            done = self.rt.d2h.submit(pipe.step_unit, u)
            self.weights[u.index].update = done
            jobs.append(done)

    def finish(self) -> None:
        """Applies the deferred steps (starts them if no fetch did) and waits for them. A failure leaves
        states partly updated: on_failure runs, and the error is raised."""
        if self._args is None:
            return
        self.start()
        pipe, jobs = self._queued
        try:
            for done in jobs:
                done.wait()
            pipe.finish()
        except BaseException as e:
            for done in jobs:
                settle(done)
            pipe.abort()
            self.on_failure(e)
            raise
        finally:
            self._clear()

    def close(self) -> None:
        if self._queued is not None:
            pipe, jobs = self._queued
            for done in jobs:
                settle(done)
            pipe.abort()
        self._clear()

    def _clear(self) -> None:
        self._args = self._queued = None
        for u in self.units:
            self.weights[u.index].update = None


class StepStats:
    """Per-step telemetry: what moved and how long compute stalled since the previous step (`last`)."""

    def __init__(self, telemetry):
        self.telemetry, self._mark, self.last = telemetry, telemetry.snapshot(), None

    def mark(self) -> None:
        now = self.telemetry.snapshot()
        self.last, self._mark = _delta(now, self._mark), now


def beside_backward(rt: Runtime, units: list[Unit], states: list, weights: list, mode: StepMode,
                    args: dict | None) -> WindowPipeline | None:
    """The window pipeline beside a backward's gradient jobs: units stepped on the d2h thread as their
    gradients become final, in reverse unit order, the first one's states read ahead (STATES when the
    gradient comes from this backward, KINDS for the delayed update of the previous one)."""
    if not (mode.overlapped or mode is StepMode.DELAYED):
        return None
    skip = rt.settings.deferred if mode is StepMode.SPLIT else ()
    order = [u.index for u in reversed(units) if u.trainable_numel and u.index not in skip]
    return WindowPipeline(states, weights, rt, order, args, STATES if mode.overlapped else KINDS,
                          read_ahead=rt.settings.read_ahead)


def sum_over_ranks(x: float, rt: Runtime) -> float:
    """x summed over the ranks (a non-finite x on any rank makes the sum non-finite on every rank)."""
    t0 = time.perf_counter()
    total = rt.ranks.agree([x], "sum", "all_reduce of the gradient norm")[0]
    rt.telemetry.collective("all_reduce", 8, time.perf_counter() - t0)
    return total


def share_new_weights(rt: Runtime, unit: Unit, st, w) -> None:
    """[Note: windows over ranks] After the step, each window's new weights go from its owner to every other
    rank (one broadcast per window: over the model, the volume of an all-gather), into the weight tier
    through the same new_weights/commit path the optimizer writes by. Sent as bytes (gloo has no bf16
    arithmetic to trip over, and a broadcast needs none)."""
    import torch.distributed as dist

    w.writer.wait_for_write()  # the owner's windows, written behind by its step, are read back from their home
    for i, (b, e) in enumerate(st.chunks):
        t0 = time.perf_counter()
        if st.owner[i] == rt.rank:
            src, release = w.writer.home_weights(i, b, e)
            try:
                rt.ranks.run("broadcast", f"{unit.name} window {i}'s new weights",
                             lambda: dist.broadcast(src.view(torch.uint8), src=rt.rank, group=rt.ranks.compute))
            finally:
                release()
        else:
            buf = w.writer.new_weights(i, b, e)
            try:
                rt.ranks.run("broadcast", f"{unit.name} window {i}'s new weights",
                             lambda: dist.broadcast(buf[:e - b].view(torch.uint8), src=st.owner[i],
                                                    group=rt.ranks.compute))
            except BaseException:
                w.writer.discard(buf)
                raise
            w.writer.commit(i, b, e, buf)
        rt.telemetry.collective("broadcast", (e - b) * w.dtype.itemsize, time.perf_counter() - t0)
    w.writer.wait_for_write()


def _delta(now: dict, before: dict) -> dict:
    links = {k: {"bytes": v["bytes"] - before["links"][k]["bytes"], "seconds": v["seconds"] - before["links"][k]["seconds"]}
             for k, v in now["links"].items()}
    stall = now["stall_seconds"] - before["stall_seconds"]
    zero = {"bytes": 0, "seconds": 0.0, "calls": 0}
    coll = {k: {f: v[f] - before["collectives"].get(k, {}).get(f, zero.get(f, 0.0)) for f in v}
            for k, v in now["collectives"].items()}
    return {"links": links, "collectives": coll, "stall_seconds": stall, "overlap_fraction": overlap_fraction(links, stall)}
