"""The step pipeline: a training step's control flow as one phase machine.

[Note: phases]
    idle -> forward -> backward -> idle          one micro-step (gradients leave hbm as they become final)
    idle -> stepping -> idle                     step() at the accumulation boundary
    forward -> forward                           several forwards before a backward (evaluation, or losses
                                                 summed over two forwards)
    any -> failed                                an error after the optimizer began changing states
    any -> closed
The pipeline owns what one step holds in flight: the gradient jobs on the d2h thread, each unit's
gradients waiting for the rest of the unit, the optimizer's window pipeline (read-ahead, write-behind)
and the delayed update, so that a failure is handled in one place.

[Note: failure semantics]
An error before any state changed (in forward; in backward before a unit was stepped, and, with
gradient accumulation, in the first micro-step of a window) rolls the micro-step back: its partial
gradients are dropped, every gradient job is settled (each refunds its hbm charge), the optimizer's
read-ahead returns its chunks, fetched weights are released, and the engine is as before that micro-step,
so training can go on (it equals a run that never saw that batch). An error after the optimizer began
updating states (a step in step() or during backward, the delayed update, or an accumulator that held
earlier micro-steps' gradients) leaves weights and states partly updated: the pipeline enters `failed`,
and every further forward, backward, step or state read raises StepFailed naming the step and the cause;
close() still works and removes the swap files.

[Note: split step]
With the overlapped step and optimizer states on nvme, all of a step's state I/O (read 12 B, write 14 B
per parameter) fell in the backward, beside its compute, while the forward read only the weights: on a
host where both phases are busy (the 3b preset here) the step took the forward's compute plus the
backward's I/O. With split_step (a fraction, default 0.25) the placement defers that share of the fetched
units, spread evenly over the forward order (placement.deferred): in backward such a unit's gradient goes
to its nvme accumulator in the compute dtype (2 B write) and its step waits; at the next forward's first fetch, every deferred unit's
step is queued on the d2h thread in forward order (a window pipeline of its own), and each unit's fetch
waits for its own step (WeightHandle.update) on the reader thread, so the steps run ahead of the forward's
compute. It is the same update (the same gradient, lr and scale) applied before the unit's next use, so
the numbers are those of the step in backward (the parity tests compare them bit for bit). Whatever
reads or saves states (full_state_dict, state_dict, checkpoints, flush, close) applies the waiting steps
first (finish_deferred); a failed deferred step fails the engine as a failed step does.
"""

from __future__ import annotations

import enum
import logging
import math
import time

import torch
from torch.profiler import record_function

from offload.optim import KINDS, STATES
from offload.step import WindowPipeline
from offload.units import Unit
from scheduler.telemetry import overlap_fraction

log = logging.getLogger("offload")


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"
    STEPPING = "stepping"
    FAILED = "failed"
    CLOSED = "closed"


