"""The Engine: trains a torch module with its weights and optimizer states in hbm, dram or nvme.

Data flow of one step (DESIGN.md): forward fetches each unit before it runs (prefetching the next ones
along the recorded trace) and releases it after; backward fetches again, and each unit's gradients go
hbm -> dram on the d2h copy stream into an fp32 accumulator as soon as they are final; step() runs CPU
Adam unit by unit over states streamed from their tier, writing new weights straight to the weight tier.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time

import torch
from torch import nn
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_unflatten

from offload import hooks
from offload.config import Config, LossScaleConfig, load_config
from offload.chunks import ChunkPool
from offload.materialize import materialize, unit_values
from offload.optim import KINDS, STATES, OptimState
from offload.placement import Placement, plan_placement
from offload.residency import R, WeightHandle
from offload.step import WindowPipeline, run_step
from offload.tiers import Tiers
from offload.units import Unit, partition
from scheduler.streams import CopyStream, Worker
from scheduler.telemetry import Telemetry, overlap_fraction
from scheduler.trace import ExecutionTrace
from swap import SwapStore

log = logging.getLogger("offload")


class Engine(nn.Module):
    """Wraps `model`; see offload.initialize. Use as `engine(batch)`, `engine.backward(loss)`, `engine.step()`."""

    def __init__(self, model: nn.Module, config: Config | dict | str | None = None, weights=None):
        super().__init__()
        self.weights_source = weights  # name -> tensor; initial values instead of the model's own
        cfg = load_config(config)
        if not any(True for _ in model.parameters()):
            raise ValueError("model: has no parameters; offload trains parameters, pass the model to train")
        self.cfg, self.module, self.rank = cfg, model, 0
        _check_unsupported(cfg)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.dtype = cfg.compute_dtype
        self.units: list[Unit] = partition(model, cfg.units.min_numel, cfg.units.classes)
        self.placement: Placement = plan_placement(self.units, cfg, self.device)
        self.tiers = Tiers(self.device, self.placement.hbm_budget, self.placement.dram_budget,
                           self.placement.nvme_budget, pin=self.device.type == "cuda")
        self.telemetry = Telemetry()
        self.chunk_numel = self.placement.chunk_bytes // 4  # elements per chunk of every buffer (offload.chunks)
        self.staging = ChunkPool(self.tiers, self.placement.chunk_bytes, self.placement.pool_chunks)
        self.store = self._open_store() if self.placement.uses_nvme else None
        delay = float(os.environ.get("OFFLOAD_TEST_COPY_DELAY_S", "0"))
        self.h2d = CopyStream("h2d", self.device, delay)   # fetches: dram -> hbm
        self.d2h = CopyStream("d2h", self.device, delay)   # gradients: hbm -> dram accumulators
        self.reader = Worker("nvme-read", delay)           # fetches from nvme, chunk by chunk
        self.trace = ExecutionTrace(self.placement.knobs.prefetch_units)
        self.step_count = self.micro_step = 0
        self.loss_scale = cfg.loss_scale.initial if cfg.precision == "fp16" else 1.0
        self._good_steps = 0
        self.skipped_steps = 0
        self._in_backward = False
        self._grad_jobs: list = []
        self._grad_job_bytes: list[int] = []  # hbm bytes of each job's gradients
        self._grad_sq: dict[int, float] = {}
        self._kept: dict[int, int] = {}  # units kept in hbm for their next use in this step -> bytes
        self._flushed: set[int] = set()
        self._overlap = self._stepped_in_backward = self._delayed = False
        self._pending: dict | None = None  # delayed_update: the accepted update not applied yet (step_window args)
        self._pipe: WindowPipeline | None = None
        self._grad_reserve = self.placement.part_bytes("gradients in flight")
        self._step_mark, self._last_step = self.telemetry.snapshot(), None
        self._closed = False
        self.weights: list[WeightHandle] = []
        self.states: list[OptimState | None] = []
        try:
            materialize(self)
        except BaseException:
            self.close()
            raise
        self._handles = [h for u in self.units if not u.persistent for m in [u.module, *u.users]
                         for h in hooks.register(self, u, m)]
        self._grad_state = {u.index: [] for u in self.units}
        self._grad_hooks = [s.param.register_post_accumulate_grad_hook(self._make_grad_hook(u))
                            for u in self.units for s in u.slots if s.trainable]
        log.info("%s", self.placement.describe())
        print("offload: memory plan (per tier: need of budget; the runtime's parts)\n" + self.placement.summary(),
              file=sys.stderr, flush=True)  # where a user sees it: a training script's logging may show no INFO

    def _open_store(self) -> SwapStore:
        a = self.cfg.aio
        return SwapStore(self.cfg.nvme_path, engine=a.engine, block_bytes=a.block_bytes, queue_depth=a.queue_depth,
                         threads=a.threads, checksum=self.cfg.swap_checksum)

    # -- forward ------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self._check_open("forward")
        self._check_devices(args, kwargs)
        if not self._in_backward:
            self.trace.begin_step()
        args, kwargs = self._cast_inputs(args, kwargs)
        return self.module(*args, **kwargs)

    def _cast_inputs(self, args, kwargs):
        """Floating-point inputs take the compute dtype (as FSDP's MixedPrecision cast_forward_inputs)."""
        flat, spec = tree_flatten((args, kwargs))
        flat = [t.to(self.dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in flat]
        return tree_unflatten(flat, spec)

    def _check_devices(self, args, kwargs) -> None:
        for t in [*args, *kwargs.values()]:
            if isinstance(t, torch.Tensor) and t.device.type != self.device.type:
                raise ValueError(f"batch tensor on {t.device}: the model runs on {self.device}; "
                                 f"move the batch with .to(engine.device)")

    def fetch_for_use(self, unit: Unit, backward: bool = False) -> None:
        """Called by the hooks before `unit` runs: prefetch along the trace, then wait for this unit."""
        with record_function("offload::fetch"):
            for nxt in self.trace.observe(unit.index):
                self._prefetch(self.units[nxt])
            for w in self.weights:
                w.advance()
            self._kept.pop(unit.index, None)
            w = self.weights[unit.index]
            hbm = self.tiers.acct["hbm"]
            while w.state in (R.NVME, R.DRAM) and not hbm.fits(w.nbytes) and self._grad_jobs:
                self._wait_oldest_grad_job()  # on demand: earlier gradients leave hbm first
            w.wait_for_fetch()

    def _prefetch(self, unit: Unit) -> None:
        w = self.weights[unit.index]
        if not self.tiers.acct["hbm"].fits(w.nbytes + self._grad_reserve):
            return  # no room (the gradients in flight keep theirs): it will be fetched on demand
        w.fetch()

    def release_after_use(self, unit: Unit, backward: bool) -> None:
        if self._in_backward and not backward:
            return  # a recomputed forward (activation checkpointing): its backward comes right after
        distance = self.trace.next_use_distance(unit.index)
        if distance is not None and (distance <= self.placement.knobs.reuse_distance or self._keep(unit)):
            return  # used again in this step (the trace says): keep it rather than fetch it again
        with record_function("offload::release"):
            self.weights[unit.index].release()

    def _release_all(self) -> None:
        """Drops every fetched copy, kept ones too: before homes are updated outside a backward (a step
        after it, flush()), since a forward without backward (eval under no_grad) may have kept units."""
        for w in self.weights:
            w.release()
        self._kept.clear()

    def _keep(self, unit: Unit) -> bool:
        """Keeps the unit's weights in hbm until their next use while the kept bytes fit reuse_bytes."""
        nbytes = self.weights[unit.index].nbytes
        if sum(self._kept.values()) + nbytes > self.placement.reuse_bytes:
            return False
        self._kept[unit.index] = nbytes
        return True

    # -- backward: gradients to their accumulators ----------------------------------------------------
    def _make_grad_hook(self, unit: Unit):
        n_trainable = sum(s.trainable for s in unit.slots)

        def hook(param: torch.Tensor) -> None:
            pending = self._grad_state[unit.index]
            pending.append(param)
            if len(pending) == n_trainable:
                self._flush_grads(unit)

        return hook

    def _flush_grads(self, unit: Unit) -> None:
        """Hands this unit's final gradients of the micro-step to the d2h stream (hbm -> dram, fp32 add)."""
        params = self._grad_state[unit.index]
        self._grad_state[unit.index] = []
        self._flushed.add(unit.index)
        offsets = {s.param: s.offset for s in unit.slots}
        grads = [(offsets[p], p.grad.reshape(-1)) for p in params if p.grad is not None]
        for p in params:
            p.grad = None
        gas = self.cfg.gradient_accumulation_steps
        first, last = self.micro_step % gas == 0, self.micro_step % gas == gas - 1
        nbytes = sum(g.numel() * g.element_size() for _, g in grads)
        hbm = self.tiers.acct["hbm"]
        # back-pressure: earlier gradients leave hbm first, within the budget and the planned reserve
        while self._grad_jobs and (not hbm.fits(nbytes) or sum(self._grad_job_bytes) + nbytes > self._grad_reserve):
            self._wait_oldest_grad_job()
        hbm.charge(nbytes, f"{unit.name} gradients")  # they exist in hbm until the d2h job consumed them
        state = self.states[unit.index]

        overlap, delayed = self._overlap, self._delayed

        def job():
            try:
                if delayed:  # the previous step's update, before the accumulator takes this step's gradient
                    self._pipe.step_unit(unit)
                t0 = time.perf_counter()
                sq = state.accumulate(grads, first, last, keep=overlap)
                self.telemetry.link("hbm_to_dram", nbytes, time.perf_counter() - t0)
                if sq is not None:
                    self._grad_sq[unit.index] = sq
                if overlap:
                    if not math.isfinite(sq):
                        raise FloatingPointError(f"{unit.name}: gradients are not finite ({self.cfg.precision}); "
                                                 "lower the learning rate or enable gradient_clipping")
                    self._pipe.step_unit(unit)  # nvme states read the gradient from `grads` window by window
            finally:
                grads.clear()
                hbm.refund(nbytes)

        self._grad_jobs.append(self.d2h.submit(job))
        self._grad_job_bytes.append(nbytes)

    def _wait_oldest_grad_job(self) -> None:
        self._grad_job_bytes.pop(0)
        self._grad_jobs.pop(0).wait()

    def backward(self, loss: torch.Tensor) -> None:
        self._check_open("backward()")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError("loss: backward() needs a scalar tensor that requires grad (the output of "
                             "the engine's forward reduced to one number)")
        scale = self.loss_scale / self.cfg.gradient_accumulation_steps
        self._in_backward, self._flushed = True, set()
        self._overlap = self._can_overlap()
        self._delayed = self._pending is not None
        t_start = time.perf_counter()
        try:
            with record_function("offload::backward"):
                if self._overlap:
                    self._begin_pipelined_step({"lr": self.lr, "grad_scale": self.loss_scale}, STATES)
                elif self._delayed:
                    self._begin_pipelined_step(self._pending, KINDS)  # gradients of the previous step
                (loss * scale if scale != 1.0 else loss).backward()
                for u in self.units:  # units with unused parameters: flush what they have
                    if u.trainable_numel and u.index not in self._flushed:
                        self._flush_grads(u)
                self._release_all()
                for job in self._grad_jobs:
                    job.wait()
                if self._overlap or self._delayed:
                    self._finish_pipelined_step()
        finally:
            self._in_backward = self._delayed = False
            self._grad_jobs, self._grad_job_bytes = [], []
            self.trace.end_step()
            self.telemetry.span("compute", "backward", t_start, time.perf_counter())
        self.micro_step += 1

    # -- the optimizer step pipelined with backward (overlap_step, delayed_update) ----------------------
    def _can_overlap(self) -> bool:
        c = self.cfg
        last = self.micro_step % c.gradient_accumulation_steps == c.gradient_accumulation_steps - 1
        return last and c.overlap_step and not c.delayed_update and c.gradient_clipping == 0 and c.precision != "fp16"

    def _begin_pipelined_step(self, args: dict, kinds) -> None:
        """Units are stepped on the d2h thread as their gradients become final, in reverse unit order:
        the first one's states (`kinds`) are read ahead. args: step_window's lr and grad_scale."""
        order = [u.index for u in reversed(self.units) if u.trainable_numel]
        self._pipe = WindowPipeline(self, order, args, kinds, read_ahead=self.placement.read_ahead)

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

    def flush(self) -> None:
        """delayed_update: applies the accepted update that would land during the next backward, now
        (at the end of training, before reading or saving the weights). A no-op otherwise."""
        self._check_open("flush()")
        if self._pending is not None:
            with record_function("offload::step"):
                run_step(self, **self._pending)
            self._pending = None

    # -- step --------------------------------------------------------------------------------------
    @property
    def lr(self) -> float:
        """The learning rate of the next optimizer step."""
        return self.cfg.optimizer.lr * lr_factor(self.cfg.lr_schedule, self.step_count)

    def step(self) -> bool:
        """The optimizer step at the accumulation boundary (a no-op between boundaries); clears grads.
        Returns True when parameters were updated (False: between boundaries, or an fp16 overflow)."""
        self._check_open("step()")
        if self.micro_step == 0 or (self.micro_step % self.cfg.gradient_accumulation_steps != 0):
            if self.micro_step == 0:
                raise RuntimeError("step() called before backward(): call engine.backward(loss) first")
            return False
        self.micro_step = 0
        if self._stepped_in_backward:  # done unit by unit during backward (overlap_step)
            self._stepped_in_backward = False
            return True
        sq = sum(self._grad_sq.values())
        self._grad_sq.clear()
        if not math.isfinite(sq):
            return self._skip_step()
        grad_norm = math.sqrt(sq) / self.loss_scale
        clip = self.cfg.gradient_clipping
        clip_coef = min(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else 1.0
        self.last_grad_norm = grad_norm
        update = {"lr": self.lr, "grad_scale": self.loss_scale / clip_coef}
        self.step_count += 1
        if self.cfg.delayed_update:  # applied unit by unit during the next backward (or by flush())
            self._pending = update
        else:
            t0 = time.perf_counter()
            with record_function("offload::step"):
                run_step(self, **update)
            self.telemetry.span("compute", "step", t0, time.perf_counter())
        self._mark_step()
        self._grow_loss_scale()
        return True

    def _skip_step(self) -> bool:
        if self.cfg.precision != "fp16":
            raise FloatingPointError(f"gradients are not finite at step {self.step_count + 1} ({self.cfg.precision}); "
                                     "lower the learning rate or enable gradient_clipping")
        self.loss_scale = max(self.loss_scale / 2, self.cfg.loss_scale.min_scale)
        self.skipped_steps += 1
        self._good_steps = 0
        log.info("offload: fp16 overflow, step skipped; loss scale now %g", self.loss_scale)
        return False

    def _grow_loss_scale(self) -> None:
        if self.cfg.precision != "fp16":
            return
        self._good_steps += 1
        if self._good_steps % self.cfg.loss_scale.growth_interval == 0:
            self.loss_scale *= 2

    # -- state, stats, close ---------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{parameter name: fp32 master weight} for every name the model uses (tied names included).
        Frozen parameters have no master: their stored weights are returned upcast to fp32. With
        delayed_update, the last accepted update is not in them until flush()."""
        return dict(self.state_items())

    def state_items(self):
        """(name, fp32 tensor) for every parameter name, one unit at a time (full_state_dict's content
        without holding the whole model at once)."""
        self._check_open("state_items()")
        names: dict = {}
        for n, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(p, []).append(n)
        for unit in self.units:
            for slot, value in unit_values(self, unit):
                for n in names[slot.param]:
                    yield n, value

    def _mark_step(self) -> None:
        """Per-step telemetry: what moved and how long compute stalled since the previous step."""
        now = self.telemetry.snapshot()
        self._last_step = _delta(now, self._step_mark)
        self._step_mark = now

    def start_trace(self) -> None:
        """Starts recording a timeline (compute, copy streams, NVMe I/O, CPU Adam); see save_trace."""
        self.telemetry.start_trace()

    def save_trace(self, path: str) -> None:
        """Writes the timeline recorded since start_trace() as Chrome/Perfetto trace JSON."""
        self.telemetry.save_trace(path)

    def stats(self) -> dict:
        snap = self.telemetry.snapshot()
        tiers = self.tiers.stats()
        if self.store is not None:
            used = self.store.disk_bytes  # lists the run directory: read once
            tiers["nvme"]["used_bytes"] = used
            tiers["nvme"]["peak_bytes"] = max(tiers["nvme"]["peak_bytes"], used)
        return {"step": self.step_count, "tiers": tiers, **snap, "last_step": self._last_step,
                "loss_scale": self.loss_scale, "skipped_steps": self.skipped_steps}

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"engine is closed: {what} needs a live engine (its buffers and swap files are "
                               "gone); create a new one with offload.initialize")

    def close(self) -> None:
        """Stops the engine's threads, returns its memory and budgets, removes its swap files. Idempotent.

        Works after any error out of forward, backward or step: each part is closed even when another
        fails, and such a failure is logged, not raised (the error that mattered was raised when it
        happened). An interrupt arriving while closing (Ctrl-C, offload.Stopped) is not held back."""
        if self._closed:
            return
        self._closed = True
        for h in getattr(self, "_handles", []) + getattr(self, "_grad_hooks", []):
            h.remove()
        # streams first: their queued jobs finish before the handles and the pool they use go away
        parts = [getattr(self, name, None) for name in ("h2d", "d2h", "reader")]
        parts += [h for h in self.weights + self.states if h is not None]  # None: initialization stopped there
        parts += [getattr(self, "staging", None), getattr(self, "store", None)]
        for part in parts:
            if part is None:
                continue
            try:
                part.close()
            except Exception as e:  # noqa: BLE001  (the next parts must still close)
                log.warning("offload: close: %s: %s: %s; closing the rest", getattr(part, "name", type(part).__name__),
                            type(e).__name__, e)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_unsupported(cfg: Config) -> None:
    """Say so, rather than train something else than asked."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(f"zero_stage={cfg.zero_stage}: training over {dist.get_world_size()} ranks is not "
                         "implemented yet (each rank would train alone); run a single process")
    if cfg.precision != "fp16" and cfg.loss_scale != LossScaleConfig():
        log.warning("offload: loss_scale is ignored with precision=%s (it applies to fp16 only)", cfg.precision)


def _delta(now: dict, before: dict) -> dict:
    links = {k: {"bytes": v["bytes"] - before["links"][k]["bytes"], "seconds": v["seconds"] - before["links"][k]["seconds"]}
             for k, v in now["links"].items()}
    stall = now["stall_seconds"] - before["stall_seconds"]
    return {"links": links, "stall_seconds": stall, "overlap_fraction": overlap_fraction(links, stall)}


def lr_factor(sched, step: int) -> float:
    """The schedule's multiplier of the base lr for optimizer step `step` (0-based)."""
    if sched.warmup_steps and step < sched.warmup_steps:
        return (step + 1) / sched.warmup_steps
    if sched.type == "constant":
        return 1.0
    progress = min(1.0, (step - sched.warmup_steps) / max(1, sched.total_steps - sched.warmup_steps))
    shape = 1 - progress if sched.type == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return sched.min_ratio + (1 - sched.min_ratio) * shape
