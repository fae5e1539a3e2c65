"""Materialization: each unit's initial values go straight into their home tiers, one unit at a time.

A model built on the meta device (`with torch.device("meta"): model = Net()`) is materialized module by
module, after `torch.manual_seed(cfg.seed)`, by the init calls a CPU build of it makes, in the same
order ([Note: the CPU build's init order] in offload.state.init_order), so it equals the same model built
on the CPU with that seed when the model's constructor initializes in that order. Only one unit's fp32
values exist at a time (plus one module's scratch), so a model whose training state is many times the
RAM never exists whole in memory. `materialize(engine)` fills the engine's weight handles and optimizer
states; everything below it takes the runtime, the units, the weights source and those two lists."""

from __future__ import annotations

import contextlib
import sys
import time

import torch
from torch import nn

from offload.plan.chunks import chunk_key, copy_spans
from offload.plan.units import Unit
from offload.state.homes import write_slots
from offload.state.masters import write_master
from offload.state.init_order import (
    adapter_group,
    check_initializable,
    default_init,
    init_events,
    last_events,
    owns_tensors,
    run_init,
    scratch,
)
from offload.state.optim import OptimState
from offload.state.residency import WeightHandle
from offload.state.runtime import Runtime
from offload.state.tiers import ChunkPool
from offload.swap import SwapStore

# [Note: buffers with a weights source]
# With `weights=`, parameters come from the source and no init runs for them. Buffers: a persistent one
# (in state_dict, so in a checkpoint) comes from the source when it has it; a non-persistent one (Llama's
# rotary inv_freq), or a persistent one the source lacks, from the module's own init calls (the same
# calls as above, its parameters in scratch). A float buffer that none of them sets is refused by name.


PROGRESS_FIRST_S = 2.0   # small models initialize in well under this, so tests stay quiet
PROGRESS_EVERY_S = 5.0


def materialize(engine) -> None:
    """Fills engine.weights and engine.states (one slot a unit) with the initial values of engine.module:
    its own, or engine.weights_source's; then moves the module's buffers to the device. The source is not
    needed after: the engine lets it go, calling its close() if it has one (SafetensorsWeights unmaps its
    shards: kept mapped, a 1B model's fp32 file stayed in the process's RSS, 4.3 GB, for the engine's life)."""
    model, rt, source = engine.module, engine.rt, engine.weights_source
    if any(p.is_meta for p in model.parameters()):
        _from_meta(rt, model, engine.units, source, engine.weights, engine.states)
    else:
        for u in engine.units:
            place(rt, u, source, engine.weights, engine.states)
    for module in model.modules():
        for name, b in module.named_buffers(recurse=False):
            if b.is_meta:
                raise ValueError(f"buffer {type(module).__name__}.{name}: still on the meta device after "
                                 "reset_parameters(); initialize buffers in reset_parameters() too")
            module._buffers[name] = b.to(rt.device)
    if callable(getattr(source, "close", None)):
        source.close()
    engine.weights_source = None


def _from_meta(rt: Runtime, model: nn.Module, units: list[Unit], source, weights: list, states: list) -> None:
    """Allocates modules one by one and places each unit as soon as all its parameters exist, into
    weights[i] and states[i]. Without a weights `source`, modules are allocated and initialized by the CPU
    build's init calls in its order ([Note: the CPU build's init order] in offload.state.init_order); with
    one, in `model.modules()` order, uninitialized (the source gives the values), buffers as [Note:
    buffers with a weights source] says."""
    init = source is None
    paths = {m: name or "<root>" for name, m in model.named_modules()}
    calls = init_events(model)
    events = calls if init else [(None, m, None) for m in model.modules() if owns_tensors(m)]
    if init:
        check_initializable(events, paths)
    last = last_events(events)
    late = {p for kind, m, owner in events if kind == "peft" for g in adapter_group(m, owner)
            for p in g._parameters.values() if p is not None}
    tracker = _UnitTracker(rt, model, units, source, weights, states, late)
    replay: dict = {}  # module -> RNG state before its default init, drawn into scratch earlier
    torch.manual_seed(rt.settings.seed)
    with torch.no_grad():
        for i, (kind, module, owner) in enumerate(events):
            if kind == "peft":
                _init_adapter(tracker, module, owner, replay)
                continue
            if i < last[module]:  # a default init a later call overwrites (_init_weights, peft's): RNG only
                replay[module] = torch.get_rng_state()
                with scratch(module, tracker.specs[module], keep=()):
                    default_init(module)
                continue
            fresh = tracker.allocate(module)
            if kind is not None:
                with scratch(module, tracker.specs[module], keep=fresh):  # a tied weight keeps its values
                    run_init(kind, module, owner, fresh, replay.pop(module, None), paths[module])
            elif any(n in module._buffers for n in fresh):
                _buffers_from_source(source, module, fresh, tracker.specs[module], calls, paths[module])
            tracker.initialized(module)
    tracker.progress.done()


