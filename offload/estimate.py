"""Memory estimate per rank and tier: the ZeRO ledger plus the runtime's own buffers. Pure functions.

[Note: the ledger]
Mixed precision with Adam, per parameter (Rajbhandari et al., ZeRO, 2020): 2 B bf16/fp16 weight,
2 B gradient, K = 12 B optimizer state (fp32 master, m, v). With D data-parallel ranks, stage 1
partitions the optimizer state (/D), stage 2 also the gradients, stage 3 also the weights. Offload
moves a term to another tier whole: `offload_param` the weights (dram or nvme), `offload_optimizer`
the optimizer state (dram or nvme) and, because the step then runs on the CPU, the gradients, which our
runtime accumulates in fp32 in dram (4 B, not 2). With fp32 precision the weight is its own master:
4 B weight, 4 B gradient, K = 8 (m, v).

[Note: the runtime]
Peak memory is never just the ledger. `runtime_bytes` adds what the runtime itself holds through
offload.memory.runtime_parts, the function the engine's placement checks (its formulas and note), with
every unit as large as the largest (a unit is a module subtree such as one transformer block): the
fetched units' weights in hbm, the gradients in flight before they leave hbm, and the dram pool of
fixed-size chunks through which everything moves to and from NVMe. Activations depend on batch and
sequence and are added only when given (activation_bytes).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

from offload.memory import OFFLOAD_TIER, TIERS, Knobs, runtime_parts

DEFAULT_UNITS_FOR_PARAMS = 32      # --params alone: assume the model is this many equal units


@dataclasses.dataclass(frozen=True)
class Term:
    """One line of the ledger: bytes_per_param on `tier`, divided by D when `partitioned`."""
    name: str
    tier: str
    bytes_per_param: int
    partitioned: bool


def _check_choice(field: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{field}={value}: not one of {', '.join(map(str, allowed))}; pick one of those")


def ledger_terms(stage: int, offload_param: str = "none", offload_optimizer: str = "none",
                 precision: str = "bf16", dram_grad_bytes: int = 4) -> list[Term]:
    """The three ledger terms (weights, gradients, optimizer) for a ZeRO stage and offload choice.

    dram_grad_bytes: bytes per gradient element when the optimizer runs on the CPU (4: fp32 accumulation).
    """
    _check_choice("stage", stage, (0, 1, 2, 3))
    _check_choice("offload_param", offload_param, tuple(OFFLOAD_TIER))
    _check_choice("offload_optimizer", offload_optimizer, tuple(OFFLOAD_TIER))
    _check_choice("precision", precision, ("bf16", "fp16", "fp32"))
    weight_bytes = 4 if precision == "fp32" else 2
    k = 8 if precision == "fp32" else 12
    opt_tier = OFFLOAD_TIER[offload_optimizer]
    grad_bytes = weight_bytes if opt_tier == "hbm" else dram_grad_bytes   # CPU step: fp32 accumulators
    # The engine keeps each unit's fp32 gradient accumulator beside its optimizer states (dram or nvme), so
    # with the optimizer offloaded it partitions the accumulator with the states from stage 1 on (its stage 1
    # holds what the paper's stage 2 holds; [Note: windows over ranks] in offload.optim).
    return [Term("weights", OFFLOAD_TIER[offload_param], weight_bytes, stage >= 3),
            Term("gradients", opt_tier, grad_bytes, stage >= 2 or (stage == 1 and opt_tier != "hbm")),
            Term("optimizer", opt_tier, k, stage >= 1)]


def model_state_bytes(params: int, dp: int, terms: list[Term], trainable: int | None = None) -> dict[str, int]:
    """Bytes per rank and tier of the ledger: {"hbm_bytes", "dram_bytes", "nvme_bytes"}. trainable: the
    parameters trained when not all are (LoRA): the others are frozen, with a weight and nothing else."""
    out = {f"{t}_bytes": 0 for t in TIERS}
    for term in terms:
        n = params if term.name == "weights" or trainable is None else trainable
        out[f"{term.tier}_bytes"] += term.bytes_per_param * (math.ceil(n / dp) if term.partitioned else n)
    return out


def runtime_bytes(unit_numel: int, terms: list[Term], device_type: str = "cuda",
                  chunk_bytes: int = 32 << 20, activation_bytes: int = 0, hbm_units: int | None = None,
                  trainable_unit_numel: int | None = None) -> dict:
    """The runtime's buffers and working set per rank, on top of the ledger: offload.memory.runtime_parts,
    the function the engine's placement checks, with every unit as large as the largest (unit_numel).
    hbm_units: fetched units in hbm at once (None: the engine's default, 1 + prefetch_units + reuse_distance).
    trainable_unit_numel: the trained parameters of the largest unit, when not all of them are (LoRA).
    Returns {"hbm_bytes", "dram_bytes", "nvme_bytes", "parts": [{"name", "tier", "bytes", "formula"}]}."""
    w, _, opt = terms
    knobs = Knobs()
    if hbm_units is not None:
        knobs = Knobs(prefetch_units=hbm_units - 1, reuse_distance=0)
    n_fetched = 1 + knobs.prefetch_units + knobs.reuse_distance
    trained = unit_numel if trainable_unit_numel is None else trainable_unit_numel
    parts = runtime_parts([unit_numel] * n_fetched if w.tier != "hbm" else [], [trained] * knobs.grad_units,
                          w.bytes_per_param, w.tier, opt.tier, device_type, chunk_bytes, knobs)
    if activation_bytes:
        parts.append({"name": "activations", "tier": "hbm", "bytes": int(activation_bytes), "formula": "given"})
    out = {f"{t}_bytes": sum(p["bytes"] for p in parts if p["tier"] == t) for t in TIERS}
    out["parts"] = parts
    return out


# -- what the estimate is of: a parameter count, a HF config, or a preset ----------------------------

@dataclasses.dataclass(frozen=True)
class ModelShape:
    params: int
    largest_unit_numel: int
    source: str               # how params and the unit size were obtained, for the report
    trainable: int | None = None               # parameters trained when not all are (LoRA); the rest frozen
    trainable_unit_numel: int | None = None    # of those, in the largest unit


def parse_count(text: str) -> int:
    """'7.5e9', '7500000000', '7.5B', '350M', '1.2T' -> int."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(text[-1:].upper(), None)
    try:
        value = float(text[:-1]) * scale if scale else float(text)
    except ValueError:
        raise ValueError(f"--params={text}: not a number; write e.g. 7.5e9 or 7.5B") from None
    if not value >= 1 or value != value or math.isinf(value):
        raise ValueError(f"--params={text}: must be a positive count of parameters")
    return int(round(value))


def llama_param_count(config: dict, where: str = "config") -> tuple[int, int]:
    """(total parameters, largest unit numel) of a Llama-style HF config, exactly as transformers builds it.

    Embedding, untied lm_head, per layer q/k/v/o (GQA: k, v have num_key_value_heads x head_dim rows;
    biases if attention_bias), gate/up/down (biases if mlp_bias), two RMSNorms; the final RMSNorm.
    """
    def need(key):
        if config.get(key) is None:
            raise ValueError(f"{where}: missing {key!r}; a Llama-style config.json has it")
        return int(config[key])

    vocab, d, ff = need("vocab_size"), need("hidden_size"), need("intermediate_size")
    layers, heads = need("num_hidden_layers"), need("num_attention_heads")
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or d // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = d * q + 2 * d * kv + q * d + (q + 2 * kv + d if config.get("attention_bias") else 0)
    mlp = 3 * d * ff + (2 * ff + d if config.get("mlp_bias") else 0)
    block = attention + mlp + 2 * d
    embed = vocab * d
    head = 0 if config.get("tie_word_embeddings", False) else embed
    return embed + layers * block + d + head, max(block, embed)


def model_shape(model: str) -> ModelShape:
    """--model: a config.json file, a directory holding one, or a preset name of offload.models."""
    if os.path.isdir(model) or model.endswith(".json") or os.sep in model:
        path = os.path.join(model, "config.json") if os.path.isdir(model) else model
        with open(path) as f:    # OSError (missing file) names the path
            try:
                config = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); pass a HF config.json") from e
        kind = config.get("model_type")
        if kind not in ("llama", "mistral"):
            raise ValueError(f"model_type={kind!r} in {path}: only Llama-style configs (llama, mistral) are "
                             f"counted; pass --params N instead")
        params, unit = llama_param_count(config, path)
        return ModelShape(params, unit, f"{path} (model_type {kind})")
    from offload.models import PRESETS   # local import: the estimator itself needs no torch
    if model not in PRESETS:
        raise ValueError(f"--model={model}: no such file, directory or preset ({', '.join(PRESETS)}); "
                         f"pass a config.json, a HF model directory or a preset name")
    cfg = PRESETS[model]
    embed = cfg.vocab_size * cfg.d_model
    return ModelShape(cfg.num_params(), max(cfg.block_numel(), embed), f"preset {model!r}")


