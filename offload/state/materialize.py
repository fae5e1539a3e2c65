"""Materialization: each unit's initial values go straight into their home tiers, one unit at a time.

A model built on the meta device (`with torch.device("meta"): model = Net()`) is materialized module by
module, after `torch.manual_seed(cfg.seed)`, by the init calls a CPU build of it makes, in the same
order, so it equals the same model built on the CPU with that seed when the model's constructor
initializes in that order. Only one unit's fp32 values exist at a time (plus one module's scratch), so
a model whose training state is many times the RAM never exists whole in memory.

[Note: the CPU build's init order]
- A torch module draws its values in its constructor: `reset_parameters()` for most (nn.Linear,
  nn.Embedding, our own modules: in `model.modules()` order, the seeding contract of offload.models);
  `_reset_parameters()` for nn.MultiheadAttention, which runs at the end of its __init__, after its
  child out_proj was built and initialized (then it zeroes out_proj.bias): after its children here too.
- A Hugging Face model (transformers' PreTrainedModel) is first built like that, with each module's own
  default init, and then `post_init()`, at the end of its __init__, re-initializes every module with
  the model's `_init_weights`, children before parents (transformers' smart_apply); a nested model (the
  LlamaModel in LlamaForCausalLM) ran its own post_init at the end of its own construction, so the outer
  one skips its modules. A module's default values are thus drawn long before the `_init_weights` values
  that overwrite them (all of LlamaModel's defaults come before its first `_init_weights` draw). To keep
  both the RNG stream and one-unit-at-a-time memory, a default init that is overwritten later is drawn
  into scratch at its turn, only its RNG state kept; when the module is allocated, at its last init call,
  that state is replayed to give the same default values, and `_init_weights` then runs on the live RNG.
  The cost: those default values are drawn twice.
- A module already materialized when its turn comes (the tied lm_head of an embedding) draws into
  scratch, so the RNG advances as in the CPU build, where it drew into its own tensor before tying.
- Not in construction order, so not equal to their CPU build: nn.Transformer (its _reset_parameters
  redraws its whole subtree at the end) and nn.TransformerEncoder/Decoder (deep copies of one layer).
  Each of their submodules is initialized by its own default init here.
- A peft LoRA model (`get_peft_model(base, LoraConfig(...))`) was built in two steps: the base model
  whole (its post_init included), then, layer by layer, each adapter's lora_A and lora_B with their
  default init followed by peft's own `reset_lora_parameters` (lora_A drawn, lora_B zero: the model
  starts as the base model). The adapter modules are left out of the base model's construction and
  post_init here, and come after it in that order ("peft" events). Inits that read the base weights
  or data (PiSSA, OLoRA, LoftQ, EVA, DoRA's magnitude, ...) cannot run on the meta device: refused.

[Note: buffers with a weights source]
With `weights=`, parameters come from the source and no init runs for them. Buffers: a persistent one
(in state_dict, so in a checkpoint) comes from the source when it has it; a non-persistent one (Llama's
rotary inv_freq), or a persistent one the source lacks, from the module's own init calls (the same
calls as above, its parameters in scratch). A float buffer that none of them sets is refused by name.
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch
from torch import nn

from offload.plan.chunks import chunk_key, copy_spans
from offload.state.optim import OptimState
from offload.state.residency import WeightHandle
from offload.plan.units import Unit

PROGRESS_FIRST_S = 2.0   # small models initialize in well under this, so tests stay quiet
PROGRESS_EVERY_S = 5.0


def materialize(engine) -> None:
    model = engine.module
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
            module._buffers[name] = b.to(engine.rt.device)


def _from_meta(engine, model: nn.Module, init: bool) -> None:
    """Allocates modules one by one and places each unit as soon as all its parameters exist. With `init`,
    modules are allocated and initialized by the CPU build's init calls in its order (module note); else
    in `model.modules()` order, uninitialized (the weights source gives the values), buffers as [Note:
    buffers with a weights source] says."""
    paths = {m: name or "<root>" for name, m in model.named_modules()}
    calls = _init_events(model)
    events = calls if init else [(None, m, None) for m in model.modules() if _owns_tensors(m)]
    if init:
        _check_initializable(events, paths)
    last = _last_events(events)
    late = {p for kind, m, owner in events if kind == "peft" for g in _adapter_group(m, owner)
            for p in g._parameters.values() if p is not None}
    tracker = _UnitTracker(engine, model, late)
    replay: dict = {}  # module -> RNG state before its default init, drawn into scratch earlier
    torch.manual_seed(engine.rt.cfg.seed)
    with torch.no_grad():
        for i, (kind, module, owner) in enumerate(events):
            if kind == "peft":
                _init_adapter(tracker, module, owner, replay)
                continue
            if i < last[module]:  # a default init a later call overwrites (_init_weights, peft's): RNG only
                replay[module] = torch.get_rng_state()
                with _scratch(module, tracker.specs[module], keep=()):
                    _default_init(module)
                continue
            fresh = tracker.allocate(module)
            if kind is not None:
                with _scratch(module, tracker.specs[module], keep=fresh):  # a tied weight keeps its values
                    _run_init(kind, module, owner, fresh, replay.pop(module, None), paths[module])
            elif any(n in module._buffers for n in fresh):
                _buffers_from_source(engine, module, fresh, tracker.specs[module], calls, paths[module])
            tracker.initialized(module)
    tracker.progress.done()


def _last_events(events: list) -> dict:
    """module -> the index of the event that allocates and initializes it: its last one; for an adapter's
    modules, the "peft" event of their layer (peft's init runs on them together)."""
    last = {}
    for i, (kind, m, owner) in enumerate(events):
        for module in _adapter_group(m, owner) if kind == "peft" else [m]:
            last[module] = i
    return last


def _run_init(kind: str, module: nn.Module, owner, fresh: set[str], replay_state, path: str) -> None:
    """Runs the module's last init call on its new tensors, replaying first a default init that was drawn
    into scratch earlier (module note)."""
    if replay_state is not None:
        live = torch.get_rng_state()
        torch.set_rng_state(replay_state)
        _default_init(module)
        torch.set_rng_state(live)
    if kind == "hf":
        _init_weights_checked(owner, module, fresh, path)
    else:
        _default_init(module)


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]


