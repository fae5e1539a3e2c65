"""The kind of step a micro-step takes, chosen once per micro-step by one function the placement uses too.

[Note: step modes]
    PLAIN       the gradients accumulate; step() runs every trainable unit's windows after the backward
    OVERLAPPED  the last micro-step of a window with overlap_step: each unit is stepped on the d2h thread as
                soon as its gradient is final, during the backward (no accumulator outlives it)
    SPLIT       OVERLAPPED, but the placement's deferred units ([Note: split step] in offload.step.pipeline) are
                stepped before their next fetch instead
    DELAYED     delayed_update: the update step() accepted is applied unit by unit during the next backward,
                before each unit's accumulator takes the new gradient
Overlapping needs every unit's update known when its gradient is: no clipping (it needs the global norm),
no fp16 loss scaling (an overflow skips the step), no delayed update, and no ZeRO partitioning of the
states over ranks (their windows are reduced and stepped after the backward).
"""

from __future__ import annotations

import enum


class StepMode(enum.Enum):
    PLAIN = "plain"
    OVERLAPPED = "overlapped"
    SPLIT = "split"
    DELAYED = "delayed"

    @property
    def overlapped(self) -> bool:
        """The step runs during this backward (OVERLAPPED or SPLIT)."""
        return self in (StepMode.OVERLAPPED, StepMode.SPLIT)


def overlap_allowed(cfg, sharded: bool) -> bool:
    """Whether the last micro-step of an accumulation window may step its units during the backward."""
    return (cfg.overlap_step and not cfg.delayed_update and cfg.gradient_clipping == 0 and cfg.precision != "fp16"
            and not sharded)


def every_step_overlapped(cfg, sharded: bool) -> bool:
    """Every micro-step is OVERLAPPED or SPLIT: no gradient accumulator outlives a backward (the placement
    plans none on nvme)."""
    return cfg.gradient_accumulation_steps == 1 and overlap_allowed(cfg, sharded)


def step_mode(cfg, sharded: bool, micro_step: int, pending_update: bool, deferred_units) -> StepMode:
    """The mode of the micro-step about to run its backward (module note)."""
    gas = cfg.gradient_accumulation_steps
    if micro_step % gas == gas - 1 and overlap_allowed(cfg, sharded):
        return StepMode.SPLIT if deferred_units else StepMode.OVERLAPPED
    return StepMode.DELAYED if pending_update else StepMode.PLAIN
