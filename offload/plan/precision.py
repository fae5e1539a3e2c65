"""Precision "auto": the compute dtype chosen on the host, from what its compute device runs natively.

[Note: why the host decides]
The same preset is fast in bf16 on one machine and several times slower on the next: a CPU without
native bf16 (AVX2 only, torch's mkldnn bf16 check False) runs bf16 and fp16 matmuls several times slower
than fp32, while one with AMX runs bf16 fastest (figures: bench/RESULTS.md, "Precision auto on a host
without native bf16" and "Figures that code comments carried"). So "auto" (Config's default) asks the
device, once, when the engine starts:
- CUDA with compute capability >= 8.0 (Ampere on): bf16;
- an older GPU: fp16, with dynamic loss scaling (Config.loss_scale);
- a CPU where torch's mkldnn bf16 check holds (AVX512_BF16 or AMX): bf16;
- any other CPU: fp32.
An explicit precision is honoured; where this device does not run it natively one warning line says so
and what "auto" would pick. fp32 is never warned about: it runs everywhere, and choosing it is a choice
of numbers, not a slow path. Master weights and optimizer states are fp32 whatever is chosen.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("offload")

PRECISIONS = ("bf16", "fp16", "fp32")
CHOICES = ("auto", *PRECISIONS)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BF16_CAPABILITY = (8, 0)  # CUDA compute capability from which bf16 runs on tensor cores


def cpu_bf16_native() -> bool:
    """torch's own check that its CPU kernels run bf16 natively (AVX512_BF16 or AMX), as its mkldnn uses it."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:  # a torch built without mkldnn
        return False


def cpu_fp16_native() -> bool:
    """The same for fp16 (AVX512_FP16 or AMX-FP16)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:
        return False


@dataclass(frozen=True)
class Device:
    """What the choice depends on: the compute device's kind, its name, and what it runs natively."""

    kind: str                       # "cpu" | "cuda"
    name: str
    capability: tuple[int, int] | None = None  # CUDA only
    bf16: bool = False
    fp16: bool = False

    @classmethod
    def of(cls, device: torch.device | str | None = None) -> "Device":
        """The facts of `device` (default: the engine's, CUDA's current device when CUDA is available)."""
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cuda":
            cap = tuple(torch.cuda.get_device_capability(device))
            return cls("cuda", torch.cuda.get_device_name(device), cap, bf16=cap >= BF16_CAPABILITY, fp16=True)
        return cls("cpu", "this CPU", None, bf16=cpu_bf16_native(), fp16=cpu_fp16_native())

    def __str__(self) -> str:
        if self.kind == "cuda":
            return f"{self.name} (compute capability {self.capability[0]}.{self.capability[1]})"
        return self.name


def auto_pick(dev: Device) -> tuple[str, str]:
    """(precision, why) that "auto" picks on `dev`; see the module's note."""
    if dev.kind == "cuda":
        if dev.bf16:
            return "bf16", f"{dev} runs bf16 natively"
        return "fp16", f"{dev} has no native bf16 (below 8.0): fp16 with dynamic loss scaling"
    if dev.bf16:
        return "bf16", "this CPU runs bf16 natively (torch's mkldnn bf16 check holds: AVX512_BF16 or AMX)"
    return "fp32", ("this CPU has no native bf16 (torch's mkldnn bf16 check is False: no AVX512_BF16, no AMX), "
                    "where bf16 and fp16 matmuls run several times slower than fp32")


def slow_on(dev: Device, precision: str) -> str | None:
    """Why `precision` is a slow path on `dev` (not run natively), or None."""
    if precision == "fp32" or (dev.bf16 if precision == "bf16" else dev.fp16):
        return None
    if dev.kind == "cpu":
        return (f"this CPU has no native {precision} (torch's mkldnn {precision} check is False): its {precision} "
                f"matmuls run several times slower than fp32's")
    return f"{dev} has no native {precision}: emulated, several times slower"


@dataclass(frozen=True)
class PrecisionChoice:
    """What runs (`name`), what the config asked for, and why, in words for one line."""

    name: str            # "bf16" | "fp16" | "fp32"
    requested: str       # "auto", or the explicit precision
    reason: str
    auto: str            # what "auto" picks on this device
    slow: str | None     # an explicit precision this device does not run natively: why

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    def line(self) -> str:
        """One line for the placement print: what was chosen and why."""
        if self.requested == "auto":
            return f"precision {self.name} (auto: {self.reason})"
        if self.slow:
            return f"precision {self.name} (as configured; slow here: {self.slow}; auto would pick {self.auto})"
        return f"precision {self.name} (as configured; auto would pick {self.auto}: {self.reason})"

    def warning(self) -> str | None:
        """The one warning line for an explicit precision this device runs slowly, or None."""
        if self.slow is None:
            return None
        return (f"offload: warning: precision={self.name} is slow on this host ({self.slow}); "
                f'precision "auto" would pick {self.auto}')


def resolve_precision(requested: str, device: torch.device | str | Device | None = None,
                      warn: bool = False) -> PrecisionChoice:
    """The precision that runs for `requested` ("auto" or explicit) on `device` (default: the engine's).
    warn: log the one warning line when an explicit precision is slow on it."""
    if requested not in CHOICES:
        raise ValueError(f"precision={requested!r}: unknown precision; "
                         'use "bf16", "fp16", "fp32" or "auto" (the default: chosen for the compute device)')
    dev = device if isinstance(device, Device) else Device.of(device)
    auto, why = auto_pick(dev)
    if requested == "auto":
        return PrecisionChoice(auto, "auto", why, auto, None)
    choice = PrecisionChoice(requested, requested, why, auto, slow_on(dev, requested))
    if warn and choice.slow:
        log.warning("%s", choice.warning())
    return choice