def _owns_tensors(module: nn.Module) -> bool:
    return bool(_own_tensors(module))


def _has_default_init(module: nn.Module) -> bool:
    return hasattr(module, "reset_parameters") or hasattr(module, "_reset_parameters")


def _default_init(module: nn.Module) -> None:
    """The init the module's constructor ran; none known (its values come from _init_weights) if neither."""
    init = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    if init is not None:
        init()


def _pretrained_model_class():
    """transformers' PreTrainedModel if transformers is imported (else no model can be one)."""
    return getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)


def _init_events(model: nn.Module) -> list[tuple[str, nn.Module, object]]:
    """(kind, module, owner) for every init call a CPU build of `model` makes, in its order (module
    note): ("default", m, None) is m's own default init, ("hf", m, owner) is owner._init_weights(m),
    ("peft", layer, (adapter, config)) is peft's init of that adapter's modules in a LoRA layer."""
    pretrained = _pretrained_model_class()
    adapters = _adapter_layers(model)
    added = {m for layer in adapters for m in _adapter_modules(layer)}  # built by peft after the base model
    events: list = []
    seen: set = set(added)

    def construct(m: nn.Module) -> None:
        if m in seen:
            return
        seen.add(m)
        # torch calls _reset_parameters() at the end of __init__, after the children were built
        after_children = not hasattr(m, "reset_parameters") and hasattr(m, "_reset_parameters")
        if _owns_tensors(m) and not after_children:
            events.append(("default", m, None))
        for child in m.children():
            construct(child)
        if _owns_tensors(m) and after_children:
            events.append(("default", m, None))
        if pretrained is not None and isinstance(m, pretrained):
            events.extend(("hf", x, m) for x in _post_init_order(m, pretrained, added))

    construct(model)
    for layer, configs in adapters.items():  # get_peft_model, layer by layer: build, then peft's init
        for adapter, config in configs.items():
            events.extend(("default", m, None) for m in _adapter_group(layer, (adapter, config)))
            events.append(("peft", layer, (adapter, config)))
    return events


