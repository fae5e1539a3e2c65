"""LoRA for `offload train --lora R`: the base model frozen, peft's LoRA adapters trained, and what is saved.

The model (a preset or a HF directory, built on the meta device) is wrapped with peft's `get_peft_model`
on the meta device; the Engine then materializes it unit by unit as for any model: frozen base weights in
the offload_param tier with no master, moments or gradients, the adapters' states in the offload_optimizer
tier (hbm too: docs/training.md "LoRA").
"""

from __future__ import annotations

import copy
import difflib
import os
import warnings

import torch

from offload.models import _HF_NAMES, hf_name

# [Note: the adapters' initial values]
# A preset's base has no checkpoint: the Engine initializes the wrapped model as its CPU build (the base by the
# seeding contract, then peft's LoRA init: offload.state.materialize). A HF directory's base streams from its
# safetensors through `LoraWeights`, which maps peft's names back to the checkpoint's (`base_model.model.`
# prefix, `.base_layer.` infix) and gives the adapters the values `torch.manual_seed(seed); get_peft_model(base,
# config)` gives them on a base loaded with from_pretrained: per LoRA layer in module order, lora_A's and
# lora_B's nn.Linear init (the constructors' draws), then peft's reset_lora_parameters (lora_A drawn, lora_B
# zero, so training starts from the base model's logits).
#
# [Note: what a LoRA run saves]
# `--save DIR`: the adapter as peft writes it (adapter_config.json + adapter_model.safetensors) with the
# tokenizer files, read from the trainable masters alone. For a HF directory it is peft's own save_pretrained
# with the directory's absolute path as base_model_name_or_path, so `AutoPeftModelForCausalLM.from_pretrained(DIR)`
# loads it with no hub. A preset has no HF base to load it on: its adapter is written in transformers' Llama
# names and its frozen base exported beside it as a HF directory, DIR/base (what base_model_name_or_path names;
# a README.md says which preset it is), so the same call loads it.
# `--save-merged DIR`: a plain HF model, each targeted linear's weight W + (alpha / r) B @ A (peft's
# merge_and_unload), streamed unit by unit from the engine, names without peft's wrappers, with the config
# (use_cache as it was), generation config and tokenizer files: AutoModelForCausalLM and AutoTokenizer load it.
# A quantized base is dequantized by bitsandbytes unit by unit and merged the same way.
#
# [Note: the dtype a save writes]
# `--save-dtype` (save_dtype()): auto, the default, writes the source's dtype (a bf16 directory saves as bf16,
# half the bytes of the fp32 masters), an adapter fp32 (as peft keeps adapters on a bf16 base); config.json
# says what the tensors are. A merge in dtype d is the one peft makes on the base loaded in d: W rounded to d,
# plus the fp32 product B @ A, rounded once, so --save-merged of a QLoRA run equals merge_and_unload on
# from_pretrained's base dequantized in its own dtype, bit for bit.

DEFAULT_TARGETS = ("q_proj", "v_proj")  # a preset's (peft's default for Llama)
ALL_LINEAR = "all-linear"               # peft's shorthand: every linear but the output head
# The model card of a preset's adapter (peft writes one for a HF directory's, naming the base's path there).
PRESET_CARD = """---
base_model: {base}
library_name: peft
tags:
- lora
---
A LoRA adapter (r {r}, alpha {alpha:g}) trained by `offload train` on offload's `{name}` preset: a Llama-shaped
model that offload initializes from a seed, not a published checkpoint. Its frozen base is exported beside this
adapter, in {base}, which adapter_config.json's base_model_name_or_path names, so
`AutoPeftModelForCausalLM.from_pretrained(<this directory>)` loads both.
"""
PEFT_PREFIX = "base_model.model."   # what get_peft_model puts before the base model's names
BASE_INFIX = ".base_layer."         # a LoRA layer's wrapped linear
# transformers' Llama linear names -> the preset model's (offload.models): the last part of each name.
PRESET_TARGETS = {theirs.rstrip(".").rsplit(".", 1)[-1]: ours.rstrip(".").rsplit(".", 1)[-1]
                  for ours, theirs in _HF_NAMES.items() if ours.startswith(("attn.w", "mlp."))}


