"""Config: frozen, nested dataclasses built from a dict or a JSON/YAML file (the training-script flags that
build one are offload/flags.py's; a DeepSpeed config is read by offload/integrations/deepspeed.py).

Unknown keys are an error naming the key and the nearest valid one (DeepSpeed silently ignores renamed
keys; we refuse them). Every value is validated with a message that says how to fix it.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from dataclasses import dataclass, field
from typing import Any

from offload.integrations import deepspeed
from offload.plan.settings import CHUNK_ALIGN_BYTES, build, fail, read_settings_file

DEVICES = ("none", "cpu", "nvme")
PRECISION_CHOICES = ("auto", "bf16", "fp16", "fp32")  # offload.plan.precision.CHOICES, without importing torch here
STATE_CHOICES = ("fp32", "int8")   # optimizer.states
MASTER_CHOICES = ("fp32", "split")  # optimizer.master



@dataclass(frozen=True)
class OptimizerConfig:
    type: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    states: str = "fp32"   # "int8": blockwise 8-bit exp_avg and exp_avg_sq ([Note: int8 optimizer states])
    master: str = "fp32"   # "split": the bf16 weight plus a 17-bit record ([Note: split master])

    def validate(self, path: str) -> None:
        if self.type not in ("adamw", "adam"):
            fail(f"{path}.type", self.type, "unknown optimizer", 'use "adamw" or "adam"')
        if self.states not in STATE_CHOICES:
            fail(f"{path}.states", self.states, "unknown optimizer states", f"use one of {list(STATE_CHOICES)}")
        if self.master not in MASTER_CHOICES:
            fail(f"{path}.master", self.master, "unknown master", f"use one of {list(MASTER_CHOICES)}")
        if not self.lr >= 0:
            fail(f"{path}.lr", self.lr, "must be >= 0", "pass a non-negative learning rate")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            fail(f"{path}.betas", self.betas, "must be two numbers in [0, 1)", "for example [0.9, 0.999]")
        if not self.eps > 0:
            fail(f"{path}.eps", self.eps, "must be > 0", "for example 1e-8")
        if not self.weight_decay >= 0:
            fail(f"{path}.weight_decay", self.weight_decay, "must be >= 0", "pass 0 to disable")


@dataclass(frozen=True)
class OffloadConfig:
    """Where a kind of state lives: "none" (accelerator memory), "cpu" (host memory) or "nvme"."""

    device: str = "none"

    def validate(self, path: str) -> None:
        if self.device not in DEVICES:
            fail(f"{path}.device", self.device, "unknown device", f"use one of {list(DEVICES)}")


@dataclass(frozen=True)
class BudgetsConfig:
    """Tier budgets in bytes; None means: derived from what the machine has (see tiers.py)."""

    hbm_bytes: int | None = None
    dram_bytes: int | None = None

    def validate(self, path: str) -> None:
        for name in ("hbm_bytes", "dram_bytes"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v <= 0):
                fail(f"{path}.{name}", v, "must be a positive number of bytes",
                      'write a byte count or a size such as "2.5G", or leave it out')


@dataclass(frozen=True)
class AioConfig:
    """The swap layer's I/O backend (`offload tune nvme` prints the best section for a drive)."""

    engine: str = "auto"
    block_bytes: int = 8 << 20     # bytes per I/O request: 8 MiB trains faster than 1 MiB (bench/RESULTS.md)
    queue_depth: int = 32
    threads: int = 4
    background_bytes: int = 64 << 20  # libaio: bytes in flight of transfers no compute waits on (states, writes): a weight fetch waits behind at most this; 0: no limit

    def validate(self, path: str) -> None:
        if self.engine not in ("auto", "libaio", "threads"):
            fail(f"{path}.engine", self.engine, "unknown engine", 'use "auto", "libaio" or "threads"')
        if self.block_bytes <= 0 or self.block_bytes % 4096:
            fail(f"{path}.block_bytes", self.block_bytes, "must be a positive multiple of 4096", "for example 8388608")
        for name in ("queue_depth", "threads"):
            if getattr(self, name) < 1:
                fail(f"{path}.{name}", getattr(self, name), "must be >= 1", "for example 4")
        if isinstance(self.background_bytes, bool) or self.background_bytes < 0:
            fail(f"{path}.background_bytes", self.background_bytes, "must be >= 0 (0: no limit)", "for example 67108864")


