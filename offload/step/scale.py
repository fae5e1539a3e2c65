"""What scales a step's update: the learning-rate schedule and fp16's dynamic loss scale."""

from __future__ import annotations

import logging
import math

from offload.plan.config import LRScheduleConfig
from offload.state.runtime import StepSettings

log = logging.getLogger("offload")


class LossScale:
    """fp16's dynamic loss scale (1 otherwise): halved when a step's gradients overflow (the step is skipped),
    doubled after loss_scale.growth_interval good steps."""

    def __init__(self, settings: StepSettings):
        self.value = settings.loss_scale.initial if settings.precision == "fp16" else 1.0
        self.good_steps = self.skipped_steps = 0

    def overflow(self, settings: StepSettings, step_count: int) -> None:
        if settings.precision != "fp16":
            raise FloatingPointError(f"gradients are not finite at step {step_count + 1} ({settings.precision}); "
                                     "lower the learning rate or enable gradient_clipping")
        self.value = max(self.value / 2, settings.loss_scale.min_scale)
        self.skipped_steps += 1
        self.good_steps = 0
        log.info("offload: fp16 overflow, step skipped; loss scale now %g", self.value)

    def good_step(self, settings: StepSettings) -> None:
        if settings.precision != "fp16":
            return
        self.good_steps += 1
        if self.good_steps % settings.loss_scale.growth_interval == 0:
            self.value *= 2


def lr_factor(sched: LRScheduleConfig, step: int) -> float:
    """The schedule's multiplier of the base lr for optimizer step `step` (0-based)."""
    if sched.warmup_steps and step < sched.warmup_steps:
        return (step + 1) / sched.warmup_steps
    if sched.type == "constant":
        return 1.0
    progress = min(1.0, (step - sched.warmup_steps) / max(1, sched.total_steps - sched.warmup_steps))
    shape = 1 - progress if sched.type == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return sched.min_ratio + (1 - sched.min_ratio) * shape
