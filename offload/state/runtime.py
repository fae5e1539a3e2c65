"""The runtime: what the residency handles and the optimizer pipeline work with, and nothing else.

Handles (offload.state.residency, offload.state.optim) and the step's parts (offload.step) receive a Runtime,
never the Engine: the resources (the tiers and their accountants, the chunk pool, the swap store, the copy
streams and the reader thread, the ranks' groups, the telemetry), which the Engine opens once and closes
last, and `settings`, the frozen values the step reads of the config and the placement.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

import torch

from offload.kernels import cpu_adam
from offload.plan.config import Config, LossScaleConfig, LRScheduleConfig, OptimizerConfig
from offload.plan.placement import Placement, check_nvme_path
from offload.scheduler.streams import CopyStream, Worker
from offload.scheduler.telemetry import Telemetry
from offload.state.ranks import Ranks
from offload.state.tiers import ChunkPool, Tiers
from offload.swap import SwapStore

log = logging.getLogger("offload")


@dataclass(frozen=True)
class StepSettings:
    """What the step reads of the config and the placement, fixed for the run. The config's names, so
    offload.plan.modes and the loss scale read it as they read a Config."""
    precision: str                          # the one that runs ("auto" resolved for the device)
    optimizer: OptimizerConfig
    lr_schedule: LRScheduleConfig
    loss_scale: LossScaleConfig
    gradient_accumulation_steps: int
    gradient_clipping: float
    overlap_step: bool
    delayed_update: bool
    seed: int                               # the initial values' RNG seed (materialize)
    weight_home: Mapping[int, str]          # unit -> its weights' tier
    state_home: Mapping[int, str]           # unit -> its optimizer states' tier (trainable units)
    owners: Mapping[int, list[int]]         # zero_stage 1-3 over ranks: unit -> each state window's rank
    weight_owners: Mapping[int, list[int]]  # zero_stage 3: partitioned unit -> each weight chunk's rank
    deferred: tuple[int, ...]               # units whose step waits for their next fetch ([Note: split step])
    read_ahead: bool                        # the optimizer pipeline reads the next window during a step
    grad_reserve: int                       # hbm bytes the gradients on their way to dram may hold

    @classmethod
    def of(cls, cfg: Config, placement: Placement) -> "StepSettings":
        p = placement  # its maps as read-only copies
        return cls(cfg.precision, cfg.optimizer, cfg.lr_schedule, cfg.loss_scale, cfg.gradient_accumulation_steps,
                   cfg.gradient_clipping, cfg.overlap_step, cfg.delayed_update, cfg.seed,
                   *(MappingProxyType(dict(m)) for m in (p.weight_home, p.state_home, p.owners, p.weight_owners)),
                   tuple(p.deferred), p.read_ahead, p.grad_reserve)


@dataclass
class Runtime:
    settings: StepSettings
    device: torch.device
    dtype: torch.dtype          # the compute dtype of weights and gradients
    rank: int
    world: int                  # ranks of the default process group (data parallel)
    tiers: Tiers
    telemetry: Telemetry
    chunk_numel: int            # elements per chunk of every buffer (offload.plan.chunks)
    staging: ChunkPool
    store: SwapStore | None
    h2d: CopyStream             # fetches: dram -> hbm
    d2h: CopyStream             # gradients: hbm -> dram accumulators, and the step that follows them
    reader: Worker              # fetches from nvme, chunk by chunk
    ranks: Ranks                # the process groups (one per thread that enters collectives), with a timeout
    gather: CopyStream | None = None  # zero_stage 3, zero_gather_ahead: the gathers of fetched units, in issue order
    # a background checkpoint's gate (offload.checkpoint.background): before_update(unit index) returns once
    # that unit's states are written, and the step may update them
    before_update: Callable[[int], None] | None = None

    @property
    def grad_group(self):
        """The d2h thread's process group (gradient reduces): [Note: collective order] in offload.state.ranks."""
        return self.ranks.grad

    @property
    def sharded(self) -> bool:
        """zero_stage 1-3 over several ranks: each rank holds and steps the state windows it owns
        (settings.owners); otherwise every rank holds all of them and gradients are averaged (stage 0)."""
        return bool(self.settings.owners)

    @classmethod
    def open(cls, cfg: Config, device: torch.device, placement: Placement, rank: int = 0, world: int = 1) -> "Runtime":
        tiers = Tiers(device, placement.hbm_budget, placement.dram_budget, placement.nvme_budget,
                      pin=device.type == "cuda", hbm_pool_bytes=placement.fetched_peak,
                      hbm_pool_sizes=placement.shared_sizes, reuse_bytes=placement.reuse_bytes)
        staging = ChunkPool(tiers, placement.chunk_bytes, placement.pool_chunks)
        try:
            activations = cfg.offload_activations.device == "nvme"  # (offload.state.activation_tier)
            if activations and not placement.uses_nvme:  # the preflight checked nvme_path for weights and states
                check_nvme_path(cfg.swap_dir(rank))
            store = cls.open_store(cfg, rank) if placement.uses_nvme or activations else None
        except BaseException:
            staging.close()
            raise
        delay = float(os.environ.get("OFFLOAD_TEST_COPY_DELAY_S", "0"))  # tests: a missing wait shows
        try:
            ranks = Ranks(rank, world, cfg.collective_timeout_s)
        except BaseException:
            staging.close()
            if store is not None:
                store.close()
            raise
        ahead = placement.weight_owners and cfg.zero_gather_ahead
        return cls(StepSettings.of(cfg, placement), device, cfg.compute_dtype, rank, world, tiers, Telemetry(),
                   placement.chunk_bytes // 4, staging, store, CopyStream("h2d", device, delay),
                   CopyStream("d2h", device, delay), Worker("nvme-read", delay), ranks,
                   CopyStream("gather", device, delay) if ahead else None)

    @staticmethod
    def open_store(cfg: Config, rank: int = 0) -> SwapStore:
        a = cfg.aio
        if cfg.swap_checksum:
            cpu_adam.use_for_swap_digests()
        return SwapStore(cfg.swap_dir(rank), backend=a.engine, block_bytes=a.block_bytes, queue_depth=a.queue_depth,
                         threads=a.threads, checksum=cfg.swap_checksum, background_bytes=a.background_bytes or None)

    def close(self, handles=()) -> None:
        """Stops the threads (their queued jobs finish first), closes `handles` (their I/O settled, their
        chunks and budget charges returned), then the pool, and removes the swap files. Each part is
        closed even when another fails; such a failure is logged, not raised (the error that mattered was
        raised when it happened). An interrupt while closing (Ctrl-C, offload.Stopped) is not held back."""
        parts = [self.h2d, self.d2h, self.reader, self.gather, *(h for h in handles if h is not None), self.staging,
                 self.store, self.tiers]
        for part in parts:  # a None handle: initialization stopped before that unit
            if part is None:
                continue
            try:
                part.close()
            except Exception as e:  # noqa: BLE001  (the next parts must still close)
                log.warning("offload: close: %s: %s: %s; closing the rest", getattr(part, "name", type(part).__name__),
                            type(e).__name__, e)
