"""Placement and preflight: where each unit's weights and optimizer states live, decided once.

The bytes each tier will hold are computed before anything is allocated and checked against the tier
budgets, the free disk under nvme_path and the RAM available; a model that does not fit fails here,
with the numbers. Budgets left unset are derived with a safety margin (SAFETY) from what the machine has.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

import psutil
import torch

from offload.estimate import OFFLOAD_TIER as HOME  # offload device -> tier
from offload.units import Unit

SAFETY = 0.85  # of the memory available at start, when a budget is not given
STATE_KINDS = 4  # fp32 master, exp_avg, exp_avg_sq, gradient accumulator


class PlacementError(ValueError):
    """The model's training state does not fit the tier budgets (raised before any allocation)."""


@dataclass
class Placement:
    weight_home: dict[int, str]
    state_home: dict[int, str]
    need: dict[str, int]             # bytes each tier will hold (model states + the runtime's buffers)
    hbm_budget: int
    dram_budget: int
    nvme_budget: int
    rows: list[tuple] = field(default_factory=list)
    reuse_bytes: int = 0             # weights kept in hbm for their next use in the step (part of need["hbm"])

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in self.weight_home.values() or "nvme" in self.state_home.values()

    def describe(self) -> str:
        lines = ["offload placement:", f"  {'unit':40s} {'numel':>12s} {'weights':>8s} {'optimizer':>9s}"]
        for name, numel, w, s in self.rows:
            lines.append(f"  {name[:40]:40s} {numel:12d} {w:>8s} {s:>9s}")
        for tier in ("hbm", "dram", "nvme"):
            budget = getattr(self, f"{tier}_budget")
            lines.append(f"  {tier}: needs {self.need[tier] / 2**20:.1f} MiB of a {budget / 2**20:.1f} MiB budget")
        if self.reuse_bytes:
            lines.append(f"  hbm keeps up to {self.reuse_bytes / 2**20:.1f} MiB of weights between their uses in a "
                         f"step (forward -> backward) instead of fetching them again (reuse_bytes)")
        return "\n".join(lines)


def _default_budgets(device: torch.device) -> tuple[int, int]:
    avail = psutil.virtual_memory().available
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * SAFETY), int(avail * SAFETY)
    return int(avail * SAFETY), int(avail * SAFETY)  # the CPU backend's "hbm" is host memory too


def plan_placement(units: list[Unit], cfg, device: torch.device, check: bool = True) -> Placement:
    """Homes per unit and the bytes each tier needs; `check` runs the preflight (raises PlacementError)."""
    itemsize = cfg.compute_dtype.itemsize
    w_home, s_home = HOME[cfg.offload_param.device], HOME[cfg.offload_optimizer.device]
    weight_home = {u.index: "hbm" if u.persistent else w_home for u in units}
    state_home = {u.index: s_home for u in units if u.trainable_numel}
    need = {"hbm": 0, "dram": 0, "nvme": 0}
    rows = []
    for u in units:
        need[weight_home[u.index]] += u.numel * itemsize
        if u.trainable_numel:
            need[state_home[u.index]] += STATE_KINDS * 4 * u.trainable_numel
        rows.append((u.name, u.numel, weight_home[u.index], state_home.get(u.index, "-")))
    runtime = runtime_bytes(units, cfg, w_home, s_home, device.type)
    for tier in ("hbm", "dram"):
        need[tier] += runtime[tier]
    default_hbm, default_dram = _default_budgets(device)
    p = Placement(weight_home, state_home, need, cfg.budgets.hbm_bytes or default_hbm,
                  cfg.budgets.dram_bytes or default_dram, _free_disk(cfg) if cfg.nvme_path else 0, rows)
    p.reuse_bytes = reuse_allowance(units, cfg, p, device)
    need["hbm"] += p.reuse_bytes
    if check:
        preflight(p, device)
    return p


