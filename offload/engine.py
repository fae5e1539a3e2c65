"""The Engine: trains a torch module with its weights and optimizer states in hbm, dram or nvme.

Data flow of one step (docs/design.md): forward fetches each unit before it runs (prefetching the next ones
along the recorded trace) and releases it after; backward fetches again, and each unit's gradients go
hbm -> dram on the d2h copy stream into an fp32 accumulator as soon as they are final; step() runs CPU
Adam unit by unit over states streamed from their tier, writing new weights straight to the weight tier.
"""

from __future__ import annotations

import logging
import math
import sys
import weakref
from dataclasses import replace

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from offload import handback
from offload.checkpoint import loading, saving
from offload.checkpoint.background import BackgroundSave
from offload.checkpoint.format import CheckpointError
from offload.checkpoint import state_dict as state_dicts
from offload.checkpoint.values import unit_values
from offload.kernels import cpu_adam
from offload.plan import quantized
from offload.plan.activation_memory import activation_model, batch_shape
from offload.plan.attention import attention_line
from offload.plan.config import Config, LossScaleConfig, load_config
from offload.plan.placement import (Placement, PlacementError, activations_advice, check_split_master,
                                    fits_with_activations, plan_placement)
from offload.plan.precision import resolve_precision
from offload.plan.units import Unit, forward_order, partition
from offload.scheduler.policy import ResidencyPolicy
from offload.scheduler.trace import ExecutionTrace
from offload.state.activation_tier import InputTier
from offload.state.materialize import materialize
from offload.state.optim import OptimState
from offload.state.residency import WeightHandle
from offload.state.runtime import Runtime
from offload.step import hooks
from offload.step.activations import Checkpointing, UnitInputs, no_cache
from offload.step.generation import contiguous_head, serve_generate
from offload.step.pipeline import EngineClosed, Phase, StepPipeline
from offload.step.prefetch import agreed_policy
from offload.swap.buffers import map_large_allocations, release_large_allocations

log = logging.getLogger("offload")
_WRAPPED: weakref.WeakSet = weakref.WeakSet()  # models an Engine has taken over: their parameters are placeholders


