"""A unit's parameters as whole fp32 values, from whichever tier holds them: the masters of trainable
parameters, the weights of frozen ones (a quantized weight dequantized), gathered from their owners over
ranks. engine.state_items() reads them for state_dict(), full_state_dict() and the saves of offload.lora."""

from __future__ import annotations

import torch

from offload.plan.chunks import chunk_key
from offload.state.masters import read_master
from offload.state.optim import OptimState
from offload.state.residency import WeightHandle
from offload.state.runtime import Runtime
from offload.swap import SwapStore


@torch.no_grad()
def unit_values(rt: Runtime, w: WeightHandle, st: OptimState | None, frozen: bool = True):
    """Yields (slot, fp32 tensor) for every parameter of the unit of `w` (its weight handle; `st` its
    optimizer state, None when it trains nothing): the master for trainable ones, a quantized weight
    dequantized; frozen=False: the trainable ones only, and their frozen weights are not read (a LoRA
    adapter beside a base on nvme)."""
    unit = w.unit
    master = weights = None
    if not frozen and st is None:
        return
    if st is not None and rt.sharded:
        master = _gather_master(rt, w, st)
    elif st is not None and st.split:  # joined with the weights ([Note: split master] in offload/kernels/split.py)
        master = torch.empty(st.numel, dtype=torch.float32)
        for i, (b, e) in enumerate(st.chunks):
            read_master(rt, w, st, i, master[b:e])
    elif st is not None:
        if st.home == "nvme":
            master = _read_chunks(rt.store, unit.key("master", rt.rank), st.chunks, torch.float32)
        else:
            master = st.t["master"]
    if not frozen:
        pass
    elif any(not s.trainable for s in unit.slots) and w.partitioned:
        weights = _gather_weights(rt, w)
    elif any(not s.trainable for s in unit.slots):
        if w.home == "nvme":
            w.writer.wait_for_write()
            weights = _read_chunks(rt.store, w.key, w.chunks, w.dtype)
        else:
            weights = w.hbm if w.home == "hbm" else w.dram
    for s in unit.slots if frozen else [s for s in unit.slots if s.trainable]:
        yield s, s.value(master if s.trainable else weights)


@torch.no_grad()
def unit_weights(rt: Runtime, w: WeightHandle) -> torch.Tensor:
    """The unit of `w`'s weights whole, flat, in the compute dtype, as its forward reads them (a quantized
    weight's record as its bytes), on the CPU: a new tensor, except an hbm home on the CPU, whose buffer the
    parameters keep after close(). Over ranks, partitioned weights are gathered (a collective)."""
    if w.partitioned:
        return _gather_weights(rt, w)
    w.writer.wait_for_write()
    if w.home == "nvme":
        return _read_chunks(rt.store, w.key, w.chunks, w.dtype)
    if w.home == "dram":
        return w.dram.clone()
    return w.hbm if w.hbm.device.type == "cpu" else w.hbm.cpu()


def _read_chunks(store: SwapStore, key: str, chunks, dtype: torch.dtype) -> torch.Tensor:
    """A buffer stored in swap chunks, read whole into a new tensor (its values are returned whole)."""
    out = torch.empty(chunks[-1][1] if chunks else 0, dtype=dtype)
    tickets = [store.read(chunk_key(key, i), into=out[b:e]) for i, (b, e) in enumerate(chunks)]
    for t in tickets:
        t.wait()
    return out


def _gather_master(rt: Runtime, w: WeightHandle, st: OptimState) -> torch.Tensor:
    """A unit's fp32 master whole on every rank ([Note: windows over ranks] in offload.state.optim); a split
    one joined by each window's owner."""
    key = st.unit.key("master", rt.rank)
    if st.split:
        return _gathered(rt, st.chunks, st.owner, torch.float32, "joined", None,
                         lambda i: read_master(rt, w, st, i, torch.empty(st.chunks[i][1] - st.chunks[i][0])))
    return _gathered(rt, st.chunks, st.owner, torch.float32, st.home, lambda i: chunk_key(key, i),
                     lambda i: st.t["master"][st.span(i)])


def _gather_weights(rt: Runtime, w: WeightHandle) -> torch.Tensor:
    """A partitioned unit's weights whole on every rank ([Note: partitioned weights] in offload.state.gather)."""
    w.writer.wait_for_write()
    return _gathered(rt, w.chunks, w.owner, w.dtype, w.home, lambda i: chunk_key(w.key, i),
                     lambda i: w.dram[w.span(i)])


def _gathered(rt: Runtime, spans, owners, dtype: torch.dtype, home: str, key_of, resident) -> torch.Tensor:
    """A buffer whole on every rank, each span broadcast (as bytes) from the rank that owns it, which reads
    it from its home: swap chunk key_of(i), or the resident tensor resident(i). A collective: every rank
    must ask for it."""
    import torch.distributed as dist

    out = torch.empty(spans[-1][1] if spans else 0, dtype=dtype)
    for i, (b, e) in enumerate(spans):
        if owners[i] == rt.rank:
            if home == "nvme":
                rt.store.read(key_of(i), into=out[b:e]).wait()
            else:
                out[b:e].copy_(resident(i))
        dist.broadcast(out[b:e].view(torch.uint8), src=owners[i])
    return out