def peft_module():
    """peft, or one line naming the extra that brings it."""
    try:
        import peft
    except ImportError as e:
        raise ValueError("--lora: needs the peft package, which is not installed; pip install 'offload[lora]' "
                         "(in a source checkout: pip install -e '.[lora]')") from e
    return peft


def lora_settings(args) -> dict | None:
    """{r, alpha, targets, dropout} from the --lora flags (None without --lora), checked."""
    r = getattr(args, "lora", None)
    extra = [f for f in ("lora_alpha", "lora_targets", "lora_dropout") if getattr(args, f, None) is not None]
    if r is None:
        if extra:
            raise ValueError(f"--{extra[0].replace('_', '-')}: applies to a LoRA run only; add --lora R")
        return None
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"--lora={r}: the LoRA rank must be a positive integer (8, 16, 64)")
    alpha = 2.0 * r if args.lora_alpha is None else args.lora_alpha
    if not (isinstance(alpha, (int, float)) and alpha > 0):
        raise ValueError(f"--lora-alpha={alpha}: must be a number > 0 (the update is scaled by alpha / r)")
    dropout = 0.0 if args.lora_dropout is None else args.lora_dropout
    if not (isinstance(dropout, (int, float)) and 0 <= dropout < 1):
        raise ValueError(f"--lora-dropout={dropout}: must be a probability in [0, 1)")
    return {"r": r, "alpha": float(alpha), "targets": target_names(args.lora_targets), "dropout": float(dropout)}


def target_names(targets) -> list[str] | None:
    """--lora-targets as a list of names (all-linear as peft spells it); None when not given: the model's default
    (lora_targets)."""
    if targets is None:
        return None
    names = [t.strip() for t in (targets.split(",") if isinstance(targets, str) else targets) if t.strip()]
    names = [ALL_LINEAR if n.lower() == ALL_LINEAR else n for n in names]
    if not names:
        raise ValueError(f"--lora-targets={targets!r}: no module name; pass e.g. q_proj,v_proj")
    if len(names) > 1 and ALL_LINEAR in names:
        raise ValueError(f"--lora-targets={targets}: {ALL_LINEAR} stands alone (every linear but the output head); "
                         f"pass it alone or name the linears")
    return names


def lora_targets(model: torch.nn.Module, info: dict, lora: dict) -> list[str]:
    """The --lora-targets of a run, checked against the model: the names given (each must name modules of the
    model, as peft matches them: the whole path or its last parts), or all-linear; without them a preset's
    DEFAULT_TARGETS, a HF model's peft default for its model_type (else an error saying what to pass)."""
    targets = lora["targets"]
    if info["kind"] == "preset":
        return list(DEFAULT_TARGETS) if targets is None else targets
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if targets is None:
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as peft_defaults

        if model_type not in peft_defaults:
            raise ValueError(f"--lora: peft has no default targets for model_type={model_type!r}; pass --lora-targets "
                             f"with this model's linears ({', '.join(_linear_names(model))}) or {ALL_LINEAR}")
        return list(peft_defaults[model_type])
    if targets == [ALL_LINEAR]:
        return targets
    paths = [path for path, _ in model.named_modules()]
    for t in targets:
        if not any(path == t or path.endswith("." + t) for path in paths):
            linears = _linear_names(model)
            near = difflib.get_close_matches(t, linears, n=3) or difflib.get_close_matches(
                t, sorted({p.rsplit(".", 1)[-1] for p in paths}), n=3)
            raise ValueError(f"--lora-targets={','.join(targets)}: {t} names no module of the model (model_type "
                             f"{model_type})" + (f"; nearest: {', '.join(near)}" if near else "")
                             + f"; its linears: {', '.join(linears)}; or pass {ALL_LINEAR}")
    return targets