P = Phase
TRANSITIONS = {
    (P.IDLE, P.FORWARD), (P.FORWARD, P.FORWARD), (P.FORWARD, P.IDLE),   # FORWARD -> IDLE: rolled back
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
    """Forward/backward/step control over `weights` and `states` (the units' handles) on runtime `rt`.
    `release_all()` drops every fetched weight copy (the engine's residency policy)."""

    def __init__(self, rt, units: list[Unit], weights, states, trace, release_all):
        self.rt, self.units, self.weights, self.states = rt, units, weights, states
        self.trace, self.release_all = trace, release_all
        self.phase = P.IDLE
        self.failure: str | None = None
        self.step_count = self.micro_step = 0
        self.loss_scale = rt.cfg.loss_scale.initial if rt.cfg.precision == "fp16" else 1.0
        self.good_steps = self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        self.lr_value: float | None = None          # set through Engine.lr: replaces lr_schedule from then on
        self.grad_reserve = rt.placement.grad_reserve
        self._jobs: list[tuple] = []                # (completion, hbm bytes) of gradient jobs in flight
        self._waiting = {u.index: [] for u in units}  # a unit's parameters whose gradient is final
        self._grad_sq: dict[int, float] = {}
        self._flushed: set[int] = set()
        self._touched: set[int] = set()            # units whose accumulator this micro-step changed
        self._overlap = self._delayed = self._stepped_in_backward = False
        self._pending: dict | None = None  # delayed_update: the accepted update not applied yet (step args)
        self._pipe: WindowPipeline | None = None
        self._args: dict | None = None             # the overlapped step's lr and grad_scale
        self._deferred: dict | None = None          # [Note: split step] the step args of units not stepped yet
        self._deferred_pipe: WindowPipeline | None = None
        self._deferred_jobs: list = []
        self._step_mark, self.last_step = rt.telemetry.snapshot(), None

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

    @property
    def in_backward(self) -> bool:
        return self.phase is P.BACKWARD

    # -- forward -----------------------------------------------------------------------------------
    def begin_forward(self) -> Phase:
        """Returns the phase to roll back to if this forward raises."""
        self.check_usable("forward")
        self.rt.ranks.step = self.step_count + 1  # named by a collective's error (offload.ranks)
        before = self.phase
        if before is not P.BACKWARD:  # a forward inside backward (recomputation) belongs to the backward
            self._to(P.FORWARD)
        return before

    def forward_failed(self, before: Phase) -> None:
        if before is P.BACKWARD:
            return  # the backward's own failure handling rolls it back
        self.release_all()
        self.trace.abandon_step()
        try:
            self.finish_deferred()  # the previous step's: applied whatever this forward did
        except Exception:  # the engine failed (StepFailed from now on); the forward's error is the one raised
            return
        self._to(before)

    # -- the deferred steps ([Note: split step]) -----------------------------------------------------
    def start_deferred(self) -> None:
        """Queues the deferred units' steps on the d2h thread in forward order; each unit's next fetch waits
        for its own. Called before the first fetch after the step (Engine.fetch_for_use); idempotent."""
        if self._deferred is None or self._deferred_pipe is not None:
            return
        order = self.rt.placement.deferred  # in forward order
        pipe = self._deferred_pipe = WindowPipeline(self, list(order), self._deferred, KINDS,
                                                    read_ahead=self.rt.placement.read_ahead)
        for u in (self.units[i] for i in order):
            done = self.rt.d2h.submit(pipe.step_unit, u)
            self.weights[u.index].update = done
            self._deferred_jobs.append(done)

    def finish_deferred(self) -> None:
        """Applies the deferred steps (starts them if no fetch did) and waits for them. A failure leaves
        states partly updated: the engine fails."""
        if self._deferred is None:
            return
        self.start_deferred()
        pipe, jobs = self._deferred_pipe, self._deferred_jobs
        try:
            for done in jobs:
                done.wait()
            pipe.finish()
        except BaseException as e:
            for done in jobs:
                _settle(done)
            pipe.abort()
            if self.phase is not P.FAILED:
                self._fail(f"the step of step {self.step_count} applied at the next fetch (split_step)", e)
            raise
        finally:
            self._deferred, self._deferred_pipe, self._deferred_jobs = None, None, []
            for u in self.units:
                self.weights[u.index].update = None

    # -- backward: gradients to their accumulators, and the step pipelined with them -----------------
    def grad_hook(self, unit: Unit):
        n_trainable = sum(s.trainable for s in unit.slots)

        def hook(param: torch.Tensor) -> None:
            waiting = self._waiting[unit.index]
            waiting.append(param)
            if len(waiting) == n_trainable:
                self._flush_grads(unit)

        return hook

    def _flush_grads(self, unit: Unit) -> None:
        """Hands this unit's final gradients of the micro-step to the d2h thread (hbm -> dram, fp32 add),
        and with overlap_step / delayed_update its optimizer step after it."""
        params, self._waiting[unit.index] = self._waiting[unit.index], []
        self._flushed.add(unit.index)
        offsets = {s.param: s.offset for s in unit.slots}
        grads = [(offsets[p], p.grad.reshape(-1)) for p in params if p.grad is not None]
        for p in params:
            p.grad = None
        gas = self.rt.cfg.gradient_accumulation_steps
        first, last = self.micro_step % gas == 0, self.micro_step % gas == gas - 1
        nbytes = sum(g.numel() * g.element_size() for _, g in grads)
        hbm = self.rt.tiers.acct["hbm"]
        # back-pressure: earlier gradients leave hbm first, within the budget and the planned reserve
        while self._jobs and (not hbm.fits(nbytes) or sum(n for _, n in self._jobs) + nbytes > self.grad_reserve):
            self.wait_oldest_grad_job()
        hbm.charge(nbytes, f"{unit.name} gradients")  # they exist in hbm until the d2h job consumed them
        state, overlap, delayed, tel = self.states[unit.index], self._overlap, self._delayed, self.rt.telemetry
        deferred = overlap and unit.index in self.rt.placement.deferred  # [Note: split step]

        def job():
            try:
                if delayed:  # the previous step's update, before the accumulator takes this step's gradient
                    self._pipe.step_unit(unit)
                t0 = time.perf_counter()
                if self.rt.world > 1 and not self.rt.sharded:  # sharded: reduced window by window (offload.optim)
                    average_over_ranks(grads, self.rt)
                if not first:
                    self._touched.add(unit.index)  # holds earlier micro-steps' gradients: changed from here
                sq = state.accumulate(grads, first, last, keep=overlap and not deferred, deferred=deferred)
                tel.link("hbm_to_dram", nbytes, time.perf_counter() - t0)
                if sq is not None:
                    self._grad_sq[unit.index] = sq
                if overlap:
                    if not math.isfinite(sq):
                        raise FloatingPointError(f"{unit.name}: gradients are not finite ({self.rt.cfg.precision}); "
                                                 "lower the learning rate or enable gradient_clipping")
                    if not deferred:
                        self._pipe.step_unit(unit)  # nvme states read the gradient from `grads` window by window
            finally:
                grads.clear()
                hbm.refund(nbytes)

        try:
            self._jobs.append((self.rt.d2h.submit(job, tensors=[g for _, g in grads]), nbytes))
        except BaseException:  # not queued (a closed or dead thread): the job's own refund will not run
            hbm.refund(nbytes)
            raise

    def wait_oldest_grad_job(self) -> bool:
        """Waits for the oldest gradient job in flight (its hbm bytes are free after); False if none."""
        if not self._jobs:
            return False
        self._jobs.pop(0)[0].wait()
        return True

    def backward(self, loss: torch.Tensor) -> None:
        self.check_usable("backward")
        self.rt.ranks.step = self.step_count + 1
        cfg = self.rt.cfg
        self.finish_deferred()  # normally done already: each deferred unit's fetch waited for its step
        self._to(P.BACKWARD)
        self._flushed, self._touched = set(), set()
        self._overlap = self._can_overlap()
        self._delayed = self._pending is not None
        scale = self.loss_scale / cfg.gradient_accumulation_steps
        t_start = time.perf_counter()
        try:
            with record_function("offload::backward"):
                if self._overlap:
                    self._args = {"lr": self.lr, "grad_scale": self.loss_scale}
                    self._begin_pipelined_step(self._args, STATES)
                elif self._delayed:
                    self._begin_pipelined_step(self._pending, KINDS)  # gradients of the previous step
                (loss * scale if scale != 1.0 else loss).backward()
                for u in self.units:  # units with unused parameters: flush what they have
                    if u.trainable_numel and u.index not in self._flushed:
                        self._flush_grads(u)
                self.release_all()
                while self.wait_oldest_grad_job():
                    pass
                if self._pipe is not None:
                    self._finish_pipelined_step()
        except BaseException as e:
            self._backward_failed(e)
            raise
        finally:
            self.rt.telemetry.span("compute", "backward", t_start, time.perf_counter())
        self.trace.end_step()
        self._delayed = False
        self.micro_step += 1
        self._to(P.IDLE)

    def _backward_failed(self, error: BaseException) -> None:
        """Settles everything the micro-step has in flight; rolls it back unless a state changed."""
        self._settle_jobs()
        changed = bool(self._touched) or (self._pipe is not None and self._pipe.started)
        if self._pipe is not None:
            self._pipe.abort()
            self._pipe = None
        for u in self.units:  # gradients autograd produced and no job took
            self._waiting[u.index] = []
            for s in u.slots:
                s.param.grad = None
        for st in self.states:
            if st is not None:
                st.drop_gradients()
        self._grad_sq.clear()
        self._delayed = False
        self.release_all()
        self.trace.abandon_step()
        if changed:
            self._fail(f"step {self.step_count + 1} (during backward)", error)
        else:
            self._to(P.IDLE)

    def _settle_jobs(self) -> None:
        for completion, _ in self._jobs:
            _settle(completion)
        self._jobs = []

    def _can_overlap(self) -> bool:
        c = self.rt.cfg
        last = self.micro_step % c.gradient_accumulation_steps == c.gradient_accumulation_steps - 1
        return (last and c.overlap_step and not c.delayed_update and c.gradient_clipping == 0 and c.precision != "fp16"
                and not self.rt.sharded)

    def _begin_pipelined_step(self, args: dict, kinds) -> None:
        """Units are stepped on the d2h thread as their gradients become final, in reverse unit order:
        the first one's states (`kinds`) are read ahead. args: step_window's lr and grad_scale."""
        skip = self.rt.placement.deferred if self._overlap else ()
        order = [u.index for u in reversed(self.units) if u.trainable_numel and u.index not in skip]
        self._pipe = WindowPipeline(self, order, args, kinds, read_ahead=self.rt.placement.read_ahead)

    def _finish_pipelined_step(self) -> None:
        self._pipe.finish()
        self._pipe = None
        if self._delayed:
            self._pending = None
            return
        self._mark_step()
        self._grad_sq.clear()
        self.last_grad_norm = None
        self.step_count += 1
        self._stepped_in_backward = True
        if self.rt.placement.deferred:
            self._deferred = self._args

    # -- step ----------------------------------------------------------------------------------------
    @property
    def lr(self) -> float:
        """The learning rate of the next optimizer step."""
        if self.lr_value is not None:
            return self.lr_value
        return self.rt.cfg.optimizer.lr * lr_factor(self.rt.cfg.lr_schedule, self.step_count)

    def step(self) -> bool:
        """The optimizer step at the accumulation boundary (a no-op between boundaries). Returns True when
        parameters were updated (False: between boundaries, or an fp16 overflow)."""
        self.check_usable("step")
        if self.micro_step == 0:
            raise RuntimeError("step() called before backward(): call engine.backward(loss) first")
        cfg = self.rt.cfg
        if self.micro_step % cfg.gradient_accumulation_steps != 0:
            return False
        if self._stepped_in_backward:  # done unit by unit during backward (overlap_step)
            self._stepped_in_backward = False
            self.micro_step = 0
            return True
        sq = sum(self._grad_sq.values())
        if self.rt.sharded:  # each rank summed the windows it owns: the global norm, the same on every rank
            sq = sum_over_ranks(sq, self.rt)
        if not math.isfinite(sq):
            self.micro_step = 0
            self._grad_sq.clear()
            return self._skip_step()
        grad_norm = math.sqrt(sq) / self.loss_scale
        clip = cfg.gradient_clipping
        clip_coef = min(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else 1.0
        update = {"lr": self.lr, "grad_scale": self.loss_scale / clip_coef}
        if cfg.delayed_update:  # applied unit by unit during the next backward (or by flush())
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
        self._grad_sq.clear()
        self.last_grad_norm = grad_norm
        self.step_count += 1
        self._mark_step()
        self._grow_loss_scale()
        return True

    def run_step(self, update: dict, where: str) -> None:
        """The step after backward: every trainable unit's windows in turn, reading window j+1's states
        ahead while window j updates and writing window j-1's behind. A failure after the first window
        began updating puts the pipeline in `failed`."""
        self.release_all()  # no fetched copy may outlive the update of its home ([Note: updates beside residency])
        trainable = [u for u in self.units if u.trainable_numel]
        pipe = WindowPipeline(self, [u.index for u in trainable], update, read_ahead=self.rt.placement.read_ahead)
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
        self.finish_deferred()
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

    def _skip_step(self) -> bool:
        cfg = self.rt.cfg
        if cfg.precision != "fp16":
            raise FloatingPointError(f"gradients are not finite at step {self.step_count + 1} ({cfg.precision}); "
                                     "lower the learning rate or enable gradient_clipping")
        self.loss_scale = max(self.loss_scale / 2, cfg.loss_scale.min_scale)
        self.skipped_steps += 1
        self.good_steps = 0
        log.info("offload: fp16 overflow, step skipped; loss scale now %g", self.loss_scale)
        return False

    def _grow_loss_scale(self) -> None:
        if self.rt.cfg.precision != "fp16":
            return
        self.good_steps += 1
        if self.good_steps % self.rt.cfg.loss_scale.growth_interval == 0:
            self.loss_scale *= 2

    def _mark_step(self) -> None:
        """Per-step telemetry: what moved and how long compute stalled since the previous step."""
        now = self.rt.telemetry.snapshot()
        self.last_step = _delta(now, self._step_mark)
        self._step_mark = now

    # -- checkpoints (offload.checkpoint) -------------------------------------------------------------
    def checkpoint_state(self) -> dict:
        """The counters, the loss scaler and the accepted update not applied yet (delayed_update), as a
        checkpoint saves them. Only between steps (a forward without its backward changes no state): after the
        last backward of an accumulation window and before its step() the step is half taken (or, overlapped,
        taken and not counted). Deferred steps ([Note: split step]) are applied first."""
        self.check_usable("checkpoint")
        self.finish_deferred()
        gas = self.rt.cfg.gradient_accumulation_steps
        if self.phase not in (P.IDLE, P.FORWARD) or (self.micro_step and self.micro_step % gas == 0):
            raise RuntimeError(f"offload: checkpoint while {self.phase.value}, {self.micro_step} backward(s) since "
                               "the last step: save or load between steps (after engine.step())")
        return {"step_count": self.step_count, "micro_step": self.micro_step, "loss_scale": self.loss_scale,
                "good_steps": self.good_steps, "skipped_steps": self.skipped_steps,
                "last_grad_norm": self.last_grad_norm, "pending_update": self._pending}

    def restore(self, state: dict) -> None:
        """Sets what checkpoint_state() returned, once the units' states hold the checkpoint's."""
        self.checkpoint_state()  # the same precondition
        self.step_count, self.micro_step = state["step_count"], state["micro_step"]
        self.loss_scale, self.good_steps = state["loss_scale"], state["good_steps"]
        self.skipped_steps, self.last_grad_norm = state["skipped_steps"], state["last_grad_norm"]
        self._pending = state["pending_update"]

    # -- close ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Settles the jobs in flight and returns the optimizer pipeline's chunks; always succeeds."""
        self._settle_jobs()
        for done in self._deferred_jobs:
            _settle(done)
        if self._deferred_pipe is not None:
            self._deferred_pipe.abort()
        self._deferred, self._deferred_pipe, self._deferred_jobs = None, None, []
        if self._pipe is not None:
            self._pipe.abort()
            self._pipe = None
        self.phase = P.CLOSED


def _settle(done) -> None:
    try:
        done.wait()
    except Exception:  # reported by whoever waited first (an interrupt is not held back)
        pass


def average_over_ranks(grads: list, rt) -> None:
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


def sum_over_ranks(x: float, rt) -> float:
    """x summed over the ranks (a non-finite x on any rank makes the sum non-finite on every rank)."""
    t0 = time.perf_counter()
    total = rt.ranks.agree([x], "sum", "all_reduce of the gradient norm")[0]
    rt.telemetry.collective("all_reduce", 8, time.perf_counter() - t0)
    return total


def share_new_weights(rt, unit: Unit, st, w) -> None:
    """[Note: windows over ranks] After the step, each window's new weights go from its owner to every other
    rank (one broadcast per window: over the model, the volume of an all-gather), into the weight tier
    through the same new_weights/commit path the optimizer writes by. Sent as bytes (gloo has no bf16
    arithmetic to trip over, and a broadcast needs none)."""
    import torch.distributed as dist

    w.wait_for_write()  # the owner's windows, written behind by its step, are read back from their home
    for i, (b, e) in enumerate(st.windows):
        t0 = time.perf_counter()
        if st.owner[i] == rt.rank:
            src, release = w.window(i, b, e)
            try:
                rt.ranks.run("broadcast", f"{unit.name} window {i}'s new weights",
                             lambda: dist.broadcast(src.view(torch.uint8), src=rt.rank, group=rt.ranks.compute))
            finally:
                release()
        else:
            buf = w.new_weights(i, b, e)
            try:
                rt.ranks.run("broadcast", f"{unit.name} window {i}'s new weights",
                             lambda: dist.broadcast(buf[:e - b].view(torch.uint8), src=st.owner[i],
                                                    group=rt.ranks.compute))
            except BaseException:
                w.discard(buf)
                raise
            w.commit(i, b, e, buf)
        rt.telemetry.collective("broadcast", (e - b) * w.dtype.itemsize, time.perf_counter() - t0)
    w.wait_for_write()


def _delta(now: dict, before: dict) -> dict:
    links = {k: {"bytes": v["bytes"] - before["links"][k]["bytes"], "seconds": v["seconds"] - before["links"][k]["seconds"]}
             for k, v in now["links"].items()}
    stall = now["stall_seconds"] - before["stall_seconds"]
    zero = {"bytes": 0, "seconds": 0.0, "calls": 0}
    coll = {k: {f: v[f] - before["collectives"].get(k, zero)[f] for f in zero} for k, v in now["collectives"].items()}
    return {"links": links, "collectives": coll, "stall_seconds": stall, "overlap_fraction": overlap_fraction(links, stall)}


def lr_factor(sched, step: int) -> float:
    """The schedule's multiplier of the base lr for optimizer step `step` (0-based)."""
    if sched.warmup_steps and step < sched.warmup_steps:
        return (step + 1) / sched.warmup_steps
    if sched.type == "constant":
        return 1.0
    progress = min(1.0, (step - sched.warmup_steps) / max(1, sched.total_steps - sched.warmup_steps))
    shape = 1 - progress if sched.type == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return sched.min_ratio + (1 - sched.min_ratio) * shape