class Engine(nn.Module):
    """Wraps `model`; see offload.initialize. Use as `engine(batch)`, `engine.backward(loss)`, `engine.step()`.

    Besides its methods and properties, its public fields are PUBLIC_FIELDS: what the modules around it
    (materialize, checkpoint, the integrations) work through: the runtime `rt`, the units and their handles
    (`weights`, `states`), the step's `pipeline` and `prefetcher`, the checkpointed units' inputs
    (`unit_inputs`); nothing reaches its other attributes (tests/test_layering.py)."""

    PUBLIC_FIELDS = ("module", "cfg", "device", "precision", "placement", "units", "rt", "weights", "states",
                     "pipeline", "prefetcher", "weights_source", "checkpoint_run_id", "unit_inputs")

    def __init__(self, model: nn.Module, config: Config | dict | str | None = None, weights=None):
        super().__init__()
        self.weights_source = weights  # name -> tensor; initial values instead of the model's own
        cfg = load_config(config)
        if not any(True for _ in model.parameters()):
            raise ValueError("model: has no parameters; offload trains parameters, pass the model to train")
        if model in _WRAPPED:
            raise ValueError("model: already wrapped by an offload engine (open or closed), so its parameters are "
                             "that engine's empty placeholders, not values; build the model again (or deepcopy it "
                             "before the first initialize); to go on from the earlier engine's values, load its "
                             "state_dict(), taken before its close(), into the new engine: load_state_dict(sd)")
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.precision = resolve_precision(cfg.precision, self.device, warn=True)  # "auto" chosen for this device
        if self.device.type == "cpu":  # activations live in host memory: freed ones must leave RSS (swap.buffers)
            map_large_allocations()  # counted: close() releases it
            self._large_allocations = True
        check_split_master(cfg, self.precision)  # before replace() validates the resolved precision
        cfg = replace(cfg, precision=self.precision.name)  # everything below sees the precision that runs
        self.cfg, self.module = cfg, model
        self.rank, self.world = _check_unsupported(cfg)
        self.dtype = cfg.compute_dtype
        if cfg.quantize_base is not None:
            quantized.quantize_base(model, cfg.quantize_base, self.dtype)
        self._inference = quantized.InferenceKernel(model)  # [Note: the CPU inference repack] in offload.plan.quantized
        self.units: list[Unit] = partition(model, cfg.units.min_numel, cfg.units.classes,
                                               itemsize=self.dtype.itemsize)
        self.placement: Placement = plan_placement(self.units, cfg, self.device, order=forward_order(model, self.units),
                                                   world=self.world, rank=self.rank, precision=self.precision,
                                                   activations=activation_model(model, cfg, self.device))
        self._batches = BatchCheck(self.placement, self.device)  # what a batch must be to run
        self.rt = rt = Runtime.open(cfg, self.device, self.placement, self.rank, self.world)
        agree = (lambda values, op: rt.ranks.agree(values, op, "all_reduce: the trace to replay")
                 ) if self.placement.weight_owners else None  # [Note: collective order] in offload.state.ranks
        self.trace = ExecutionTrace(self.placement.knobs.prefetch_units, agree=agree)
        self._closed = self._kept = False
        self._saving: BackgroundSave | None = None  # a background checkpoint in flight
        self.checkpoint_run_id: str | None = None  # the run its checkpoints belong to (offload.checkpoint.saving.run_id)
        self.weights: list[WeightHandle | None] = [None] * len(self.units)  # filled by materialize
        self.states: list[OptimState | None] = [None] * len(self.units)
        _WRAPPED.add(model)  # from here on its parameters become the engine's placeholders
        self._host_cache = False
        try:
            materialize(self)
            # activations in host memory: freed ones kept for the next step's, about what was live at once in
            # training (opened after materialize: its per-unit values, as large as a unit in fp32, are not kept)
            self._host_cache = self.device.type == "cpu" and cpu_adam.open_host_cache()
        except BaseException:
            self.close()
            raise
        lookahead, distance, reuse, reserve, room = agreed_policy(self.placement, rt.tiers.acct["hbm"],
                                                                  rt.gather is not None, rt.ranks.agree)
        self.trace.lookahead = lookahead
        policy = ResidencyPolicy(self.trace, [w.nbytes for w in self.weights], distance, reuse, reserve,
                                 self.placement.knobs.held)
        self.pipeline = StepPipeline(rt, self.units, self.weights, self.states, self.trace, policy, room)
        self.prefetcher = self.pipeline.prefetch
        self._handles = [h for u in self.units if not u.persistent for m in [u.module, *u.users]
                         for h in hooks.register(self.prefetcher, self.weights[u.index], rt, u, m)]
        if self.device.type == "cpu":  # [Note: the prefill's last positions] in offload.step.generation
            self._handles += contiguous_head(model)
        self._grad_hooks = [s.param.register_post_accumulate_grad_hook(self.pipeline.grads.hook(u))
                            for u in self.units for s in u.slots if s.trainable]
        tier = cfg.offload_activations.device  # [Note: kept inputs in a tier] in offload.state.activation_tier
        self.unit_inputs = UnitInputs(InputTier(rt, tier, self.placement.knobs.prefetch_units) if tier != "none"
                                      else None)  # [Note: activation checkpointing] in offload.step.activations
        self._checkpointing = (Checkpointing(self.units, self.unit_inputs, lambda: self.pipeline.in_backward)
                               if cfg.activation_checkpointing else None)
        self._guards = state_dicts.guard_module(model)  # model.state_dict() would read placeholders
        unserve = [_serve_save_pretrained(self, model), serve_generate(self, model)]
        self._unserve = lambda: [undo() for undo in unserve]
        log.info("%s", self.placement.describe())
        # On stderr, where a user sees it: a training script's logging may show no INFO. Over ranks rank 0
        # prints it alone (the others' differ only in their own budgets; their logs have it at INFO).
        lines = [self.placement.summary(), *(f"  {line}" for line in activation_lines(self._checkpointing, self.unit_inputs, model,
                                                                              self.device, self.dtype))]
        if self.store is not None:
            lines.append(f"  {self.store.describe()}")
        if self.rank == 0:
            print("offload: memory plan (per tier: need of budget; the runtime's parts)\n" + "\n".join(lines),
                  file=sys.stderr, flush=True)

    # -- forward ------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self._batches.check(args, kwargs)
        before = self.pipeline.begin_forward()
        if before is not Phase.BACKWARD:
            self.prefetcher.release_carried()
            self.trace.begin_step()
        args, kwargs = cast_inputs(args, kwargs, self.dtype)
        if self._checkpointing is not None and torch.is_grad_enabled():
            kwargs = no_cache(self.module, kwargs)  # [Note: activation checkpointing] in offload.step.activations
        mark = self.unit_inputs.mark()
        try:
            out = self.module(*args, **kwargs)
        except BaseException:
            self.unit_inputs.drop_all(after=mark)  # its graph is spent, however long its traceback lives
            self.pipeline.forward_failed(before)  # [Note: failure semantics] in offload.step.pipeline
            raise
        if not self.placement.trainable_numel:  # a frozen model: no backward follows ([Note: phases])
            self.pipeline.end_forward()
        return out

    # -- backward and step: the step pipeline (offload.step.pipeline) -----------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError("loss: backward() needs a scalar tensor that requires grad (the output of "
                             "the engine's forward reduced to one number)")
        self.unit_inputs.ahead_of_backward()
        try:
            self.pipeline.backward(loss)
        except BaseException:
            self.unit_inputs.drop_all()  # the graph is spent: the kept inputs it still holds are freed now
            raise

    def step(self) -> bool:
        """The optimizer step at the accumulation boundary (a no-op between boundaries); clears grads.
        Returns True when parameters were updated (False: between boundaries, or an fp16 overflow)."""
        stepped = self.pipeline.step()
        self.prefetcher.ahead_of_step()
        saving, self._saving = self._saving, None  # a background checkpoint: published (or its failure raised) here
        if saving is not None and not saving.poll():
            self._saving = saving
        return stepped

    def flush(self) -> None:
        """delayed_update: applies the accepted update that would land during the next backward, now
        (at the end of training, before reading or saving the weights); split_step: the steps waiting for
        their units' next fetch (reads and saves apply those themselves). A no-op otherwise."""
        self.pipeline.flush()

    @property
    def lr(self) -> float:
        """The learning rate of the next optimizer step."""
        return self.pipeline.lr

    @lr.setter
    def lr(self, value: float) -> None:
        """Sets the learning rate of the next optimizer steps in place of lr_schedule's, for a scheduler
        outside the engine (Trainer's, a torch LR scheduler). Set it before the accumulation window's last
        backward: with overlap_step, units are stepped during that backward."""
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"lr={value!r}: must be a finite number >= 0; pass the learning rate to use")
        self.pipeline.lr_value = float(value)

    # the runtime's parts, for scripts and tests (the modules around the engine use rt: PUBLIC_FIELDS)
    tiers = property(lambda self: self.rt.tiers, doc="the tiers' accountants and allocators")
    telemetry = property(lambda self: self.rt.telemetry, doc="links, stalls, the timeline")
    staging = property(lambda self: self.rt.staging, doc="the dram chunk pool")
    store = property(lambda self: self.rt.store, doc="the swap store (None without nvme)")
    chunk_numel = property(lambda self: self.rt.chunk_numel, doc="elements per chunk (offload.plan.chunks)")
    step_count = property(lambda self: self.pipeline.step_count, doc="optimizer steps taken")
    micro_step = property(lambda self: self.pipeline.micro_step, doc="backwards since the last step")
    loss_scale = property(lambda self: self.pipeline.scale.value, doc="fp16's dynamic loss scale (1 otherwise)")
    skipped_steps = property(lambda self: self.pipeline.scale.skipped_steps, doc="fp16 overflows")
    last_grad_norm = property(lambda self: self.pipeline.last_grad_norm,
                              doc="the global gradient norm of the last step (None when stepped in backward)")
    phase = property(lambda self: self.pipeline.phase, doc="offload.step.pipeline.Phase")

    # -- state, stats, close ---------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{parameter name: fp32 master weight} for every name the model uses (tied names included).
        Frozen parameters have no master: their stored weights are returned upcast to fp32. With
        delayed_update, the last accepted update is not in them until flush()."""
        return dict(self.state_items())

    def state_items(self, trainable_only: bool = False):
        """(name, fp32 tensor) for every parameter name, one unit at a time (full_state_dict's content
        without holding the whole model at once); trainable_only: the trainable parameters' masters alone,
        reading no frozen weight (a LoRA adapter's values without its base)."""
        self.pipeline.check_usable("reading the weights")
        self.pipeline.deferred.finish()  # [Note: split step] in offload.step.pipeline
        names: dict = {}
        for n, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(p, []).append(n)
        for unit in self.units:
            if trainable_only and not unit.trainable_numel:
                continue
            for slot, value in unit_values(self.rt, self.weights[unit.index], self.states[unit.index],
                                           frozen=not trainable_only):
                for n in names[slot.param]:
                    yield n, value

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """{name: fp32 master} of the trainable parameters only (what a PEFT adapter holds), without reading
        the frozen weights; over ranks call it on every rank."""
        return dict(self.state_items(trainable_only=True))

    def state_dict(self, *, destination=None, prefix: str = "", keep_vars: bool = False,
                   sharded: bool = False) -> dict:
        """The wrapped module's state_dict() keys (no "module." prefix) with real CPU tensors from every
        tier: fp32 masters (frozen parameters upcast), like FSDP's full state dict; persistent buffers.
        Holds the whole model in memory: for a large one use save_checkpoint(). Over ranks call it on every
        rank; sharded=True: each parameter a DTensor holding this rank's dim-0 slice, like FSDP2's sharded
        state dict, for torch.distributed.checkpoint ([Note: sharded state dicts] in offload.checkpoint.state_dict).
        keep_vars: no effect."""
        sd = state_dicts.state_dict(self, prefix, sharded)
        if destination is None:
            return sd
        destination.update(sd)
        return destination

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Writes the values into the weights' and masters' homes (optimizer moments untouched), with
        torch's `strict` semantics; checks names and shapes before writing anything. Takes a full or a
        sharded state dict (DTensors, gathered a unit at a time: then call it on every rank). assign: no
        effect."""
        _finish_save(self)
        return state_dicts.load_state_dict(self, state_dict, strict)

    def save_checkpoint(self, directory: str, name: str | None = None, keep: int | None = None,
                        extra: dict | None = None, background: bool = False):
        """Writes everything needed to continue exactly to <directory>/<name> (default step<N>), atomically,
        then points <directory>/latest at it and keeps the newest `keep`; `extra`: your JSON state, returned
        by load_checkpoint. With delayed_update the pending update is saved, not applied. Between steps
        only (also between the micro-steps of an accumulation window). Returns the path. See
        offload.checkpoint.saving for what it holds. Over several ranks (zero_stage 0, every rank holding the same
        states) call it on every rank: rank 0 writes, the others wait for it; zero_stage 1-3 over ranks: every
        rank writes the states it holds ([Note: ranks] in offload.checkpoint.saving).
        background=True: returns at once a handle (wait() -> the path, done() -> bool) while training goes on;
        the checkpoint holds this step boundary's state ([Note: background saves] in
        offload.checkpoint.background). A save waits for the one in flight first."""
        _finish_save(self)
        if background:
            self._saving = BackgroundSave(self, directory, name, keep, extra)
            return self._saving
        return saving.save(self, directory, name, keep, extra)

    def load_checkpoint(self, path: str) -> dict:
        """Loads a checkpoint (a checkpoint directory, or a directory whose `latest` names one) into this
        engine, whatever its placement; verifies names, shapes and checksums before changing anything.
        Returns the checkpoint's `extra`. Over several ranks every rank calls it; it may have been saved at
        another world size or zero_stage."""
        _finish_save(self)
        return loading.load(self, path)

    def start_trace(self) -> None:
        """Starts recording a timeline (compute, copy streams, NVMe I/O, CPU Adam); see save_trace."""
        self.telemetry.start_trace()

    def save_trace(self, path: str) -> None:
        """Writes the timeline recorded since start_trace() as Chrome/Perfetto trace JSON."""
        self.telemetry.save_trace(path)

    def stats(self) -> dict:
        activations = self.unit_inputs.stats()  # first: it frees the kept inputs autograd let go of
        snap = self.telemetry.snapshot()
        tiers = self.tiers.stats()
        swap = None
        if self.store is not None:
            swap = self.store.where()  # the unlinked data file: its directory, /proc path and bytes
            tiers["nvme"]["used_bytes"] = swap["disk_bytes"]
            tiers["nvme"]["peak_bytes"] = max(tiers["nvme"]["peak_bytes"], swap["disk_bytes"])
        return {"step": self.step_count, "tiers": tiers, **snap, "last_step": self.pipeline.stats.last,
                "loss_scale": self.loss_scale, "skipped_steps": self.skipped_steps, "swap": swap,
                "activations": {"checkpointed_units": len(self._checkpointing.units) if self._checkpointing else 0,
                                **activations}}

    def close(self, keep_weights: bool = False) -> None:
        """Frees pinned memory, stops the threads and removes the swap files; also after an error (it does
        not raise what was already raised). Idempotent. Afterwards the model's parameters are empty and any
        use of the model raises EngineClosed, unless keep_weights: then the trained weights (after flush(); the
        compute dtype, quantized ones as bitsandbytes stores them) go back into the model's own parameters
        first, and it runs in plain PyTorch, as the engine's forward did (offload.handback: refused, with
        nothing freed, when they do not fit the RAM available; over ranks every rank calls it)."""
        if self._closed:
            if keep_weights and not self._kept:
                raise EngineClosed("close(keep_weights=True): this engine was closed without keep_weights and its "
                                   "weights are gone; load a saved directory or checkpoint")
            return
        try:
            _finish_save(self)  # a background checkpoint in flight is finished first
            failed = None
        except Exception as e:  # raised once the engine is closed
            failed = e
        kept = handback.take(self) if keep_weights else None
        self._closed, self._kept = True, kept is not None
        for h in getattr(self, "_handles", []) + getattr(self, "_grad_hooks", []):
            h.remove()
        if getattr(self, "_checkpointing", None) is not None:
            self._checkpointing.close()
        if getattr(self, "unit_inputs", None) is not None:
            self.unit_inputs.drop_all()
        if getattr(self, "pipeline", None) is not None:
            self.pipeline.close()
        if getattr(self, "rt", None) is not None:
            self.rt.close(self.weights + self.states)
        if getattr(self, "_host_cache", False):
            cpu_adam.close_host_cache()
        if getattr(self, "_large_allocations", False):
            release_large_allocations()
        if getattr(self, "_inference", None) is not None:
            self._inference.close(restore=kept is not None)
        for h in getattr(self, "_guards", []):
            h.remove()
        if kept is None:
            self._guards = state_dicts.guard_module(self.module, closed=True)
        else:
            self._guards = []
            handback.give(self, kept)
            self._unserve()
            _WRAPPED.discard(self.module)
        if failed is not None:
            raise failed

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
            return
        try:  # an error is on its way out: a background checkpoint's failure is said, not raised over it
            self.close()
        except CheckpointError as e:
            log.warning("offload: close: %s", e)


def _finish_save(engine: Engine) -> None:
    """Waits for the engine's background checkpoint in flight, if any (its failure raised here, once)."""
    saving, engine._saving = getattr(engine, "_saving", None), None
    if saving is not None:
        saving.wait()