def _init_adapter(tracker: "_UnitTracker", layer: nn.Module, owner, replay: dict) -> None:
    """Allocates an adapter's lora_A and lora_B, replays their default init (drawn into scratch at their
    turn, as peft's nn.Linear constructors drew it), then runs peft's own init on them."""
    adapter, config = owner
    group = adapter_group(layer, owner)
    fresh = {m: tracker.allocate(m) for m in group}
    with contextlib.ExitStack() as stack:
        for m in group:  # a module that was not on meta keeps its values
            stack.enter_context(scratch(m, tracker.specs[m], keep=fresh[m]))
        live = torch.get_rng_state()
        for m in group:
            if m in replay:
                torch.set_rng_state(replay.pop(m))
                default_init(m)
        torch.set_rng_state(live)
        if config.init_lora_weights is not False:
            layer.reset_lora_parameters(adapter, config.init_lora_weights)
    for m in group:
        tracker.initialized(m)


def _buffers_from_source(source, module: nn.Module, fresh: set[str], specs: dict, calls: list, path: str) -> None:
    """With a weights source, a newly allocated module's buffers ([Note: buffers with a weights source]):
    persistent ones the source holds from it, the others from the module's own init calls (its parameters
    in scratch), NaN before those so that a float buffer no init sets is refused, not used."""
    prefix = "" if path == "<root>" else path + "."
    unset = []
    for n in [n for n in fresh if n in module._buffers]:
        value = _source_buffer(source, prefix + n) if n not in module._non_persistent_buffers_set else None
        if value is None:
            unset.append(n)
            if module._buffers[n].is_floating_point():
                module._buffers[n].fill_(float("nan"))
        elif tuple(value.shape) != tuple(specs[n][0]):
            raise ValueError(f"weights[{prefix + n!r}]: shape {tuple(value.shape)} but the model's buffer is "
                             f"{tuple(specs[n][0])}; the checkpoint does not belong to this model config")
        else:
            module._buffers[n].copy_(value)
    if not unset:
        return
    with scratch(module, specs, keep=set(unset)):
        for kind, m, owner in calls:
            if m is module and kind == "default":
                default_init(m)
            elif m is module:
                owner._init_weights(m)
    for n in unset:
        if module._buffers[n].is_floating_point() and module._buffers[n].isnan().any():
            raise ValueError(f"buffer {prefix + n} ({type(module).__name__}): on the meta device, not given by "
                             f"weights= and not set by the module's reset_parameters() or _init_weights(); set it "
                             f"there, give it from weights=, or build the model on the CPU")


def _source_buffer(source, name: str) -> torch.Tensor | None:
    """A persistent buffer's value from the weights source, None when the source has no such name."""
    try:
        return source(name)
    except (KeyError, ValueError):
        return None