def reuse_allowance(units: list[Unit], cfg, p: Placement, device: torch.device) -> int:
    """Bytes of fetched weights the engine may keep in hbm until their next use in the same step (a
    forward's units until their backward) rather than release and fetch them again. `reuse_bytes` when
    set (capped by the weights that are fetched at all); else half the hbm room the placement leaves
    (the budget less its need; on the CPU backend, where hbm is host memory too, also less the dram
    need), the other half left to activations, which no accountant sees."""
    fetched = sum(u.numel for u in units if p.weight_home[u.index] != "hbm") * cfg.compute_dtype.itemsize
    if cfg.reuse_bytes is not None:
        return min(cfg.reuse_bytes, fetched)
    room = p.hbm_budget - p.need["hbm"]
    if device.type == "cpu":
        room = min(room, int(psutil.virtual_memory().available * SAFETY) - p.need["hbm"] - p.need["dram"])
    return max(0, min(fetched, room // 2))


def staging_class_bytes(units: list[Unit], cfg) -> int:
    """Every dram staging buffer has this one size (the largest a unit needs: its weights in the compute
    dtype, or one fp32 state over its trainable prefix), so any idle buffer serves any request and the
    staging peak is a count of buffers, never a sum over fragmented size classes."""
    itemsize = cfg.compute_dtype.itemsize
    return max((max(u.numel * itemsize, u.trainable_numel * 4) for u in units), default=0)


def staging_buffers(cfg, w_home: str, s_home: str, device_type: str = "cpu") -> int:
    """How many staging buffers are in use at most: fetches of nvme weights in flight (the unit in use
    plus `prefetch_units` ahead); for nvme optimizer states two units' four fp32 states (the unit being
    updated and the one read ahead or written behind); and two new-weight buffers (one being filled, one
    written behind) where new weights cannot be written in place (nvme weights, or hbm on a GPU)."""
    in_flight = 1 + cfg.prefetch_units
    n = in_flight if w_home == "nvme" else 0
    if s_home == "nvme":
        n += 2 * STATE_KINDS
    if w_home == "nvme" or (w_home == "hbm" and device_type != "cpu"):
        n += 2
    return n


def runtime_bytes(units: list[Unit], cfg, w_home: str, s_home: str, device_type: str = "cpu") -> dict[str, int]:
    """The runtime's own buffers on top of the ledger: in hbm the working set of fetched units (the one
    in use plus `prefetch_units` ahead) and two units' gradients on their way to dram; in dram the
    staging buffers (staging_buffers x staging_class_bytes)."""
    largest = max((u.numel for u in units if not u.persistent), default=0)
    largest_trainable = max((u.trainable_numel for u in units), default=0)
    itemsize = cfg.compute_dtype.itemsize
    hbm = 2 * largest_trainable * itemsize
    if w_home != "hbm":
        hbm += (1 + cfg.prefetch_units) * largest * itemsize
    dram = staging_buffers(cfg, w_home, s_home, device_type) * staging_class_bytes(units, cfg)
    return {"hbm": hbm, "dram": dram}


def _free_disk(cfg) -> int:
    path = os.path.abspath(cfg.nvme_path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def preflight(p: Placement, device: torch.device) -> None:
    problems = []
    for tier in ("hbm", "dram", "nvme"):
        budget = getattr(p, f"{tier}_budget")
        if p.need[tier] > budget:
            what = "free disk under nvme_path" if tier == "nvme" else f"budget (budgets.{tier}_bytes)"
            kept = f", {p.reuse_bytes} of them reuse_bytes," if tier == "hbm" and p.reuse_bytes else ""
            problems.append(f"{tier} needs {p.need[tier]} bytes ({p.need[tier] / 2**30:.2f} GiB){kept} but the "
                            f"{what} is {budget} bytes ({budget / 2**30:.2f} GiB)")
    host = p.need["dram"] + (p.need["hbm"] if device.type == "cpu" else 0)
    avail = psutil.virtual_memory().available
    if host > avail:
        problems.append(f"host memory: needs {host} bytes ({host / 2**30:.2f} GiB) but only {avail} bytes "
                        f"({avail / 2**30:.2f} GiB) are available")
    if problems:
        raise PlacementError("the model does not fit: " + "; ".join(problems) +
                             "; offload more (offload_param / offload_optimizer = nvme), raise the budgets, "
                             "or use smaller units (units.min_numel)")