def _post_init_order(model: nn.Module, pretrained: type, added: set) -> list[nn.Module]:
    """The modules `model.post_init()` passes to model._init_weights: its subtree children first
    (transformers' smart_apply), without nested models, which ran their own post_init already, and
    without peft's adapter modules (`added`), which did not exist yet."""
    order: list = []
    seen: set = set(added)

    def visit(m: nn.Module) -> None:
        seen.add(m)
        for child in m.children():
            if child not in seen and not isinstance(child, pretrained):
                visit(child)
        if _owns_tensors(m):
            order.append(m)

    visit(model)
    return order


# --- peft adapters (module note) ------------------------------------------------------------------------


def _peft_classes() -> tuple:
    """(BaseTuner, BaseTunerLayer, LoraLayer, AuxiliaryTrainingWrapper) if peft is imported, else Nones
    (then no model holds adapters)."""
    tuners, lora = sys.modules.get("peft.tuners.tuners_utils"), sys.modules.get("peft.tuners.lora.layer")
    other = sys.modules.get("peft.utils.other")
    return (getattr(tuners, "BaseTuner", None), getattr(tuners, "BaseTunerLayer", None),
            getattr(lora, "LoraLayer", None), getattr(other, "AuxiliaryTrainingWrapper", None))


def _adapter_layers(model: nn.Module) -> dict:
    """{tuner layer: {adapter name: its peft config}} in module order, for every peft tuner in `model`."""
    base_tuner, tuner_layer, _, _ = _peft_classes()
    if base_tuner is None:
        return {}
    layers: dict = {}
    for tuner in model.modules():
        if isinstance(tuner, base_tuner):
            for m in tuner.modules():
                if isinstance(m, tuner_layer) and m not in layers:
                    layers[m] = {a: c for a, c in tuner.peft_config.items() if a in getattr(m, "lora_A", {})}
    return layers


def _adapter_modules(layer: nn.Module) -> list[nn.Module]:
    """Every module peft added to a tuner layer: all but its base layer's subtree."""
    return [m for name, child in layer.named_children() if name != "base_layer" for m in child.modules()]


def _adapter_group(layer: nn.Module, owner) -> list[nn.Module]:
    """The modules of one adapter that peft's reset_lora_parameters initializes: lora_A[a] and lora_B[a]."""
    adapter = owner[0]
    return [d[adapter] for d in (getattr(layer, "lora_A", {}), getattr(layer, "lora_B", {})) if adapter in d]


def _init_adapter(tracker: "_UnitTracker", layer: nn.Module, owner, replay: dict) -> None:
    """Allocates an adapter's lora_A and lora_B, replays their default init (drawn into scratch at their
    turn, as peft's nn.Linear constructors drew it), then runs peft's own init on them."""
    adapter, config = owner
    group = _adapter_group(layer, owner)
    fresh = {m: tracker.allocate(m) for m in group}
    with contextlib.ExitStack() as stack:
        for m in group:  # a module that was not on meta keeps its values
            stack.enter_context(_scratch(m, tracker.specs[m], keep=fresh[m]))
        live = torch.get_rng_state()
        for m in group:
            if m in replay:
                torch.set_rng_state(replay.pop(m))
                _default_init(m)
        torch.set_rng_state(live)
        if config.init_lora_weights is not False:
            layer.reset_lora_parameters(adapter, config.init_lora_weights)
    for m in group:
        tracker.initialized(m)


_PEFT_INITS = (True, False, "gaussian")  # the LoRA inits that read nothing but the RNG


def _check_adapters(events: list, paths: dict) -> None:
    """Refuses, before anything is allocated, peft modules on meta whose init offload cannot run there."""
    _, tuner_layer, _, wrapper = _peft_classes()
    if tuner_layer is None:
        return
    fix = ("build the model on the CPU, or pass weights= (a callable name -> tensor, the adapter's values "
           "included) to offload.initialize")
    for kind, layer, owner in events:
        if kind == "peft" and (owner[1].init_lora_weights not in _PEFT_INITS or getattr(owner[1], "use_dora", False)):
            raise ValueError(f"peft adapter {owner[0]!r} ({paths[layer]}): init_lora_weights="
                             f"{owner[1].init_lora_weights!r}{' with use_dora' if owner[1].use_dora else ''} reads "
                             f"the base weights or data, which do not exist on the meta device; use "
                             f"init_lora_weights in {_PEFT_INITS} without DoRA, or {fix}")
    initialized = {id(t) for kind, m, owner in events if kind == "peft"
                   for g in _adapter_group(m, owner) for t in _own_tensors(g)}
    for m, path in paths.items():
        if isinstance(m, tuner_layer):
            left = [t for a in _adapter_modules(m) for t in _own_tensors(a) if t.is_meta and id(t) not in initialized]
            if left:
                raise ValueError(f"peft layer {type(m).__name__} ({path}): adapter tensors on the meta device that "
                                 f"offload cannot initialize (it initializes LoRA's lora_A and lora_B); {fix}")
        elif wrapper is not None and isinstance(m, wrapper) and any(t.is_meta for t in m.parameters()):
            raise ValueError(f"peft {type(m).__name__} ({path}): copies of base modules (modules_to_save, "
                             f"trainable tokens) cannot be made on the meta device; {fix}")