@dataclass(frozen=True)
class UnitsConfig:
    """How the model is split into units (module subtrees moved as one flat buffer)."""

    min_numel: int = 1 << 16          # a child subtree this large becomes a unit
    classes: tuple[str, ...] = ()      # or name module classes ("LlamaDecoderLayer"), as FSDP's wrap policy

    def validate(self, path: str) -> None:
        if self.min_numel < 1:
            fail(f"{path}.min_numel", self.min_numel, "must be >= 1", "for example 65536")


@dataclass(frozen=True)
class ActivationsConfig:
    """The batch the memory plan sizes activations for (docs/python.md "Planning a long sequence"): both or
    neither; null: the plan counts no activations until the first forward shows the batch's shape."""

    batch: int | None = None   # sequences per micro-batch
    seq: int | None = None     # tokens per sequence

    def validate(self, path: str) -> None:
        for name in ("batch", "seq"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                fail(f"{path}.{name}", v, "must be a positive integer", "for example 4 (batch) or 2048 (seq)")
        if (self.batch is None) != (self.seq is None):
            given = "batch" if self.seq is None else "seq"
            fail(f"{path}.{given}", getattr(self, given), "the plan needs both the batch and the sequence length",
                  f"set {path}.{'seq' if given == 'batch' else 'batch'} too, or neither")


@dataclass(frozen=True)
class LossScaleConfig:
    """Dynamic loss scaling for fp16 (ignored, with a warning, for bf16/fp32)."""

    initial: float = 2.0**16
    growth_interval: int = 1000
    min_scale: float = 1.0

    def validate(self, path: str) -> None:
        if self.initial <= 0 or self.min_scale <= 0:
            fail(f"{path}.initial", self.initial, "loss scales must be > 0", "for example 65536")
        if self.growth_interval < 1:
            fail(f"{path}.growth_interval", self.growth_interval, "must be >= 1", "for example 1000")


@dataclass(frozen=True)
class LRScheduleConfig:
    """Learning rate schedule: lr(step) = base lr x factor(step)."""

    type: str = "constant"       # constant | linear | cosine
    warmup_steps: int = 0
    total_steps: int = 0         # for linear/cosine decay
    min_ratio: float = 0.0       # final lr as a fraction of the base lr

    def validate(self, path: str) -> None:
        if self.type not in ("constant", "linear", "cosine"):
            fail(f"{path}.type", self.type, "unknown schedule", 'use "constant", "linear" or "cosine"')
        if self.type != "constant" and self.total_steps <= self.warmup_steps:
            fail(f"{path}.total_steps", self.total_steps, "must exceed warmup_steps for a decay",
                  "set total_steps to the number of optimizer steps")


@dataclass(frozen=True)
class Config:
    precision: str = "auto"
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    zero_stage: int = 0
    zero_gather_ahead: bool = True  # zero_stage 3: a fetched unit's gather runs on its own thread as the fetch is issued, ahead of use (false: on the compute thread when the unit runs)
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    nvme_path: list[str] | str | None = None
    budgets: BudgetsConfig = field(default_factory=BudgetsConfig)
    aio: AioConfig = field(default_factory=AioConfig)
    units: UnitsConfig = field(default_factory=UnitsConfig)
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    prefetch_units: int = 2        # units fetched ahead of use along the recorded trace (0: on demand)
    reuse_distance: int = 1        # keep a unit in hbm when the trace uses it again within this many fetches (-1: off, and no free holds)
    reuse_bytes: int | None = None  # also keep units used again later in the step up to this many bytes (null: derived; docs/design.md "Data flow of one step")
    overlap_step: bool = True      # step each unit as soon as its gradients are final, during backward (not with clipping or fp16)
    split_step: float = 0.25       # nvme states, overlapped step: this fraction of the units steps as it is fetched for the next forward (0: none; docs/design.md "Split step")
    delayed_update: bool = False   # one-step delayed parameter update: step k's update lands during step k+1's backward (docs/design.md "One-step delayed parameter update")
    chunk_bytes: int = 32 << 20    # the grain of nvme <-> dram movement and of the CPU Adam pipeline (docs/design.md "Chunks and budgets")
    swap_checksum: bool = True     # per-block checksums of swap files, verified on read (nvme optimizer states: in the CPU Adam pass)
    seed: int = 0                  # seeds meta-device materialization
    activation_checkpointing: bool = False  # the engine checkpoints each unit's forward: keeps the unit's inputs, runs its forward again in its backward (docs/python.md "Activation checkpointing")
    offload_activations: OffloadConfig = field(default_factory=OffloadConfig)
    activations: ActivationsConfig = field(default_factory=ActivationsConfig)
    quantize_base: str | None = None  # "nf4" | "fp4" | "int8": a model built on meta has its base's linears quantized by bitsandbytes as they are materialized (a LoRA run; docs/training.md "QLoRA")
    collective_timeout_s: float = 600.0  # over ranks: a collective not matched by every rank within this raises an error naming it ([Note: collective order] in offload/state/ranks.py)

    def __post_init__(self) -> None:
        self.validate("")

    def validate(self, path: str) -> None:
        for f in dataclasses.fields(self):  # each section's own values first, then the rules across them
            v = getattr(self, f.name)
            if dataclasses.is_dataclass(v):
                v.validate(f.name)
        if self.precision not in PRECISION_CHOICES:
            fail("precision", self.precision, "unknown precision",
                  'use "bf16", "fp16", "fp32" or "auto" (the default: chosen for the compute device)')
        if self.gradient_accumulation_steps < 1:
            fail("gradient_accumulation_steps", self.gradient_accumulation_steps, "must be >= 1", "use 1 for none")
        if not self.gradient_clipping >= 0:
            fail("gradient_clipping", self.gradient_clipping, "must be >= 0", "use 0 to disable clipping")
        if self.zero_stage not in (0, 1, 2, 3):
            fail("zero_stage", self.zero_stage, "must be 0, 1, 2 or 3", "see docs/zero.md")
        if self.optimizer.master == "split":
            if self.precision not in ("bf16", "auto"):
                fail("optimizer.master", "split", f"is the bf16 weight plus a 17-bit record, and precision is "
                      f"{self.precision!r}: there is no bf16 weight to split from", 'use precision "bf16" or master "fp32"')
        if self.delayed_update and self.gradient_accumulation_steps > 1:
            fail("delayed_update", True, f"needs gradient_accumulation_steps 1 (got {self.gradient_accumulation_steps}): "
                  "the delayed update lands during the next backward, inside the next accumulation window",
                  "set gradient_accumulation_steps to 1 or delayed_update to false")
        if isinstance(self.split_step, (str, bool)) or not 0 <= self.split_step <= 1:
            fail("split_step", self.split_step, "must be a number from 0 to 1 (a fraction of the units)",
                  "use 0 to step every unit in backward, 0.5 for every other unit (what true meant before)")
        if self.quantize_base not in (None, "nf4", "fp4", "int8"):
            fail("quantize_base", self.quantize_base, "unknown quantization",
                  'use "nf4" (QLoRA: nf4 with double quantization), "fp4", "int8", or null for none')
        if isinstance(self.collective_timeout_s, bool) or not (isinstance(self.collective_timeout_s, (int, float))
                                                                and self.collective_timeout_s > 0):
            fail("collective_timeout_s", self.collective_timeout_s, "must be a number of seconds > 0",
                  "use 600 (the default), more for a slow checkpoint drive shared by many ranks")
        if self.prefetch_units < 0:
            fail("prefetch_units", self.prefetch_units, "must be >= 0", "use 0 for on-demand fetches")
        if self.reuse_distance < -1:
            fail("reuse_distance", self.reuse_distance, "must be >= -1",
                  "use -1 (and reuse_bytes 0) to release every unit after use")
        if self.reuse_bytes is not None and (not isinstance(self.reuse_bytes, int) or self.reuse_bytes < 0):
            fail("reuse_bytes", self.reuse_bytes, "must be an integer >= 0 (bytes)",
                  "use 0 to keep only what reuse_distance keeps, or leave it out for the derived default")
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes < CHUNK_ALIGN_BYTES or self.chunk_bytes % CHUNK_ALIGN_BYTES:
            fail("chunk_bytes", self.chunk_bytes, f"must be a positive multiple of {CHUNK_ALIGN_BYTES} bytes "
                  "(2048 fp32 elements: chunks start where parameters may start)", "for example 33554432 (32 MiB)")
        paths = self.nvme_path if isinstance(self.nvme_path, list) else [self.nvme_path]
        if self.nvme_path is not None and not all(isinstance(p, str) and p for p in paths):
            fail("nvme_path", self.nvme_path, "expected a directory, or a non-empty list of directories",
                  'for example "/mnt/nvme0/offload" or ["/mnt/nvme0/offload", "/mnt/nvme1/offload"]')
        if self.offload_activations.device != "none" and not self.activation_checkpointing:
            fail("offload_activations.device", self.offload_activations.device,
                  "places the inputs the engine's checkpoints keep, and activation_checkpointing is off",
                  "set activation_checkpointing to true (--activation-checkpointing) or the device to \"none\"")
        homes = (self.offload_param.device, self.offload_optimizer.device, self.offload_activations.device)
        if "nvme" in homes and not self.nvme_path:
            fail("nvme_path", self.nvme_path, "required when a device is \"nvme\"",
                  "set nvme_path to a directory on a fast local drive (--nvme-path DIR)")
        # offload_optimizer none beside offloaded weights (a LoRA run's adapters beside a base on nvme): the
        # placement checks that the trainable parameters' states fit hbm (offload.plan.placement.check_states_in_hbm).

    @property
    def compute_dtype(self):
        """The dtype of weights and gradients; "auto" resolved for this host's compute device."""
        from offload.plan.precision import resolve_precision

        return resolve_precision(self.precision).dtype

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def swap_dir(self, rank: int = 0) -> str | None:
        """This process's swap directory: nvme_path, or from a list of several (one per drive) the turn of
        its local rank (LOCAL_RANK under torchrun, else `rank`), so the ranks of a node spread over them."""
        if not isinstance(self.nvme_path, list):
            return self.nvme_path
        local = int(os.environ.get("LOCAL_RANK", rank))
        return self.nvme_path[local % len(self.nvme_path)]

    @classmethod
    def from_deepspeed(cls, path_or_dict) -> "Config":
        """The Config of a DeepSpeed JSON config (a path or a dict). Keys without an exact equivalent here
        are named in one DeepSpeedConfigWarning, each with what we do instead (docs/deepspeed.md); "auto"
        values mean not set. The reading is offload.integrations.deepspeed's."""
        return deepspeed.to_config(path_or_dict, cls)


# --- building configs from plain data ------------------------------------------------------------


def load_config(config: Config | dict | str | pathlib.Path | None) -> Config:
    """A Config from a Config, a dict, or the path of a .json / .yaml file."""
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, (str, pathlib.Path)):
        return build(Config, read_settings_file(pathlib.Path(config)), "")
    return build(Config, config, "")