def activation_lines(checkpointing: Checkpointing | None, unit_inputs: UnitInputs, model: nn.Module,
                     device: torch.device, dtype: torch.dtype) -> list[str]:
    """The plan's lines on what the forward keeps: the checkpointed units, the attention that runs."""
    lines = []
    if checkpointing is not None:
        tier = unit_inputs.tier
        where = (f"; the inputs wait in {tier.where}, back ahead of their backward" if tier is not None else "")
        lines.append(f"activations: {len(checkpointing.units)} units checkpointed (each keeps its inputs, "
                     f"its forward runs again in its backward){where}")
    attention = attention_line(model, device, dtype)
    return lines + ([attention] if attention else [])


def cast_inputs(args, kwargs, dtype: torch.dtype):
    """Floating-point inputs take the compute dtype (as FSDP's MixedPrecision cast_forward_inputs)."""
    flat, spec = tree_flatten((args, kwargs))
    flat = [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in flat]
    return tree_unflatten(flat, spec)


class BatchCheck:
    """What a batch must be to run: on the model's device, and with activations that fit the plan."""

    def __init__(self, placement: Placement, device: torch.device):
        self.placement, self.device = placement, device
        self.checked = placement.activation_shape  # the largest batch shape known to fit

    def check(self, args, kwargs) -> None:
        for t in [*args, *kwargs.values()]:
            if isinstance(t, torch.Tensor) and t.device.type != self.device.type:
                raise ValueError(f"batch tensor on {t.device}: the model runs on {self.device}; "
                                 f"move the batch with .to(engine.device)")
        self.check_activations(args, kwargs)

    def check_activations(self, args, kwargs) -> None:
        """Refuses, before it runs, a batch whose activations by formula (offload.plan.activation_memory) do not fit
        beside the rest of the plan; a shape no larger than one already checked or planned is not checked again,
        nor a forward without grad (it keeps nothing for a backward)."""
        p, shape = self.placement, batch_shape(args, kwargs)
        if shape is None or p.activations is None or p.activations.dims is None or not torch.is_grad_enabled():
            return
        checked = self.checked
        if checked is not None and shape[0] <= checked[0] and shape[1] <= checked[1]:
            return
        if not fits_with_activations(p, p.base_need, p.activations, *shape):
            plan = ("set activations: {\"batch\", \"seq\"} in the config to plan them (the plan gives up optional "
                    "parts to make room), " if p.activation_shape is None else "")
            raise PlacementError(f"batch {shape[0]} x seq {shape[1]}: does not fit the memory plan; "
                                 f"{activations_advice(p, *shape, p.base_need)}; {plan}use shorter or fewer "
                                 f"sequences, or raise the budgets")
        self.checked = shape if checked is None else (max(shape[0], checked[0]), max(shape[1], checked[1]))