def _config_of(model: str) -> dict:
    """The HF config of --model: a config.json, a directory holding one, or a preset (as it exports)."""
    from offload.models import PRESETS, hf_llama_config

    if model in PRESETS and not os.path.exists(model):
        return hf_llama_config(PRESETS[model])
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    with open(path) as f:
        return json.load(f)


def lora_layer_numel(config: dict, r: int, targets) -> int:
    """Parameters LoRA of rank r adds to one Llama decoder layer: r x (in + out) per targeted linear."""
    d, ff = int(config["hidden_size"]), int(config["intermediate_size"])
    heads = int(config["num_attention_heads"])
    hd = int(config.get("head_dim") or d // heads)
    q, kv = heads * hd, int(config.get("num_key_value_heads") or heads) * hd
    shapes = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
              "gate_proj": (d, ff), "up_proj": (d, ff), "down_proj": (ff, d)}
    unknown = [t for t in targets if t not in shapes]
    if unknown:
        raise ValueError(f"--lora-targets={','.join(targets)}: {', '.join(unknown)} is not a Llama linear; use "
                         f"{', '.join(shapes)}")
    return sum(r * sum(shapes[t]) for t in targets)


def with_lora(shape: ModelShape, model: str, r: int, targets) -> ModelShape:
    """The shape of --model with LoRA adapters of rank r on `targets` in every decoder layer: its parameters
    frozen, the adapters trained (the largest unit counted with one layer's adapters, an upper bound)."""
    if r < 1:
        raise ValueError(f"--lora={r}: the LoRA rank must be a positive integer")
    config = _config_of(model)
    per_layer = lora_layer_numel(config, r, targets)
    trainable = per_layer * int(config["num_hidden_layers"])
    return dataclasses.replace(shape, params=shape.params + trainable, trainable=trainable,
                               largest_unit_numel=shape.largest_unit_numel + per_layer,
                               trainable_unit_numel=per_layer,
                               source=f"{shape.source} with LoRA r {r} on {','.join(targets)}")


