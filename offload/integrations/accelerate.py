"""Accelerate training loops through the offload engine: the smallest wrapper.

    accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision="bf16")
    engine, optimizer = offload.integrations.accelerate.prepare(accelerator, model, offload_config=cfg)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=10, num_training_steps=100)
    engine, optimizer, loader, scheduler = accelerator.prepare(engine, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(engine):
            loss = engine(**batch).loss
            accelerator.backward(loss)      # engine.backward
            optimizer.step()                # engine.step(), at the accumulation boundary
            scheduler.step()
            optimizer.zero_grad()           # nothing to do: the engine clears gradients at its step
"""

from __future__ import annotations

import torch

from offload.integrations import common

# [Note: meeting Accelerate where it lets us]
# Accelerate has no plugin point for another training backend (its DistributedType is a closed enum), so
# the wrapper uses what it passes through: objects marked `_is_accelerate_prepared` come back from
# `accelerator.prepare` untouched (no autocast, no device move, no DDP, no AcceleratedOptimizer), and the
# returned optimizer is a torch Optimizer whose step is the engine's, so LR schedulers, AcceleratedScheduler
# and Trainer drive it as any other. What cannot be reached that way is `accelerator.backward`, which would
# call `loss.backward()` and bypass the engine's backward; `route` replaces it (and `clip_grad_norm_`,
# which would see no gradients: they live in the engine's accumulators) on that one accelerator object.
# `save_state` would gather the whole model into memory as a state dict (the engine's) and then ask the
# optimizer for a torch state dict, which lives in the engine's tiers: `route` replaces save_state and
# load_state too, with a refusal that points at engine.save_checkpoint / load_checkpoint (the weights,
# optimizer states, counters and RNG, streamed from their tiers; docs/checkpoints.md).
#
# Settings: the Accelerator owns gradient accumulation and precision (`mixed_precision`), the optimizer's
# param_groups own the learning rate (set it with any torch LR scheduler); the offload config says where
# states live, and its Adam hyperparameters apply (offload/integrations/common.py).

PRECISIONS = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}  # Accelerate's mixed_precision -> ours
USE_ENGINE_CHECKPOINTS = ("the optimizer's states live in the offload engine's tiers: engine.save_checkpoint(dir) "
                          "saves them with the weights, step count, loss scale and RNG, and "
                          "engine.load_checkpoint(dir) resumes exactly (docs/checkpoints.md)")


class EngineOptimizer(torch.optim.Optimizer):
    """The engine's optimizer step as a torch Optimizer, for what drives one (Trainer, Accelerate, LR
    schedulers). param_groups[0]["lr"] is the learning rate; it reaches the engine at every backward (with
    overlap_step the engine steps units during a window's last backward) and step."""

    _is_accelerate_prepared = True   # accelerator.prepare returns it untouched (module note)

    def __init__(self, engine):
        # The group holds the model's parameters only so that code reading param_groups finds them; the
        # values live in the engine's tiers (these are placeholders between uses).
        params = [p for p in engine.module.parameters() if p.requires_grad]
        super().__init__(params, {"lr": engine.lr})
        self.engine = engine
        self.step_was_skipped = False  # read by Accelerate (AcceleratedScheduler, optimizer_step_was_skipped)

    @property
    def optimizer(self):
        """Itself: what Accelerate reads as an optimizer wrapper's inner optimizer (prepare_scheduler)."""
        return self

    def _push_lr(self) -> None:
        self.engine.lr = float(self.param_groups[0]["lr"])

    def backward(self, loss: torch.Tensor) -> None:
        self._push_lr()
        self.engine.backward(loss)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("step(closure): not supported by the offload engine; compute the loss before step()")
        self._push_lr()
        self.step_was_skipped = not self.engine.step()  # between accumulation boundaries, or an fp16 overflow
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the engine clears gradients at its step."""

    def state_dict(self):
        raise NotImplementedError(f"optimizer.state_dict(): not available; {USE_ENGINE_CHECKPOINTS}")

    def load_state_dict(self, state_dict) -> None:
        raise NotImplementedError(f"optimizer.load_state_dict(): not available; {USE_ENGINE_CHECKPOINTS}")


def route(accelerator, optimizer: EngineOptimizer) -> None:
    """Sends `accelerator.backward` to the engine, and refuses `accelerator.clip_grad_norm_` and
    save_state/load_state before they gather, write or read anything (module note)."""
    engine = optimizer.engine

    def refuse_state(*_, **__):
        raise NotImplementedError("accelerator.save_state/load_state: not supported with the offload engine; "
                                  f"{USE_ENGINE_CHECKPOINTS}. Save your LR scheduler's state_dict() beside it")

    def backward(loss, **kwargs):
        if kwargs:
            raise ValueError(f"accelerator.backward(loss, {', '.join(kwargs)}=...): not supported with the offload "
                             "engine; call accelerator.backward(loss)")
        # Accelerate would backpropagate loss / its gradient_accumulation_steps; the engine divides by its
        # own: hand it the loss that makes the gradients the ones Accelerate would produce.
        factor = engine.cfg.gradient_accumulation_steps / accelerator.gradient_accumulation_steps
        optimizer.backward(loss * factor if factor != 1 else loss)

    def clip_grad_norm_(parameters, max_norm, norm_type=2):
        raise ValueError(f"accelerator.clip_grad_norm_(max_norm={max_norm}): the gradients live in the offload "
                         "engine, which clips in its step; set gradient_clipping in the offload config (the norm "
                         "before clipping is engine.last_grad_norm after the step)")

    accelerator.backward = backward
    accelerator.clip_grad_norm_ = clip_grad_norm_
    accelerator.save_state = accelerator.load_state = refuse_state


def prepare(accelerator, model: torch.nn.Module, offload_config=None):
    """(engine, optimizer) for an Accelerate loop (module docstring): an offload Engine over `model` and its
    EngineOptimizer; `accelerator.prepare` passes both through, and `accelerator.backward` reaches the
    engine. offload_config: an offload.Config, a dict, a .json/.yaml path, or a DeepSpeed JSON config."""
    import offload

    if accelerator.num_processes > 1:
        raise ValueError(f"accelerator.num_processes={accelerator.num_processes}: the offload engine trains on "
                         "one process (ZeRO over ranks is not implemented yet); launch one process")
    precision = PRECISIONS.get(str(accelerator.mixed_precision))
    if precision is None:
        raise ValueError(f"Accelerator(mixed_precision={accelerator.mixed_precision!r}): not supported by the "
                         "offload engine; use 'no', 'bf16' or 'fp16'")
    gas = accelerator.gradient_accumulation_steps
    cfg = common.with_owned(common.settings(offload_config), {
        "gradient_accumulation_steps": (gas, f"Accelerator(gradient_accumulation_steps={gas})"),
        "precision": (precision, f"Accelerator(mixed_precision={accelerator.mixed_precision!r})"),
    }, owner="Accelerator", lr_from="the optimizer's param_groups[0]['lr'] (a torch LR scheduler sets it)")
    engine = offload.initialize(model, config=cfg)
    engine._is_accelerate_prepared = True  # accelerator.prepare returns it untouched (module note)
    optimizer = EngineOptimizer(engine)
    route(accelerator, optimizer)
    return engine, optimizer
