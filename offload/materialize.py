"""Materialization: each unit's initial values go straight into their home tiers, one unit at a time.

A model built on the meta device (`with torch.device("meta"): model = Net()`) is materialized module by
module in `model.modules()` order by each module's own `reset_parameters()` after `torch.manual_seed(
cfg.seed)`, so it equals the same model built on the CPU with that seed when the model's constructor
initializes in that order (the torch convention). Only one unit's fp32 values exist at a time, so a
model whose training state is many times the RAM never exists whole in memory.
"""

from __future__ import annotations

import torch
from torch import nn

from offload.chunks import chunk_key, gather
from offload.optim import OptimState
from offload.residency import WeightHandle
from offload.units import Unit


def materialize(engine) -> None:
    model = engine.module
    engine.weights = [None] * len(engine.units)
    engine.states = [None] * len(engine.units)
    if any(p.is_meta for p in model.parameters()):
        _from_meta(engine, model, init=engine.weights_source is None)
    else:
        for u in engine.units:
            place(engine, u)
    for module in model.modules():
        for name, b in module.named_buffers(recurse=False):
            if b.is_meta:
                raise ValueError(f"buffer {type(module).__name__}.{name}: still on the meta device after "
                                 "reset_parameters(); initialize buffers in reset_parameters() too")
            module._buffers[name] = b.to(engine.device)


def _from_meta(engine, model: nn.Module, init: bool) -> None:
    """Allocates modules one by one in `model.modules()` order, initializing them with their own
    reset_parameters() when `init` (else the weights source gives the values), and places each unit
    as soon as all its parameters exist."""
    slot_of = {s.param: (u, s) for u in engine.units for s in u.slots}
    holders: dict = {}  # parameter -> every (module, name) holding it (tied weights: several)
    for m in model.modules():
        for n, p in m._parameters.items():
            if p is not None:
                holders.setdefault(p, []).append((m, n))
    pending = {u.index: len(u.slots) for u in engine.units}
    torch.manual_seed(engine.cfg.seed)
    for module in model.modules():
        direct = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        if not any(t.is_meta for t in direct):
            continue  # nothing of its own, or tied parameters already placed
        if init and not hasattr(module, "reset_parameters"):
            raise ValueError(f"module {type(module).__name__}: owns parameters but has no reset_parameters(); "
                             "define it, or build the model on the CPU")
        old = dict(module._parameters)
        module.to_empty(device="cpu", recurse=False)  # new Parameter objects: rebind every holder and slot
        if init:
            with torch.no_grad():
                module.reset_parameters()
        for name, p_old in old.items():
            if p_old is None or p_old not in slot_of:
                continue
            p_new = module._parameters[name]
            for m, n in holders[p_old]:
                m._parameters[n] = p_new
            u, slot = slot_of.pop(p_old)
            slot.param = p_new
            pending[u.index] -= 1
            if pending[u.index] == 0:
                place(engine, u)


@torch.no_grad()
def place(engine, unit: Unit) -> None:
    """Copies the unit's initial values into its weight and optimizer-state homes. Resident homes are
    filled in place; nvme homes chunk by chunk through the pool."""
    p = engine.placement
    values = {s.name: _initial_value(engine, s) for s in unit.slots}  # keeps the values past _detach()
    w = WeightHandle(unit, p.weight_home[unit.index], engine.dtype, engine)
    pieces = [(s.offset, values[s.name]) for s in unit.slots]
    if w.home == "nvme":
        _fill_chunks(engine, w.key, w.chunks, engine.dtype, pieces)
    else:
        gather(pieces, 0, unit.numel, w.hbm if w.home == "hbm" else w.dram)
        if w.home == "hbm":
            w._attach()
    engine.weights[unit.index] = w
    if unit.trainable_numel:
        st = OptimState(unit, p.state_home[unit.index], engine)
        pieces = [(s.offset, values[s.name]) for s in unit.slots if s.trainable]
        if st.home == "nvme":
            _fill_chunks(engine, unit.key("master", engine.rank), st.windows, torch.float32, pieces)
        else:
            gather(pieces, 0, unit.trainable_numel, st.t["master"])
        engine.states[unit.index] = st


def _fill_chunks(engine, key: str, chunks, dtype, pieces) -> None:
    """Writes (offset, flat value) pieces, zero elsewhere, to the swap chunks of `key`, one pool chunk at
    a time."""
    for i, (b, e) in enumerate(chunks):
        buf = engine.staging.acquire(e - b, dtype, f"initial {key}")
        try:
            gather(pieces, b, e, buf)
            engine.store.write(chunk_key(key, i), buf).wait()
        finally:
            engine.staging.release(buf)


def _initial_value(engine, s) -> torch.Tensor:
    """A parameter's initial value, flat: from the weights source when given, else the parameter."""
    if engine.weights_source is None:
        return s.param.detach().reshape(-1)
    t = engine.weights_source(s.name)
    if tuple(t.shape) != tuple(s.shape):
        raise ValueError(f"weights[{s.name!r}]: shape {tuple(t.shape)} but the model expects {tuple(s.shape)}; "
                         "the checkpoint does not belong to this model config")
    return t.reshape(-1)


@torch.no_grad()
def unit_values(engine, unit: Unit):
    """Yields (slot, fp32 tensor) for every parameter of `unit`: the master for trainable ones."""
    st = engine.states[unit.index]
    w = engine.weights[unit.index]
    master = weights = None
    if st is not None:
        if st.home == "nvme":
            master = _read_chunks(engine, unit.key("master", engine.rank), st.windows, torch.float32)
        else:
            master = st.t["master"]
    if any(not s.trainable for s in unit.slots):
        if w.home == "nvme":
            w.wait_for_write()
            weights = _read_chunks(engine, w.key, w.chunks, w.dtype)
        else:
            weights = w.hbm if w.home == "hbm" else w.dram
    for s in unit.slots:
        src = master if s.trainable else weights
        yield s, src[s.offset:s.offset + s.numel].to("cpu", torch.float32, copy=True).view(s.shape)


def _read_chunks(engine, key: str, chunks, dtype) -> torch.Tensor:
    """A buffer stored in swap chunks, read whole into a new tensor (its values are returned whole)."""
    out = torch.empty(chunks[-1][1] if chunks else 0, dtype=dtype)
    tickets = [engine.store.read(chunk_key(key, i), into=out[b:e]) for i, (b, e) in enumerate(chunks)]
    for t in tickets:
        t.wait()
    return out