def _serve_save_pretrained(engine: "Engine", model: nn.Module):
    """`model.save_pretrained(dir)` (a PEFT or transformers model) writes the engine's values: the model's own
    state_dict() would read placeholders (state_dicts.guard_module refuses it). A PEFT model gets the
    trainable parameters only (its adapter: no frozen base weight is read), a transformers model the whole
    state_dict(). An explicit state_dict= is passed through as given. Returns what puts the model's own back."""
    original = getattr(model, "save_pretrained", None)
    if not callable(original):
        return lambda: None
    adapter = hasattr(model, "peft_config")
    ref = weakref.ref(engine)

    def save_pretrained(save_directory, *args, **kwargs):
        eng = ref()
        if "state_dict" not in kwargs:
            if eng is None or eng._closed:
                raise EngineClosed(f"save_pretrained: {state_dicts.CLOSED}")
            kwargs["state_dict"] = eng.trainable_state_dict() if adapter else eng.state_dict()
        return original(save_directory, *args, **kwargs)

    save_pretrained.__doc__ = original.__doc__
    own = model.__dict__.get("save_pretrained")  # an attribute of the instance before ours, put back

    def unserve() -> None:
        if own is None:
            model.__dict__.pop("save_pretrained", None)
        else:
            model.save_pretrained = own

    model.save_pretrained = save_pretrained
    return unserve


