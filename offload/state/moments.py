"""The int8 moments' layout in a window ([Note: int8 optimizer states] in offload/kernels/quant8.py): where
its small parameters' fp32 moments lie, how a run of the step splits between 8-bit blocks and them, what a
blank buffer holds, and the one pool chunk a staged window's codes and scales share. OptimState
(offload.state.optim) keeps the per-window lists; these are its pure parts."""

from __future__ import annotations

import torch

from offload.kernels.quant8 import BLOCK, SMALL_NUMEL, zero_code
from offload.plan.memory import moment_offsets

SHARED = ("exp_avg", "exp_avg_sq", "absmax")  # staged in one pool chunk where moment_offsets fits them


def small_ranges(slots, numel: int, wb: int, we: int, unit: str) -> list[tuple[int, int, int]]:
    """(begin, end, side offset) of window [wb, we)'s elements in parameters under SMALL_NUMEL (each to the
    next trainable parameter's start, or `numel`), relative to the window; their fp32 m and v lie at the
    side offset in the window's small_m and small_v. `slots`: the unit's trainable slots by offset."""
    if (we - wb) % BLOCK or wb % BLOCK:
        raise RuntimeError(f"{unit}: window [{wb}, {we}) is not whole {BLOCK}-element blocks")
    ends = [s.offset for s in slots[1:]] + [numel]
    out, side = [], 0
    for slot, end in zip(slots, ends):
        b, e = max(slot.offset, wb), min(end, we)
        if slot.numel < SMALL_NUMEL and b < e:
            out.append((b - wb, e - wb, side))
            side += e - b
    return out


def segments(small: list[tuple[int, int, int]], b: int, e: int) -> list[tuple[int, int, int | None]]:
    """[b, e) of a window cut into (begin, end, side offset, or None for 8-bit blocks); `small`: its
    small_ranges."""
    out, pos = [], b
    for lo, hi, side in small:
        lo, hi, side = max(lo, b), min(hi, e), side + max(0, b - lo)
        if lo >= hi:
            continue
        if pos < lo:
            out.append((pos, lo, None))
        out.append((lo, hi, side))
        pos = hi
    if pos < e:
        out.append((pos, e, None))
    return out


def blank(int8: bool, kind: str, t: torch.Tensor) -> torch.Tensor:
    """`t` as zeros of `kind`: with int8 moments, exp_avg holds the code of 0 (quant8.zero_code), so padding
    and never-stepped elements stay 0 and out of their block's absmax."""
    return t.fill_(zero_code(True)) if int8 and kind == "exp_avg" else t.zero_()


def shared_views(staging, layout: dict, int8: bool, name: str) -> tuple[torch.Tensor | None, dict]:
    """(the chunk, {kind: view}) of a staged window's codes and scales in one pool chunk, each at a page; (None,
    {}) where they do not fit one (or the moments are fp32): they then take a chunk each."""
    offsets = int8 and moment_offsets(layout["exp_avg"][0], staging.chunk_bytes)
    if not offsets:
        return None, {}
    (n, _), (nb, _) = layout["exp_avg"], layout["absmax"]
    base = staging.acquire(offsets[2] + 4 * nb, torch.uint8, f"{name} moments")
    return base, {"exp_avg": base[:n], "exp_avg_sq": base[offsets[1]:offsets[1] + n],
                  "absmax": base[offsets[2]:offsets[2] + 4 * nb].view(torch.float32)}