def shape_of_model(model, units=None) -> ModelShape:
    """ModelShape of a built nn.Module (meta device is fine): its parameters, counted once, and its largest
    unit. units: the modules the runtime treats as units; default: each module of `model.layers` and
    every other top-level child that owns parameters."""
    params = sum(p.numel() for p in model.parameters())
    if units is None:     # ours: model.layers; transformers': model.model.layers
        holder = model if hasattr(model, "layers") else getattr(model, "model", model)
        layers = getattr(holder, "layers", None)
        others = [m for m in (*holder.children(), *model.children()) if m is not holder and m is not layers]
        units = [*(layers or []), *others]
    largest = max((sum(p.numel() for p in u.parameters()) for u in units), default=params)
    return ModelShape(params, largest, type(model).__name__)


def estimate(shape: ModelShape, dp: int = 1, stage: int = 0, offload_param: str = "none",
             offload_optimizer: str = "none", precision: str = "bf16", dram_grad_bytes: int = 4,
             **runtime_kwargs) -> dict:
    """The whole estimate as the JSON of `offload estimate --json`."""
    if dp < 1:
        raise ValueError(f"dp={dp}: must be >= 1 (the number of data-parallel ranks)")
    terms = ledger_terms(stage, offload_param, offload_optimizer, precision, dram_grad_bytes)
    states = model_state_bytes(shape.params, dp, terms, shape.trainable)
    runtime = runtime_bytes(shape.largest_unit_numel, terms, trainable_unit_numel=shape.trainable_unit_numel,
                            **runtime_kwargs)  # gathered units are whole: no /D
    per_rank = {k: states[k] + runtime[k] for k in states}
    trainable = shape.params if shape.trainable is None else shape.trainable
    return {"params": shape.params, "trainable_params": trainable, "frozen_params": shape.params - trainable,
            "largest_unit_numel": shape.largest_unit_numel, "source": shape.source,
            "dp": dp, "stage": stage, "offload_param": offload_param, "offload_optimizer": offload_optimizer,
            "precision": precision, "K": terms[2].bytes_per_param, "device": runtime_kwargs.get("device_type", "cuda"),
            "model_states": states, "runtime": runtime, "per_rank": per_rank,
            "all_ranks": {k: v * dp for k, v in per_rank.items()},
            "formula": formula(terms, runtime, frozen=shape.trainable is not None)}