def _check_unsupported(cfg: Config) -> tuple[int, int]:
    """Say so, rather than train something else than asked. Returns (rank, world size) of the default
    process group (0, 1 without one)."""
    import torch.distributed as dist

    rank, world = 0, 1
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    if world > 1:
        _check_ranks(cfg, world)
    if cfg.precision != "fp16" and cfg.loss_scale != LossScaleConfig():
        log.warning("offload: loss_scale is ignored with precision=%s (it applies to fp16 only)", cfg.precision)
    return rank, world



def _check_ranks(cfg: Config, world: int) -> None:
    """What runs over several ranks: every stage; 1-3 with CUDA tensors have never run over NCCL (they say so)."""
    stage = cfg.zero_stage
    if stage in (1, 2, 3) and torch.cuda.is_available():
        log.warning("offload: zero_stage=%d over %d ranks with CUDA tensors has never run over NCCL or on several "
                    "GPUs (only as gloo ranks on one GPU, bench/gpu_check.py): compare its first losses with "
                    "zero_stage 0's (docs/status.md)", stage, world)
    if stage in (1, 2, 3) and cfg.delayed_update:
        raise ValueError(f"delayed_update=true: not implemented with zero_stage={stage} over {world} ranks yet; "
                         "set it false, or use zero_stage 0")
