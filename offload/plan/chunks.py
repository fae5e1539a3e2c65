"""Chunks: the grain of movement. A unit is the grain of compute (its weights enter hbm whole); a chunk
is a fixed-size slice of a unit's flat buffers (`chunk_bytes` of fp32, i.e. chunk_numel elements of
every buffer), and everything that moves between dram and nvme, and everything CPU Adam streams, moves
one chunk at a time through one bounded pool. So the runtime's dram is a count of chunks, independent of
the model and of its largest layer (docs/design.md "Chunks and budgets").

Element i of a unit's states lies in window i // chunk_numel of each of its buffers (fp32 master, exp_avg,
exp_avg_sq, gradient). Its weights (in the compute dtype) are chunked the same way over the trainable
prefix, and the frozen rest starts a chunk of its own (weight_chunks), so the optimizer's window k writes
exactly weight chunk k, whole: new weights never read back frozen ones that shared their chunk (a LoRA
layer's 0.5 MB of adapters beside 800 MB of frozen base).
"""

from __future__ import annotations

import torch

from offload.plan.settings import CHUNK_ALIGN_BYTES


def planned_chunk_bytes(chunk_bytes: int, largest_numel: int) -> int:
    """The chunk the placement uses: chunk_bytes, or less when the largest unit's fp32 buffer is smaller (a
    larger chunk would only hold empty pool bytes), a multiple of CHUNK_ALIGN_BYTES."""
    return min(chunk_bytes, max(CHUNK_ALIGN_BYTES, -(-largest_numel * 4 // CHUNK_ALIGN_BYTES) * CHUNK_ALIGN_BYTES))


def chunk_spans(numel: int, chunk_numel: int) -> list[tuple[int, int]]:
    """[begin, end) element ranges of the chunks of a buffer of `numel` elements."""
    return [(b, min(b + chunk_numel, numel)) for b in range(0, numel, chunk_numel)]


def weight_chunks(numel: int, trainable_numel: int, chunk_numel: int) -> list[tuple[int, int]]:
    """[begin, end) element ranges of a unit's weight chunks: the trainable prefix's state windows, then the
    frozen rest's chunks (module docstring)."""
    rest = chunk_spans(numel - trainable_numel, chunk_numel)
    return chunk_spans(trainable_numel, chunk_numel) + [(trainable_numel + b, trainable_numel + e) for b, e in rest]


def window_owners(counts: list[int], world: int) -> list[list[int]]:
    """ZeRO stages 1-3 over `world` ranks: per unit (`counts`: how many state windows of stages 1-2, or
    weight chunks of stage 3, whose first ones are its state windows), the rank that owns each of its
    windows, round robin over the model's windows in unit order, so every rank holds about 1/world of them
    (within one window) and steps only those. Every rank computes the same map. A unit's windows are dealt
    in turn, so any `world` consecutive ones have distinct owners: its rounds (below) are full but the last."""
    owners, g = [], 0
    for count in counts:
        owners.append([(g + i) % world for i in range(count)])
        g += count
    return owners


def rounds(owners: list[int], world: int) -> list[list[int]]:
    """A unit's windows (`owners`: the rank that owns each) grouped for reduce-scatters: runs of consecutive
    windows with distinct owners, at most `world` of them, so each rank owns at most one window of a round
    ([Note: gradient reduce-scatter] in offload.step.accumulator). With window_owners' map these are windows
    [k x world, (k+1) x world), the last round holding the rest (count % world). Every rank computes the same."""
    out: list[list[int]] = []
    seen: set[int] = set()
    for i, r in enumerate(owners):
        if not out or r in seen or len(out[-1]) == world:
            out.append([])
            seen = set()
        out[-1].append(i)
        seen.add(r)
    return out


def packed(spans: list[tuple[int, int]], held: list[int]) -> tuple[dict[int, int], int]:
    """Where the `held` spans (indices into `spans`, ascending) start when stored back to back, and their
    total numel: the layout of a rank's own windows or chunks ([Note: windows over ranks])."""
    at, pos = {}, 0
    for i in held:
        at[i] = pos
        pos += spans[i][1] - spans[i][0]
    return at, pos


def chunk_key(key: str, i: int) -> str:
    """The swap key of chunk i of the buffer stored under `key`."""
    return f"{key}#{i}"


def copy_spans(grads: list[tuple[int, torch.Tensor]], begin: int, end: int, out: torch.Tensor) -> None:
    """Writes elements [begin, end) of a unit's flat gradient into `out` from (offset, flat grad) pieces;
    elements no piece covers (padding, parameters without a gradient) are zero."""
    pos = begin
    for offset, g in sorted(grads, key=lambda og: og[0]):
        b, e = max(offset, begin), min(offset + g.numel(), end)
        if b >= e:
            continue
        out[pos - begin:b - begin].zero_()
        out[b - begin:e - begin].copy_(g[b - offset:e - offset])
        pos = e
    out[pos - begin:end - begin].zero_()