def _check_initializable(events: list, paths: dict) -> None:
    """Refuses, before anything is allocated, a meta module nothing would initialize."""
    _check_adapters(events, paths)
    by_init_weights = {m for kind, m, _ in events if kind == "hf"}
    for kind, m, _ in events:
        if kind == "peft":
            continue
        owns_meta = any(t is not None and t.is_meta for t in (*m._parameters.values(), *m._buffers.values()))
        if owns_meta and m not in by_init_weights and not _has_default_init(m):
            raise ValueError(
                f"module {type(m).__name__} ({paths[m]}): on the meta device but has neither reset_parameters() "
                f"nor _reset_parameters(), so offload cannot initialize it; define reset_parameters(), build the "
                f"model on the CPU, or pass weights= (a callable name -> tensor) to offload.initialize")


def _buffers_from_source(engine, module: nn.Module, fresh: set[str], specs: dict, calls: list, path: str) -> None:
    """With a weights source, a newly allocated module's buffers ([Note: buffers with a weights source]):
    persistent ones the source holds from it, the others from the module's own init calls (its parameters
    in scratch), NaN before those so that a float buffer no init sets is refused, not used."""
    prefix = "" if path == "<root>" else path + "."
    unset = []
    for n in [n for n in fresh if n in module._buffers]:
        value = _source_buffer(engine, prefix + n) if n not in module._non_persistent_buffers_set else None
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
    with _scratch(module, specs, keep=set(unset)):
        for kind, m, owner in calls:
            if m is module and kind == "default":
                _default_init(m)
            elif m is module:
                owner._init_weights(m)
    for n in unset:
        if module._buffers[n].is_floating_point() and module._buffers[n].isnan().any():
            raise ValueError(f"buffer {prefix + n} ({type(module).__name__}): on the meta device, not given by "
                             f"weights= and not set by the module's reset_parameters() or _init_weights(); set it "
                             f"there, give it from weights=, or build the model on the CPU")


def _source_buffer(engine, name: str) -> torch.Tensor | None:
    """A persistent buffer's value from the weights source, None when the source has no such name."""
    try:
        return engine.weights_source(name)
    except (KeyError, ValueError):
        return None


def _init_weights_checked(owner: nn.Module, module: nn.Module, fresh: set[str], path: str) -> None:
    """owner._init_weights(module). A module without a default init of its own (LlamaRMSNorm) gets its
    values only from there: NaN before, so a tensor _init_weights does not write is caught, not trained."""
    unset = [] if _has_default_init(module) else [n for n in fresh if getattr(module, n).is_floating_point()]
    for n in unset:
        getattr(module, n).fill_(float("nan"))
    owner._init_weights(module)
    for n in unset:
        if getattr(module, n).isnan().any():
            raise ValueError(
                f"module {type(module).__name__} ({path}): {type(owner).__name__}._init_weights() leaves {n} "
                f"uninitialized and the module has no reset_parameters(); define reset_parameters(), build "
                f"the model on the CPU, or pass weights= (a callable name -> tensor) to offload.initialize")


@contextlib.contextmanager
def _scratch(module: nn.Module, specs: dict, keep):
    """Gives the module's own tensors not named in `keep` throwaway CPU storage while an init runs: the
    init draws from the RNG as in the CPU build but changes no tensor other than those in `keep`. The
    scratch has the meta tensor's shape and dtype (`specs`): a placed parameter holds an empty
    placeholder or a compute-dtype view, and the draws depend on both."""
    saved = {}
    for table in (module._parameters, module._buffers):
        for n, t in table.items():
            if t is not None and n not in keep:
                saved[n] = (table, t)
                fake = torch.empty(specs[n][0], dtype=specs[n][1])
                table[n] = nn.Parameter(fake, t.requires_grad) if isinstance(t, nn.Parameter) else fake
    try:
        yield
    finally:
        for n, (table, t) in saved.items():
            table[n] = t