def formula(terms: list[Term], runtime: dict, frozen: bool = False) -> str:
    """The ledger and runtime formulas per tier, P = params, D = ranks, U = largest unit numel; with frozen
    parameters T = the trained ones (only they have gradients and optimizer states)."""
    lines = []
    for tier in TIERS:
        ledger = [f"{t.bytes_per_param}{'T' if frozen and t.name != 'weights' else 'P'}{'/D' if t.partitioned else ''} "
                  f"({t.name})" for t in terms if t.tier == tier]
        extra = [f"{p['formula']} ({p['name']})" for p in runtime["parts"] if p["tier"] == tier]
        lines.append(f"{tier} = " + (" + ".join(ledger + extra) or "0"))
    return "; ".join(lines)


def format_bytes(n: int) -> str:
    """3 significant digits in decimal units (GB = 1e9, as in the ZeRO paper)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def format_table(result: dict) -> str:
    trained = (f" ({result['trainable_params']:,} trained, {result['frozen_params']:,} frozen: weights only)"
               if result["frozen_params"] else "")
    head = (f"{result['params']:,} parameters{trained} from {result['source']}; dp={result['dp']}, "
            f"zero stage {result['stage']}, offload_param={result['offload_param']}, "
            f"offload_optimizer={result['offload_optimizer']}, {result['precision']}, K={result['K']}, runtime "
            f"buffers for {result.get('device', 'cuda')}")
    rows = [f"{'per rank':<14}" + "".join(f"{t:>12}" for t in TIERS)]
    for label, key in (("model states", "model_states"), ("runtime", "runtime"), ("total", "per_rank")):
        rows.append(f"{label:<14}" + "".join(f"{format_bytes(result[key][t + '_bytes']):>12}" for t in TIERS))
    return "\n".join([head, *rows, f"formula (P = params, {'T = trained params, ' if trained else ''}D = ranks, "
                      f"U = {result['largest_unit_numel']:,}, "
                      f"the largest unit's numel): {result['formula']}",
                      "Not included unless given: activations (--activation-bytes), allocator slack."])