class _UnitTracker:
    """Allocates modules' meta tensors on the CPU, rebinding every holder and slot of a parameter (tied
    weights: several), and places a unit once the last of its parameters is initialized.

    [Note: adapters initialized late]
    peft's adapters are initialized after the whole base model ([Note: the CPU build's init order] in
    offload.state.init_order), so a decoder layer holding lora_A/lora_B would wait for the end with its base
    weights in memory: all of them, 27 GB for a 7B model. A unit holding base parameters and such `late`
    ones is placed when its base parameters are initialized, the late ones zero; when the last of them is
    initialized, their values are written into the unit's homes (only the chunks they touch are read and
    written back)."""

    def __init__(self, rt: Runtime, model: nn.Module, units: list[Unit], source, weights: list, states: list,
                 late: set = frozenset()):
        self.rt, self.source, self.weights, self.states = rt, source, weights, states  # placed units go there
        self.slot_of = {s.param: (u, s) for u in units for s in u.slots}
        self.holders: dict = {}  # parameter -> every (module, name) holding it
        for m in model.modules():
            for n, p in m._parameters.items():
                if p is not None:
                    self.holders.setdefault(p, []).append((m, n))
        self.late = {u.index: [s for s in u.slots if s.param in late] for u in units
                     if any(s.param in late for s in u.slots) and not all(s.param in late for s in u.slots)}
        self.late_left = {i: len(slots) for i, slots in self.late.items()}
        self.pending = {u.index: len(u.slots) - len(self.late.get(u.index, ())) for u in units}
        self.specs = {m: {n: (t.shape, t.dtype) for n, t in [*m._parameters.items(), *m._buffers.items()]
                          if t is not None} for m in model.modules()}  # before anything is placed
        self.allocated: dict = {}  # module -> [(old meta parameter, new one)] until it is initialized
        self.progress = _Progress(len(units))

    def allocate(self, module: nn.Module) -> set[str]:
        """New CPU tensors for the module's meta ones; returns their names."""
        fresh, pairs = set(), []
        for n, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                new = nn.Parameter(torch.empty_like(p, device="cpu"), p.requires_grad)
                for m, hn in self.holders[p]:
                    m._parameters[hn] = new
                pairs.append((p, new))
                fresh.add(n)
        for n, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[n] = torch.empty_like(b, device="cpu")
                fresh.add(n)
        self.allocated[module] = pairs
        return fresh

    def initialized(self, module: nn.Module) -> None:
        for old, new in self.allocated.pop(module):
            if old not in self.slot_of:
                continue
            u, slot = self.slot_of.pop(old)
            slot.param = new
            if any(s is slot for s in self.late.get(u.index, ())):
                self.late_left[u.index] -= 1
                if self.late_left[u.index] == 0:
                    _fill_late(self.rt, u, self.weights[u.index], self.states[u.index], self.late[u.index])
                continue
            self.pending[u.index] -= 1
            if self.pending[u.index] == 0:
                late = self.late.get(u.index, [])
                metas = [s.param for s in late]
                for s in late:  # stand-ins the weight handle may detach (a meta parameter cannot be)
                    s.param = nn.Parameter(torch.empty(0), s.param.requires_grad)
                try:
                    place(self.rt, u, self.source, self.weights, self.states, late)
                finally:
                    for s, p in zip(late, metas):
                        s.param = p
                self.progress.update(u.numel * self.rt.dtype.itemsize + u.trainable_numel * 4)


def _fill_late(rt: Runtime, unit: Unit, w: WeightHandle, st: OptimState | None, slots) -> None:
    """[Note: adapters initialized late] The slots' values into the placed unit's weight and master homes;
    the parameters then follow the weight handle (attached where the weights live in hbm, else empty)."""
    values = {s.param: s.param.detach().reshape(-1) for s in slots}

    def fill(dst, slot, lo, hi):
        dst.copy_(values[slot.param][lo:hi])

    if st is not None:
        write_slots(rt, w, st, "master", [s for s in slots if s.trainable], fill, keep=True)
    write_slots(rt, w, st, "weight", slots, fill, keep=True)
    w.attach() if w.home == "hbm" else w.detach()


class _Progress:
    """"offload: initializing: 12/30 units placed, 10.2 GB written" on stderr every few seconds, once the
    initialization has taken PROGRESS_FIRST_S (a multi-billion-parameter model writes tens of GB in minutes; tests stay quiet)."""

    def __init__(self, total_units: int):
        self.total_units, self.units, self.nbytes = total_units, 0, 0
        self.t0 = time.monotonic()
        self.next_s, self.shown = PROGRESS_FIRST_S, False

    def update(self, nbytes: int) -> None:
        self.units += 1
        self.nbytes += nbytes
        if time.monotonic() - self.t0 >= self.next_s:
            self._show()
            self.next_s = time.monotonic() - self.t0 + PROGRESS_EVERY_S

    def done(self) -> None:
        if self.shown:  # the last line says it finished
            self._show()

    def _show(self) -> None:
        self.shown = True
        print(f"offload: initializing: {self.units}/{self.total_units} units placed, {self.nbytes / 1e9:.1f} GB "
              f"written, {time.monotonic() - self.t0:.0f} s", file=sys.stderr, flush=True)