def _linear_names(model: torch.nn.Module) -> list[str]:
    """The last parts of the names of the model's linear layers (nn.Linear, transformers' Conv1D), sorted."""
    return sorted({path.rsplit(".", 1)[-1] for path, m in model.named_modules()
                   if path and (isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D")})


def apply_lora(model: torch.nn.Module, info: dict, lora: dict) -> torch.nn.Module:
    """The peft LoRA model around `model` (still on the meta device); the base's parameters frozen. Targets that
    are not linear layers (an embedding, which peft adapts too) are refused."""
    peft = peft_module()
    given = targets = lora_targets(model, info, lora)
    if info["kind"] == "preset":
        targets = list(PRESET_TARGETS) if targets == [ALL_LINEAR] else targets
        unknown = [t for t in targets if t not in PRESET_TARGETS]
        if unknown:
            raise ValueError(f"--lora-targets={','.join(targets)}: {', '.join(unknown)} is not a linear of the "
                             f"preset; use transformers' Llama names: {', '.join(PRESET_TARGETS)}")
        targets = [PRESET_TARGETS[t] for t in targets]
    config = peft.LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], bias="none",
                             target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else targets)
    linears = _linear_names(model)  # before peft wraps them
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as e:  # peft: a target it cannot adapt (a convolution, an unknown layer)
        why = str(e).splitlines()[0].rstrip(".")
        raise ValueError(f"--lora-targets={','.join(given)}: {why}; name linears of the model "
                         f"({', '.join(linears)})") from e
    other = {path.rsplit(".", 1)[-1]: type(layer.get_base_layer()).__name__ for path, layer in _lora_layers(wrapped)
             if isinstance(layer.get_base_layer(), (torch.nn.Embedding, torch.nn.modules.conv._ConvNd))}
    if other:  # peft adapts embeddings too, but their adapters are not lora_A / lora_B: see adapter_init, merged_items
        raise ValueError(f"--lora-targets={','.join(given)}: "
                         + ", ".join(f"{name} ({kind})" for name, kind in other.items())
                         + " is not a linear layer, and offload trains LoRA adapters of linear layers only; target "
                         f"linears of this model ({', '.join(linears)}), or train every parameter, "
                         f"{', '.join(other)} included, without --lora")
    return wrapped


def base_name(name: str) -> str:
    """peft's name of a base model tensor -> the base model's own: 'base_model.model.model.layers.0.
    self_attn.q_proj.base_layer.weight' -> 'model.layers.0.self_attn.q_proj.weight'."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX):]
    while BASE_INFIX in name:  # nested: an adapter on a parameter of a layer with one on another parameter
        name = name.replace(BASE_INFIX, ".")
    return name


def _lora_layers(model: torch.nn.Module):
    """(module path, peft LoRA layer) in module order."""
    from peft.tuners.lora import LoraLayer

    return [(path, m) for path, m in model.named_modules() if isinstance(m, LoraLayer)]


@torch.no_grad()
def adapter_init(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """{parameter name: initial value} of every LoRA adapter, as a CPU build gives them ([Note: the adapters'
    initial values]); the model's own (meta) tensors are left as they are."""
    torch.manual_seed(seed)
    values = {}
    for path, layer in _lora_layers(model):
        for adapter in list(layer.lora_A):
            originals = {d: getattr(layer, d)[adapter] for d in ("lora_A", "lora_B")}
            for d, meta in originals.items():  # a CPU twin, drawn as nn.Linear's constructor draws
                twin = copy.deepcopy(meta).to_empty(device="cpu")
                twin.reset_parameters()
                getattr(layer, d)[adapter] = twin
            try:
                init = _init_of(model, adapter)
                if init is not False:
                    layer.reset_lora_parameters(adapter, init)
                for d in originals:
                    for n, t in getattr(layer, d)[adapter].named_parameters():
                        values[f"{path}.{d}.{adapter}.{n}"] = t.detach().clone()
            finally:
                for d, meta in originals.items():
                    getattr(layer, d)[adapter] = meta
    return values


def _init_of(model: torch.nn.Module, adapter: str):
    """init_lora_weights of `adapter` in the peft model's config (True: peft's default)."""
    config = getattr(model, "peft_config", {}).get(adapter)
    return True if config is None else config.init_lora_weights


class LoraWeights:
    """The weights source of a HF directory's LoRA run: base tensors from the checkpoint under their own
    names, adapters at their initial values ([Note: the adapters' initial values])."""

    def __init__(self, source, model: torch.nn.Module, seed: int):
        self.source = source
        self.adapters = adapter_init(model, seed)

    def __call__(self, name: str) -> torch.Tensor:
        if name in self.adapters:
            return self.adapters[name]
        if ".lora_" in name:
            raise ValueError(f"weights[{name!r}]: an adapter LoraWeights has no initial value for: it initializes "
                             "the lora_A and lora_B adapters of linear layers; target linear layers only")
        return self.source(base_name(name))

    def close(self) -> None:
        self.source.close()


# --- saving ----------------------------------------------------------------------------------------------


def merged_items(items, scale: float, dtype: torch.dtype | None = None, transposed=()):
    """(base model name, tensor) for every tensor of the merged model, from (peft name, tensor) pairs (the
    engine's state_items(), or a checkpoint's weights): a LoRA layer's weight W + scale B @ A (peft's merge,
    scale = alpha / r; transposed for the layers in `transposed`, whose weight is stored [in, out]:
    transformers' Conv1D, GPT-2's, peft's fan_in_fan_out), the adapters themselves left out. Each tensor in
    `dtype` (None: as it comes), merged as peft's merge_and_unload merges into a base loaded in that dtype: W in
    `dtype` plus the adapters' product in fp32, rounded once. A layer's three tensors come in one unit
    (offload.plan.units keeps adapters in their layer's unit); they are held until all three have come."""
    transposed = set(transposed)
    pending: dict[str, dict] = {}
    for name, value in items:
        layer, part = _lora_part(name)
        if layer is None:
            yield base_name(name), value if dtype is None else value.to(dtype)
            continue
        got = pending.setdefault(layer, {})
        got[part] = value
        if len(got) == 3:
            del pending[layer]
            w, a, b = got["W"] if dtype is None else got["W"].to(dtype), got["A"].float(), got["B"].float()
            delta = b @ a                                                     # [out, r] @ [r, in]
            yield base_name(f"{layer}.weight"), (w.float() + scale * (delta.T if layer in transposed else delta)
                                                 ).to(w.dtype)
    if pending:
        layer, got = next(iter(pending.items()))
        raise ValueError(f"merging LoRA layer {layer}: it has {', '.join(sorted(got))} of W, A and B; the weights "
                         "are not those of one LoRA adapter per linear (an adapter on a parameter, as peft puts on an "
                         "MoE's stacked experts, is not merged); save the adapter with --save instead")


def transposed_layers(model: torch.nn.Module) -> list[str]:
    """The paths of the model's LoRA layers whose base weight is stored [in, out] (peft's fan_in_fan_out)."""
    return [path for path, layer in _lora_layers(model) if getattr(layer, "fan_in_fan_out", False)]


def parameter_adapters(model: torch.nn.Module) -> list[str]:
    """The paths of adapters peft put on parameters rather than on linears (target_parameters: an MoE's stacked
    experts, which peft targets for all-linear or for their linears' names), which merged_items does not merge."""
    from peft.tuners.lora import layer

    wrapper = getattr(layer, "ParamWrapper", None)  # peft >= 0.17
    return [] if wrapper is None else [path for path, m in model.named_modules() if isinstance(m, wrapper)]


def check_mergeable(model: torch.nn.Module) -> None:
    """--save-merged merges adapters of linears: a model with adapters on parameters is refused before it trains."""
    params = parameter_adapters(model)
    if params:
        raise ValueError(f"--save-merged: peft put {len(params)} adapters on parameters, not linears "
                         f"({base_name(params[0])}{', ...' if len(params) > 1 else ''}: an MoE's router or stacked "
                         "experts), which are not merged; save the adapter with --save, or name linears of the model "
                         "in --lora-targets")


def _lora_part(name: str) -> tuple[str | None, str | None]:
    """(the LoRA layer's path, "W" | "A" | "B") of a peft name, (None, None) for any other tensor."""
    if name.endswith(".base_layer.weight"):
        return name[: -len(".base_layer.weight")], "W"
    for part in ("A", "B"):
        layer, found, rest = name.partition(f".lora_{part}.")
        if found and rest.count(".") == 1 and rest.endswith(".weight"):  # <adapter>.weight
            return layer, part
    if ".lora_" in name:
        raise ValueError(f"{name}: an adapter tensor merging does not know (it merges LoRA's lora_A and lora_B "
                         "weights of linears); save the adapter with --save instead")
    return None, None


def hf_names(items):
    """A preset's names as transformers' Llama names (offload.models.hf_name)."""
    return ((hf_name(n), t) for n, t in items)


def save_dtype(info: dict, choice: str, adapter: bool = False) -> torch.dtype:
    """The dtype `--save-dtype choice` writes: bf16, fp16 or fp32 as named; auto: the source's (a HF directory's
    as from_pretrained(dtype="auto") reads it, a preset's fp32), an adapter's fp32 (peft keeps adapters in fp32
    on a bf16 or fp16 base: its autocast_adapter_dtype)."""
    from offload.integrations.hf_io import DTYPES, source_dtype

    if choice != "auto":
        return DTYPES[choice]
    return torch.float32 if adapter else source_dtype(info["hf_config"], info["source"])


def save_adapter(engine, model: torch.nn.Module, info: dict, lora: dict, directory: str, choice: str) -> str:
    """--save of a LoRA run ([Note: what a LoRA run saves]) in `--save-dtype choice`; every rank calls it, rank
    0 writes."""
    from offload.integrations.hf_io import copy_companions

    dtype = save_dtype(info, choice, adapter=True)
    state = {n: t.to(dtype) for n, t in engine.trainable_state_dict().items()}  # masters: no frozen weight read
    base = os.path.join(directory, "base")
    if info["kind"] == "preset":
        _save_base(engine, info, base, save_dtype(info, choice))  # every rank: it gathers
    if engine.rt.rank != 0:
        return directory
    if info["kind"] == "hf":  # where its base is, so peft finds it without a hub (and its model card names it)
        for config in model.peft_config.values():
            config.base_model_name_or_path = info["source"]
        model.get_base_model().config.name_or_path = info["source"]
        model.save_pretrained(directory, state_dict=state)
        copy_companions(info["source"], directory)  # the tokenizer files (and a generation config it has)
        return directory
    _write_preset_adapter(state, lora, directory, os.path.abspath(base))
    with open(os.path.join(directory, "README.md"), "w") as f:  # what the base is: a preset has no name elsewhere
        f.write(PRESET_CARD.format(base=os.path.abspath(base), name=info["name"], **lora))
    return directory


def hf_base(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft model (the model itself when it is not one)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def write_run_directory(engine, items, info: dict, directory: str, dtype: torch.dtype) -> str:
    """(name, tensor) `items` of a run's model as a HF directory of `dtype` tensors: rank 0 writes it (a preset's
    names as transformers' Llama names, a HF model's as save_pretrained writes them, offload.integrations.hf_io's
    [Note: checkpoint names]; the config, saying `dtype`, the tokenizer files and the generation config beside
    them), the other ranks read the items too, since over ranks reading them gathers every window from its
    owner."""
    from offload.integrations.hf_io import checkpoint_items, copy_companions, save_hf_directory, with_dtype

    if engine.rt.rank != 0:
        for _ in items:
            pass
        return directory
    items = ((n, t.to(dtype)) for n, t in items)
    items = hf_names(items) if info["kind"] == "preset" else checkpoint_items(hf_base(engine.module), items)
    save_hf_directory(items, with_dtype(info["hf_config"], dtype), directory)
    copy_companions(info["source"], directory, info["hf_config"])
    return directory


def _save_base(engine, info: dict, directory: str, dtype: torch.dtype) -> None:
    """The frozen base of a preset's LoRA run as a HF directory."""
    write_run_directory(engine, ((base_name(n), t) for n, t in engine.state_items() if ".lora_" not in n), info,
                        directory, dtype)


def _write_preset_adapter(state: dict, lora: dict, directory: str, base: str) -> None:
    """adapter_config.json and adapter_model.safetensors as peft writes them for transformers' Llama: keys
    'base_model.model.<HF module>.lora_A.weight', targets in HF names."""
    from safetensors.torch import save_file

    peft = peft_module()
    tensors = {}
    for name, value in state.items():
        module, _, rest = base_name(name).partition(".lora_")
        kind, _adapter, leaf = rest.split(".", 2)  # "A", "default", "weight" of lora_A.default.weight
        theirs = hf_name(module + ".weight")[: -len(".weight")]
        tensors[f"{PEFT_PREFIX}{theirs}.lora_{kind}.{leaf}"] = value.contiguous()
    config = peft.LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], target_modules=sorted(lora["targets"]),
                             lora_dropout=lora["dropout"], bias="none", task_type="CAUSAL_LM",
                             base_model_name_or_path=base)
    os.makedirs(directory, exist_ok=True)
    config.save_pretrained(directory)
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"), metadata={"format": "pt"})


