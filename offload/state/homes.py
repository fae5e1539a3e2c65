"""A unit's flat buffers at their homes, chunk by chunk: `unit_buffers` visits one of them (master, a
moment, the gradient accumulator, or the weights) from whichever tier holds it, `write_slots` writes
parameters' elements into it. Checkpoints save and load through them (offload.checkpoint), and
materialization writes adapters initialized late with them ([Note: adapters initialized late] in
offload.state.materialize). They take the runtime `rt` (its staging pool, swap store and rank) and the
unit's handles, never the Engine."""

from __future__ import annotations

import torch

from offload.kernels.quant8 import BLOCK, SMALL_NUMEL
from offload.plan.chunks import chunk_key
from offload.state import moments
from offload.state.masters import read_master, write_master
from offload.state.optim import OptimState
from offload.state.residency import WeightHandle
from offload.state.runtime import Runtime


def unit_buffers(rt: Runtime, w: WeightHandle, st: OptimState | None, kind: str, write: bool = False, keep: bool = True,
                 only=None, staging=None, hold=None):
    """(begin, end, host tensor) over one of the unit's flat buffers (master, exp_avg, exp_avg_sq, grad, the
    int8 moments' absmax and small (begin, end: the window's elements; the tensor: OptimState.layout's), or
    weight in the compute dtype), one chunk at a time, from its home: nvme chunks through a pool chunk (a key
    never written reads as zeros: moments before the first step), accelerator-resident ones through a
    host copy, host-resident ones as views. write: the tensor goes back to its home when the caller asks
    for the next one (not after an exception). keep=False: it starts zeroed instead of read. only: the
    indices of the chunks / windows to visit (default: every one this rank holds). `w` and `st` are the
    unit's weight handle and optimizer state (None for a frozen unit). staging: the chunk pool nvme chunks go
    through (default the runtime's). hold: nvme chunks are read as this swap hold keeps them (SwapStore.hold)."""
    if kind == "master" and st.split:
        yield from _split_masters(rt, w, st, write, keep, only, staging or rt.staging, hold)
        return
    if kind == "weight":
        w.writer.wait_for_write()  # new weights written behind by the last step
        spans, home, key, dtype = w.chunks, w.home, w.key, w.dtype
        flat = w.hbm if w.home == "hbm" else w.dram
    else:
        spans, home, key = st.chunks, st.home, w.unit.key(kind, rt.rank)
        flat = st.t.get(kind)
    held = w.held if kind == "weight" else st.mine  # the chunks / windows this rank holds
    for i in held if only is None else [i for i in held if i in only]:
        b, e = spans[i]
        numel = e - b
        if kind != "weight":
            if kind not in st.layout(i):  # int8 moments: a window without small parameters has no small_m
                continue
            numel, dtype = st.layout(i)[kind]
            dtype = torch.float32 if kind == "grad" else dtype
        if home != "nvme":
            at_home = flat[w.span(i)] if kind == "weight" else st.grad(i) if kind == "grad" else \
                flat[st.kspans[kind][i]]  # grad: in the accumulator's dtype
            t = at_home.cpu()
            if not keep:
                t.zero_() if st is None else moments.blank(st.int8, kind, t)
            yield b, e, t
            if write and t is not at_home:
                at_home.copy_(t)
            continue
        k, src = chunk_key(key, i), hold if hold is not None else rt.store
        pool = staging or rt.staging
        buf = pool.acquire(numel, dtype, f"checkpoint {k}")
        try:
            if keep and k in src:
                src.read(k, into=buf).wait()
            else:
                buf.zero_() if st is None else moments.blank(st.int8, kind, buf)
            yield b, e, buf
            if write:
                rt.store.write(k, buf).wait()
        finally:
            pool.release(buf)


def _split_masters(rt: Runtime, w: WeightHandle, st: OptimState, write: bool, keep: bool, only, pool, hold):
    """unit_buffers' fp32 masters where they are split ([Note: split master] in offload/kernels/split.py): each
    window's joined with its weights into a pool chunk, its record written back from it (`write`)."""
    for i in st.mine if only is None else [i for i in st.mine if i in only]:
        b, e = st.chunks[i]
        buf = pool.acquire(e - b, torch.float32, f"{st.unit.name} master")
        try:
            read_master(rt, w, st, i, buf, pool, hold) if keep else buf.zero_()
            yield b, e, buf
            if write:
                write_master(rt, st, i, buf, pool)
        finally:
            pool.release(buf)


def slot_pieces(st: OptimState | None, kind: str, b: int, e: int, t: torch.Tensor, slot) -> list[tuple]:
    """What of unit_buffers' (b, e, t) of `kind` belongs to `slot`, as a checkpoint names it: (its kind, the
    view of t, first and end element in the parameter's own coordinates of that kind). With int8 moments
    ([Note: int8 optimizer states]): codes of exp_avg/exp_avg_sq for 8-bit parameters, their absmax per
    block as exp_avg_absmax/exp_avg_sq_absmax, and a small parameter's fp32 moments from small_m/small_v."""
    lo, hi = max(b, slot.offset), min(e, slot.offset + slot.numel)
    if lo >= hi:
        return []
    small = st is not None and st.int8 and slot.numel < SMALL_NUMEL
    if kind in ("master", "grad", "weight") or (kind in ("exp_avg", "exp_avg_sq") and not small):
        return [(kind, t[lo - b:hi - b], lo - slot.offset, hi - slot.offset)]
    if kind == "absmax" and not small:
        nb, bl, bh = t.numel() // 2, (lo - b) // BLOCK, -(-(hi - b) // BLOCK)
        first, end = (lo - slot.offset) // BLOCK, -(-(hi - slot.offset) // BLOCK)
        return [("exp_avg_absmax", t[bl:bh], first, end), ("exp_avg_sq_absmax", t[nb + bl:nb + bh], first, end)]
    if kind in ("small_m", "small_v") and small:
        side = next(s + lo - b - rb for rb, re, s in st.small[st.window_at[b]] if rb <= lo - b < re)
        name = "exp_avg" if kind == "small_m" else "exp_avg_sq"
        return [(name, t[side:side + hi - lo], lo - slot.offset, hi - slot.offset)]
    return []


def write_slots(rt: Runtime, w: WeightHandle, st: OptimState | None, kind: str, slots, fill, keep: bool) -> None:
    """fill(dst, slot, lo, hi) writes elements [lo, hi) of `slot` into dst, for each slot in `slots`,
    into the unit's `kind` buffer at its home. keep=True: only the chunks the slots touch are read and
    written back; keep=False: every chunk is written (zero where no slot is)."""
    only = None
    if keep:
        spans = w.chunks if kind == "weight" else st.chunks
        only = {i for i, (b, e) in enumerate(spans) if any(b < s.offset + s.numel and s.offset < e for s in slots)}
    for b, e, buf in unit_buffers(rt, w, st, kind, write=True, keep=keep, only=only):
        for s in slots:
            lo, hi = max(b, s.offset), min(e, s.offset + s.numel)
            if lo < hi:
                fill(buf[lo - b:hi - b], s, lo - s.offset, hi - s.offset)