class _UnitTracker:
    """Allocates modules' meta tensors on the CPU, rebinding every holder and slot of a parameter (tied
    weights: several), and places a unit once the last of its parameters is initialized.

    [Note: adapters initialized late]
    peft's adapters are initialized after the whole base model (module note), so a decoder layer holding
    lora_A/lora_B would wait for the end with its base weights in memory: all of them, 27 GB for a 7B
    model. A unit holding base parameters and such `late` ones is placed when its base parameters are
    initialized, the late ones zero; when the last of them is initialized, their values are written into
    the unit's homes (only the chunks they touch are read and written back)."""

    def __init__(self, engine, model: nn.Module, late: set = frozenset()):
        self.engine = engine
        self.slot_of = {s.param: (u, s) for u in engine.units for s in u.slots}
        self.holders: dict = {}  # parameter -> every (module, name) holding it
        for m in model.modules():
            for n, p in m._parameters.items():
                if p is not None:
                    self.holders.setdefault(p, []).append((m, n))
        self.late = {u.index: [s for s in u.slots if s.param in late] for u in engine.units
                     if any(s.param in late for s in u.slots) and not all(s.param in late for s in u.slots)}
        self.late_left = {i: len(slots) for i, slots in self.late.items()}
        self.pending = {u.index: len(u.slots) - len(self.late.get(u.index, ())) for u in engine.units}
        self.specs = {m: {n: (t.shape, t.dtype) for n, t in [*m._parameters.items(), *m._buffers.items()]
                          if t is not None} for m in model.modules()}  # before anything is placed
        self.allocated: dict = {}  # module -> [(old meta parameter, new one)] until it is initialized
        self.progress = _Progress(len(engine.units))

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
                    _fill_late(self.engine, u, self.late[u.index])
                continue
            self.pending[u.index] -= 1
            if self.pending[u.index] == 0:
                late = self.late.get(u.index, [])
                metas = [s.param for s in late]
                for s in late:  # stand-ins the weight handle may detach (a meta parameter cannot be)
                    s.param = nn.Parameter(torch.empty(0), s.param.requires_grad)
                try:
                    place(self.engine, u, late)
                finally:
                    for s, p in zip(late, metas):
                        s.param = p
                self.progress.update(u.numel * self.engine.rt.dtype.itemsize + u.trainable_numel * 4)


def _fill_late(engine, unit: Unit, slots) -> None:
    """[Note: adapters initialized late] The slots' values into the placed unit's weight and master homes;
    the parameters then follow the weight handle (attached where the weights live in hbm, else empty)."""
    values = {s.param: s.param.detach().reshape(-1) for s in slots}

    def fill(dst, slot, lo, hi):
        dst.copy_(values[slot.param][lo:hi])

    if engine.states[unit.index] is not None:
        write_slots(engine, unit, "master", [s for s in slots if s.trainable], fill, keep=True)
    write_slots(engine, unit, "weight", slots, fill, keep=True)
    w = engine.weights[unit.index]
    w._attach() if w.home == "hbm" else w._detach()


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
def place(engine, unit: Unit, late=()) -> None:
    """Copies the unit's initial values into its weight and optimizer-state homes. Resident homes are
    filled in place; nvme homes chunk by chunk through the pool. `late`: slots left zero, whose values
    come later ([Note: adapters initialized late])."""
    p = engine.rt.placement
    given = [s for s in unit.slots if not any(s is x for x in late)]
    values = {s.name: _initial_value(engine, s) for s in given}  # keeps the values past _detach()
    w = WeightHandle(unit, p.weight_home[unit.index], engine.rt.dtype, engine.rt)
    pieces = [(s.offset, values[s.name]) for s in given]
    if w.home == "nvme":
        _fill_chunks(engine, w.key, {i: w.chunks[i] for i in w.held}, engine.rt.dtype, pieces)
    elif w.home == "dram":
        for i in w.held:  # every chunk, or with zero_stage 3 the ones this rank owns
            copy_spans(pieces, *w.chunks[i], w.dram[w.span(i)])
    else:
        copy_spans(pieces, 0, unit.numel, w.hbm)
        w._attach()
    engine.weights[unit.index] = w
    if unit.trainable_numel:
        st = OptimState(unit, p.state_home[unit.index], engine.rt)
        pieces = [(s.offset, values[s.name]) for s in given if s.trainable]
        for i in st.mine:  # every window, or over ranks the ones this rank owns
            b, e = st.chunks[i]
            if st.home == "nvme":
                _fill_chunks(engine, unit.key("master", engine.rt.rank), {i: (b, e)}, torch.float32, pieces)
            else:
                copy_spans(pieces, b, e, st.t["master"][st.span(i)])
        engine.states[unit.index] = st