def save_merged(engine, info: dict, lora: dict, directory: str, dtype: torch.dtype) -> str:
    """--save-merged of a LoRA run ([Note: what a LoRA run saves]) as `dtype` tensors; every rank calls it,
    rank 0 writes."""
    items = merged_items(engine.state_items(), lora["alpha"] / lora["r"], dtype, transposed_layers(engine.module))
    return write_run_directory(engine, items, info, directory, dtype)



class AdapterWeights:
    """The weights source of a saved LoRA adapter on a HF directory's base (`offload generate --adapter`): base
    tensors from `source` under their own names, the adapters' from the adapter directory's
    adapter_model.safetensors, where peft saves them without the adapter's name."""

    def __init__(self, source, directory: str):
        from safetensors import safe_open

        self.source, self.path = source, os.path.join(directory, "adapter_model.safetensors")
        if not os.path.isfile(self.path):
            raise FileNotFoundError(2, "no adapter_model.safetensors: pass --adapter a directory peft or "
                                       "`offload train --lora ... --save` wrote", self.path)
        self._file = safe_open(self.path, framework="pt", device="cpu")
        self._keys = set(self._file.keys())

    @classmethod
    def wrap(cls, model: torch.nn.Module, source, directory: str):
        """(the peft model of the adapter `directory` around `model` on the meta device, its weights source)."""
        if not os.path.isfile(os.path.join(directory, "adapter_config.json")):
            raise FileNotFoundError(2, "no adapter_config.json: pass --adapter a LoRA adapter directory", directory)
        peft = peft_module()
        config = peft.PeftConfig.from_pretrained(directory)
        try:
            with warnings.catch_warnings():  # its base's path differs from the model's (built on meta): expected
                warnings.filterwarnings("ignore", message="The PEFT config's `base_model_name_or_path`")
                wrapped = peft.get_peft_model(model, config)
        except ValueError as e:  # its target modules are not in this model
            raise ValueError(f"--adapter={directory}: does not fit the model ({str(e).splitlines()[0]}); pass the "
                             "model it was trained on") from e
        return wrapped, cls(source, directory)

    def __call__(self, name: str) -> torch.Tensor:
        if ".lora_" not in name:
            return self.source(base_name(name))
        parts = name.split(".")
        key = ".".join(p for i, p in enumerate(parts) if i == 0 or not parts[i - 1].startswith("lora_"))
        if key not in self._keys:
            raise ValueError(f"{self.path}: has no {key}; the adapter does not match the model (--model)")
        return self._file.get_tensor(key)

    def close(self) -> None:
        self.source.close()
