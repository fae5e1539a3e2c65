"""The init calls a CPU build of a model makes, in its order, and the means to replay them on a model built
on the meta device (offload.state.materialize runs them): `init_events` lists them ([Note: the CPU build's
init order]), `check_initializable` refuses up front a module none of them would initialize, `run_init`
and `default_init` run one, `scratch` lets an init draw from the RNG without writing the tensors it must
not change. Includes peft's LoRA layers: their adapters come after the base model, in peft's order."""

from __future__ import annotations

import contextlib
import sys

import torch
from torch import nn

# [Note: the CPU build's init order]
# - A torch module draws its values in its constructor: `reset_parameters()` for most (nn.Linear,
#   nn.Embedding, our own modules: in `model.modules()` order, the seeding contract of offload.models);
#   `_reset_parameters()` for nn.MultiheadAttention, which runs at the end of its __init__, after its
#   child out_proj was built and initialized (then it zeroes out_proj.bias): after its children here too.
# - A Hugging Face model (transformers' PreTrainedModel) is first built like that, with each module's own
#   default init, and then `post_init()`, at the end of its __init__, re-initializes every module with
#   the model's `_init_weights`, children before parents (transformers' smart_apply); a nested model (the
#   LlamaModel in LlamaForCausalLM) ran its own post_init at the end of its own construction, so the outer
#   one skips its modules. A module's default values are thus drawn long before the `_init_weights` values
#   that overwrite them (all of LlamaModel's defaults come before its first `_init_weights` draw). To keep
#   both the RNG stream and one-unit-at-a-time memory, a default init that is overwritten later is drawn
#   into scratch at its turn, only its RNG state kept; when the module is allocated, at its last init call,
#   that state is replayed to give the same default values, and `_init_weights` then runs on the live RNG.
#   The cost: those default values are drawn twice.
# - A module already materialized when its turn comes (the tied lm_head of an embedding) draws into
#   scratch, so the RNG advances as in the CPU build, where it drew into its own tensor before tying.
# - Not in construction order, so not equal to their CPU build: nn.Transformer (its _reset_parameters
#   redraws its whole subtree at the end) and nn.TransformerEncoder/Decoder (deep copies of one layer).
#   Each of their submodules is initialized by its own default init here.
# - A peft LoRA model (`get_peft_model(base, LoraConfig(...))`) was built in two steps: the base model
#   whole (its post_init included), then, layer by layer, each adapter's lora_A and lora_B with their
#   default init followed by peft's own `reset_lora_parameters` (lora_A drawn, lora_B zero: the model
#   starts as the base model). The adapter modules are left out of the base model's construction and
#   post_init here, and come after it in that order ("peft" events). Inits that read the base weights
#   or data (PiSSA, OLoRA, LoftQ, EVA, DoRA's magnitude, ...) cannot run on the meta device: refused.


def last_events(events: list) -> dict:
    """module -> the index of the event that allocates and initializes it: its last one; for an adapter's
    modules, the "peft" event of their layer (peft's init runs on them together)."""
    last = {}
    for i, (kind, m, owner) in enumerate(events):
        for module in adapter_group(m, owner) if kind == "peft" else [m]:
            last[module] = i
    return last


def run_init(kind: str, module: nn.Module, owner, fresh: set[str], replay_state, path: str) -> None:
    """Runs the module's last init call on its new tensors, replaying first a default init that was drawn
    into scratch earlier ([Note: the CPU build's init order])."""
    if replay_state is not None:
        live = torch.get_rng_state()
        torch.set_rng_state(replay_state)
        default_init(module)
        torch.set_rng_state(live)
    if kind == "hf":
        _init_weights_checked(owner, module, fresh, path)
    else:
        default_init(module)


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]


def owns_tensors(module: nn.Module) -> bool:
    return bool(_own_tensors(module))


def _has_default_init(module: nn.Module) -> bool:
    return hasattr(module, "reset_parameters") or hasattr(module, "_reset_parameters")


def default_init(module: nn.Module) -> None:
    """The init the module's constructor ran; none known (its values come from _init_weights) if neither."""
    init = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    if init is not None:
        init()


def _pretrained_model_class():
    """transformers' PreTrainedModel if transformers is imported (else no model can be one)."""
    return getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)


def init_events(model: nn.Module) -> list[tuple[str, nn.Module, object]]:
    """(kind, module, owner) for every init call a CPU build of `model` makes, in its order ([Note: the CPU
    build's init order]): ("default", m, None) is m's own default init, ("hf", m, owner) is
    owner._init_weights(m), ("peft", layer, (adapter, config)) is peft's init of that adapter's modules in a
    LoRA layer."""
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
        if owns_tensors(m) and not after_children:
            events.append(("default", m, None))
        for child in m.children():
            construct(child)
        if owns_tensors(m) and after_children:
            events.append(("default", m, None))
        if pretrained is not None and isinstance(m, pretrained):
            events.extend(("hf", x, m) for x in _post_init_order(m, pretrained, added))

    construct(model)
    for layer, configs in adapters.items():  # get_peft_model, layer by layer: build, then peft's init
        for adapter, config in configs.items():
            events.extend(("default", m, None) for m in adapter_group(layer, (adapter, config)))
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
        if owns_tensors(m):
            order.append(m)

    visit(model)
    return order


# --- peft adapters ([Note: the CPU build's init order]) --------------------------------------------------


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


def adapter_group(layer: nn.Module, owner) -> list[nn.Module]:
    """The modules of one adapter that peft's reset_lora_parameters initializes: lora_A[a] and lora_B[a]."""
    adapter = owner[0]
    return [d[adapter] for d in (getattr(layer, "lora_A", {}), getattr(layer, "lora_B", {})) if adapter in d]


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
                   for g in adapter_group(m, owner) for t in _own_tensors(g)}
    for m, path in paths.items():
        if isinstance(m, tuner_layer):
            left = [t for a in _adapter_modules(m) for t in _own_tensors(a) if t.is_meta and id(t) not in initialized]
            if left:
                raise ValueError(f"peft layer {type(m).__name__} ({path}): adapter tensors on the meta device that "
                                 f"offload cannot initialize (it initializes LoRA's lora_A and lora_B); {fix}")
        elif wrapper is not None and isinstance(m, wrapper) and any(t.is_meta for t in m.parameters()):
            raise ValueError(f"peft {type(m).__name__} ({path}): copies of base modules (modules_to_save, "
                             f"trainable tokens) cannot be made on the meta device; {fix}")


def check_initializable(events: list, paths: dict) -> None:
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
def scratch(module: nn.Module, specs: dict, keep):
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