def _fill_chunks(engine, key: str, chunks: dict[int, tuple[int, int]], dtype, pieces) -> None:
    """Writes (offset, flat value) pieces, zero elsewhere, to the swap chunks of `key` ({chunk index:
    bounds}), one pool chunk at a time."""
    for i, (b, e) in chunks.items():
        buf = engine.rt.staging.acquire(e - b, dtype, f"initial {key}")
        try:
            copy_spans(pieces, b, e, buf)
            engine.rt.store.write(chunk_key(key, i), buf).wait()
        finally:
            engine.rt.staging.release(buf)


def _initial_value(engine, s) -> torch.Tensor:
    """A parameter's initial value, flat: from the weights source when given, else the parameter."""
    if s.record is not None:  # its bytes as flat elements ([Note: quantized weights as records] in offload.plan.quantized)
        if s.record.pending:  # built on meta: quantized from its value now, as from_pretrained quantizes
            value = s.param.detach() if engine.weights_source is None else engine.weights_source(s.name)
            s.param = s.record.quantize(value)
        flat = torch.zeros(s.numel, dtype=engine.rt.dtype)
        flat.view(torch.uint8)[:s.record.nbytes].copy_(s.record.capture())
        return flat
    if engine.weights_source is None:
        return s.param.detach().reshape(-1)
    t = engine.weights_source(s.name)
    if tuple(t.shape) != tuple(s.shape):
        raise ValueError(f"weights[{s.name!r}]: shape {tuple(t.shape)} but the model expects {tuple(s.shape)}; "
                         "the checkpoint does not belong to this model config")
    return t.reshape(-1)


# -- a unit's buffers at their homes, chunk by chunk (checkpoints, and adapters initialized late) --

def unit_buffers(engine, unit, kind: str, write: bool = False, keep: bool = True, only=None):
    """(begin, end, host tensor) over one of the unit's flat buffers (master, exp_avg, exp_avg_sq, grad, or
    weight in the compute dtype), one chunk at a time, from its home: nvme chunks through a pool chunk (a
    key never written reads as zeros: moments before the first step), accelerator-resident ones through a
    host copy, host-resident ones as views. write: the tensor goes back to its home when the caller asks
    for the next one (not after an exception). keep=False: it starts zeroed instead of read. only: the
    indices of the chunks / windows to visit (default: every one this rank holds)."""
    st, w = engine.states[unit.index], engine.weights[unit.index]
    if kind == "weight":
        w.wait_for_write()  # new weights written behind by the last step
        spans, home, key, dtype = w.chunks, w.home, w.key, w.dtype
        flat = w.hbm if w.home == "hbm" else w.dram
    else:
        spans, home, key, dtype = st.chunks, st.home, unit.key(kind, engine.rt.rank), torch.float32
        flat = st.t.get(kind)
    held = w.held if kind == "weight" else st.mine  # the chunks / windows this rank holds
    for i in held if only is None else [i for i in held if i in only]:
        b, e = spans[i]
        if home != "nvme":
            handle = w if kind == "weight" else st
            at_home = st.grad(i) if kind == "grad" else flat[handle.span(i)]  # grad: in the accumulator's dtype
            t = at_home.cpu()
            if not keep:
                t.zero_()
            yield b, e, t
            if write and t is not at_home:
                at_home.copy_(t)
            continue
        k = chunk_key(key, i)
        buf = engine.rt.staging.acquire(e - b, dtype, f"checkpoint {k}")
        try:
            if keep and k in engine.rt.store:
                engine.rt.store.read(k, into=buf).wait()
            else:
                buf.zero_()
            yield b, e, buf
            if write:
                engine.rt.store.write(k, buf).wait()
        finally:
            engine.rt.staging.release(buf)