@torch.no_grad()
def place(rt: Runtime, unit: Unit, source, weights: list, states: list, late=()) -> None:
    """Copies the unit's initial values (from the weights `source`, or its parameters' own when None) into
    its weight and optimizer-state homes, whose handles go to weights[unit.index] and states[unit.index].
    Resident homes are filled in place; nvme homes chunk by chunk through the pool. `late`: slots left
    zero, whose values come later ([Note: adapters initialized late])."""
    p = rt.settings
    given = [s for s in unit.slots if not any(s is x for x in late)]
    values = {s.name: _initial_value(s, source, rt.dtype) for s in given}  # keeps the values past detach()
    w = WeightHandle(unit, p.weight_home[unit.index], rt.dtype, rt)
    pieces = [(s.offset, values[s.name]) for s in given]
    if w.home == "nvme":
        _fill_chunks(rt.staging, rt.store, w.key, {i: w.chunks[i] for i in w.held}, rt.dtype, pieces)
    elif w.home == "dram":
        for i in w.held:  # every chunk, or with zero_stage 3 the ones this rank owns
            copy_spans(pieces, *w.chunks[i], w.dram[w.span(i)])
    else:
        copy_spans(pieces, 0, unit.numel, w.hbm)
        w.attach()
    weights[unit.index] = w
    if unit.trainable_numel:
        st = OptimState(unit, p.state_home[unit.index], rt)
        pieces = [(s.offset, values[s.name]) for s in given if s.trainable]
        for i in st.mine:  # every window, or over ranks the ones this rank owns
            b, e = st.chunks[i]
            if st.split:  # its record, from the fp32 values ([Note: split master] in offload/kernels/split.py)
                buf = rt.staging.acquire(e - b, torch.float32, f"initial {unit.name} master")
                try:
                    copy_spans(pieces, b, e, buf)
                    write_master(rt, st, i, buf)
                finally:
                    rt.staging.release(buf)
            elif st.home == "nvme":
                _fill_chunks(rt.staging, rt.store, unit.key("master", rt.rank), {i: (b, e)}, torch.float32, pieces)
            else:
                copy_spans(pieces, b, e, st.t["master"][st.span(i)])
        states[unit.index] = st


def _fill_chunks(staging: ChunkPool, store: SwapStore, key: str, chunks: dict[int, tuple[int, int]],
                 dtype: torch.dtype, pieces) -> None:
    """Writes (offset, flat value) pieces, zero elsewhere, to the swap chunks of `key` ({chunk index:
    bounds}), one pool chunk at a time."""
    for i, (b, e) in chunks.items():
        buf = staging.acquire(e - b, dtype, f"initial {key}")
        try:
            copy_spans(pieces, b, e, buf)
            store.write(chunk_key(key, i), buf).wait()
        finally:
            staging.release(buf)


def _initial_value(s, source, dtype: torch.dtype) -> torch.Tensor:
    """A parameter's initial value, flat: from the weights `source` when given, else the parameter (a
    quantized one's record bytes as `dtype` elements)."""
    if s.record is not None:  # its bytes as flat elements ([Note: quantized weights as records] in offload.plan.quantized)
        if s.record.pending:  # built on meta: quantized from its value now, as from_pretrained quantizes
            value = s.param.detach() if source is None else source(s.name)
            s.param = s.record.quantize(value)
        flat = torch.zeros(s.numel, dtype=dtype)
        flat.view(torch.uint8)[:s.record.nbytes].copy_(s.record.capture())
        return flat
    if source is None:
        return s.param.detach().reshape(-1)
    t = source(s.name)
    if tuple(t.shape) != tuple(s.shape):
        raise ValueError(f"weights[{s.name!r}]: shape {tuple(t.shape)} but the model expects {tuple(s.shape)}; "
                         "the checkpoint does not belong to this model config")
    return t.reshape(-1)