def write_slots(engine, unit, kind: str, slots, fill, keep: bool) -> None:
    """fill(dst, slot, lo, hi) writes elements [lo, hi) of `slot` into dst, for each slot in `slots`,
    into the unit's `kind` buffer at its home. keep=True: only the chunks the slots touch are read and
    written back; keep=False: every chunk is written (zero where no slot is)."""
    only = None
    if keep:
        st, w = engine.states[unit.index], engine.weights[unit.index]
        spans = w.chunks if kind == "weight" else st.chunks
        only = {i for i, (b, e) in enumerate(spans) if any(b < s.offset + s.numel and s.offset < e for s in slots)}
    for b, e, buf in unit_buffers(engine, unit, kind, write=True, keep=keep, only=only):
        for s in slots:
            lo, hi = max(b, s.offset), min(e, s.offset + s.numel)
            if lo < hi:
                fill(buf[lo - b:hi - b], s, lo - s.offset, hi - s.offset)



@torch.no_grad()
def unit_values(engine, unit: Unit, frozen: bool = True):
    """Yields (slot, fp32 tensor) for every parameter of `unit`: the master for trainable ones, a quantized
    weight dequantized; frozen=False:
    the trainable ones only, and their frozen weights are not read (a LoRA adapter beside a base on nvme)."""
    st = engine.states[unit.index]
    w = engine.weights[unit.index]
    master = weights = None
    if not frozen and st is None:
        return
    if st is not None and engine.rt.sharded:
        master = _gather_master(engine, unit, st)
    elif st is not None:
        if st.home == "nvme":
            master = _read_chunks(engine, unit.key("master", engine.rt.rank), st.chunks, torch.float32)
        else:
            master = st.t["master"]
    if not frozen:
        pass
    elif any(not s.trainable for s in unit.slots) and w.partitioned:
        weights = _gather_weights(engine, w)
    elif any(not s.trainable for s in unit.slots):
        if w.home == "nvme":
            w.wait_for_write()
            weights = _read_chunks(engine, w.key, w.chunks, w.dtype)
        else:
            weights = w.hbm if w.home == "hbm" else w.dram
    for s in unit.slots if frozen else [s for s in unit.slots if s.trainable]:
        yield s, s.value(master if s.trainable else weights)


def _read_chunks(engine, key: str, chunks, dtype) -> torch.Tensor:
    """A buffer stored in swap chunks, read whole into a new tensor (its values are returned whole)."""
    out = torch.empty(chunks[-1][1] if chunks else 0, dtype=dtype)
    tickets = [engine.rt.store.read(chunk_key(key, i), into=out[b:e]) for i, (b, e) in enumerate(chunks)]
    for t in tickets:
        t.wait()
    return out


def _gather_master(engine, unit, st) -> torch.Tensor:
    """A unit's fp32 master whole on every rank ([Note: windows over ranks] in offload.state.optim)."""
    key = unit.key("master", engine.rt.rank)
    return _gathered(engine, st.chunks, st.owner, torch.float32, st.home, lambda i: chunk_key(key, i),
                     lambda i: st.t["master"][st.span(i)])


def _gather_weights(engine, w) -> torch.Tensor:
    """A partitioned unit's weights whole on every rank ([Note: partitioned weights] in offload.state.residency)."""
    w.wait_for_write()
    return _gathered(engine, w.chunks, w.owner, w.dtype, w.home, lambda i: chunk_key(w.key, i),
                     lambda i: w.dram[w.span(i)])


def _gathered(engine, spans, owners, dtype, home: str, key_of, resident) -> torch.Tensor:
    """A buffer whole on every rank, each span broadcast (as bytes) from the rank that owns it, which reads
    it from its home: swap chunk key_of(i), or the resident tensor resident(i). A collective: every rank
    must ask for it."""
    import torch.distributed as dist

    out = torch.empty(spans[-1][1] if spans else 0, dtype=dtype)
    for i, (b, e) in enumerate(spans):
        if owners[i] == engine.rt.rank:
            if home == "nvme":
                engine.rt.store.read(key_of(i), into=out[b:e]).wait()
            else:
                out[b:e].copy_(resident(i))
        dist.broadcast(out[b:e].view(torch.uint8), src=owners[i])
    return out
