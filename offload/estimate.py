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

[Note: a quantized base]
With LoRA on a quantized base (`--quantize nf4|int8`, as bitsandbytes loads it through transformers) every
nn.Linear of the decoder layers is stored as offload.quantized's record, the packed weight and its
quantization state (nf4: double quantization, blocksize 64, about 4.13 bits a parameter; int8: 1 byte a
parameter and a fp32 scale per row), and that record is what every tier holds and every fetch moves
(offload.quantized.record_bytes gives its bytes). The embedding, the lm_head (transformers' bitsandbytes
integration leaves the output head unquantized), the norms, the biases and the adapters stay at the compute
dtype. The weights term and the fetched units' working set count those bytes; the frozen base has no
gradient and no optimizer state either way.
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


def model_state_bytes(params: int, dp: int, terms: list[Term], trainable: int | None = None,
                      weight_bytes: int | None = None) -> dict[str, int]:
    """Bytes per rank and tier of the ledger: {"hbm_bytes", "dram_bytes", "nvme_bytes"}. trainable: the
    parameters trained when not all are (LoRA): the others are frozen, with a weight and nothing else.
    weight_bytes: the bytes of all the weights when they are not bytes_per_param each (a quantized base)."""
    out = {f"{t}_bytes": 0 for t in TIERS}
    for term in terms:
        if term.name == "weights" and weight_bytes is not None:
            out[f"{term.tier}_bytes"] += math.ceil(weight_bytes / dp) if term.partitioned else weight_bytes
            continue
        n = params if term.name == "weights" or trainable is None else trainable
        out[f"{term.tier}_bytes"] += term.bytes_per_param * (math.ceil(n / dp) if term.partitioned else n)
    return out


def runtime_bytes(unit_numel: int, terms: list[Term], device_type: str = "cuda",
                  chunk_bytes: int = 32 << 20, activation_bytes: int = 0, hbm_units: int | None = None,
                  trainable_unit_numel: int | None = None, unit_bytes: int | None = None) -> dict:
    """The runtime's buffers and working set per rank, on top of the ledger: offload.memory.runtime_parts,
    the function the engine's placement checks, with every unit as large as the largest (unit_numel).
    hbm_units: fetched units in hbm at once (None: the engine's default, 1 + prefetch_units + reuse_distance).
    trainable_unit_numel: the trained parameters of the largest unit, when not all of them are (LoRA).
    unit_bytes: the largest unit's bytes as fetched, when not unit_numel x the weight's bytes (a quantized base).
    Returns {"hbm_bytes", "dram_bytes", "nvme_bytes", "parts": [{"name", "tier", "bytes", "formula"}]}."""
    w, _, opt = terms
    knobs = Knobs()
    if hbm_units is not None:
        knobs = Knobs(prefetch_units=hbm_units - 1, reuse_distance=0)
    n_fetched = 1 + knobs.prefetch_units + knobs.reuse_distance
    trained = unit_numel if trainable_unit_numel is None else trainable_unit_numel
    parts = runtime_parts([unit_numel] * n_fetched if w.tier != "hbm" else [], [trained] * knobs.grad_units,
                          w.bytes_per_param, w.tier, opt.tier, device_type, chunk_bytes, knobs,
                          hbm_trained=w.tier == "hbm" or trainable_unit_numel is None)  # all trained: the rest too
    if unit_bytes is not None:
        _fetch_bytes(parts, n_fetched, unit_bytes, knobs)
    if activation_bytes:
        parts.append({"name": "activations", "tier": "hbm", "bytes": int(activation_bytes), "formula": "given"})
    out = {f"{t}_bytes": sum(p["bytes"] for p in parts if p["tier"] == t) for t in TIERS}
    out["parts"] = parts
    return out


def _fetch_bytes(parts: list[dict], n_fetched: int, unit_bytes: int, knobs: Knobs) -> None:
    """The fetched units' working set at unit_bytes each (their records' bytes, not numel x itemsize)."""
    for part in parts:
        if part["name"] == "fetched weights":
            part["bytes"] = n_fetched * unit_bytes
            part["formula"] = (f"the largest {n_fetched} units x the largest unit's bytes as fetched, {unit_bytes:,} B "
                               f"(a decoder layer's linears as their quantized records; 1 in use + "
                               f"{knobs.prefetch_units} prefetched + {knobs.reuse_distance} kept by reuse_distance)")


# -- what the estimate is of: a parameter count, a HF config, or a preset ----------------------------

@dataclasses.dataclass(frozen=True)
class ModelShape:
    params: int
    largest_unit_numel: int
    source: str               # how params and the unit size were obtained, for the report
    trainable: int | None = None               # parameters trained when not all are (LoRA); the rest frozen
    trainable_unit_numel: int | None = None    # of those, in the largest unit
    quantized: QuantizedBase | None = None     # the frozen base's decoder-layer linears stored quantized


QUANTIZE_KINDS = {"nf4": "nf4 with double quantization, blocksize 64", "int8": "int8 with a fp32 scale per row"}


@dataclasses.dataclass(frozen=True)
class QuantizedBase:
    """A frozen base whose decoder-layer linears are stored quantized ([Note: a quantized base]): their
    parameters and record bytes, and what the largest unit fetches; every other parameter at the compute dtype."""
    kind: str                     # nf4 or int8
    numel: int                    # parameters stored quantized: every decoder layer's linears
    nbytes: int                   # their records' bytes (offload.quantized.record_bytes)
    layer_numel: int              # one decoder layer's parameters, its adapters included
    layer_quantized_numel: int    # of those, in its linears
    layer_quantized_bytes: int    # the linears' records' bytes
    other_unit_numel: int         # the largest unit that is not a decoder layer (the embedding, an untied head)

    @property
    def bits_per_param(self) -> float:
        return 8 * self.nbytes / self.numel

    def weight_bytes(self, params: int, itemsize: int) -> int:
        """Bytes of `params` weights (all the model's, adapters included) with these linears quantized."""
        return self.nbytes + (params - self.numel) * itemsize

    def unit_bytes(self, itemsize: int) -> int:
        """Bytes of the largest unit as fetched: a decoder layer (records + the rest) or the embedding."""
        layer = self.layer_quantized_bytes + (self.layer_numel - self.layer_quantized_numel) * itemsize
        return max(layer, self.other_unit_numel * itemsize)


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


def _need(config: dict, key: str, where: str) -> int:
    if config.get(key) is None:
        raise ValueError(f"{where}: missing {key!r}; a Llama-style config.json has it")
    return int(config[key])


ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


def llama_linear_shapes(config: dict, where: str = "config") -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each nn.Linear of one Llama decoder layer, by transformers' names
    (GQA: k, v have num_key_value_heads x head_dim rows)."""
    d, ff, heads = (_need(config, k, where) for k in ("hidden_size", "intermediate_size", "num_attention_heads"))
    head_dim = int(config.get("head_dim") or d // heads)
    q, kv = heads * head_dim, int(config.get("num_key_value_heads") or heads) * head_dim
    return {"q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q),
            "gate_proj": (ff, d), "up_proj": (ff, d), "down_proj": (d, ff)}


def llama_layer_numel(config: dict, where: str = "config") -> int:
    """Parameters of one Llama decoder layer: its linears (biases if attention_bias, mlp_bias), two RMSNorms."""
    shapes = llama_linear_shapes(config, where)
    biases = ((sum(shapes[n][0] for n in ATTENTION_LINEARS) if config.get("attention_bias") else 0)
              + (sum(shapes[n][0] for n in MLP_LINEARS) if config.get("mlp_bias") else 0))
    return sum(o * i for o, i in shapes.values()) + biases + 2 * _need(config, "hidden_size", where)


def llama_param_count(config: dict, where: str = "config") -> tuple[int, int]:
    """(total parameters, largest unit numel) of a Llama-style HF config, exactly as transformers builds it.

    Embedding, untied lm_head, per layer q/k/v/o (GQA: k, v have num_key_value_heads x head_dim rows;
    biases if attention_bias), gate/up/down (biases if mlp_bias), two RMSNorms; the final RMSNorm.
    """
    vocab, d = _need(config, "vocab_size", where), _need(config, "hidden_size", where)
    _need(config, "intermediate_size", where)
    layers = _need(config, "num_hidden_layers", where)
    block = llama_layer_numel(config, where)
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
    shapes = llama_linear_shapes(config)
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


def with_quantized_base(shape: ModelShape, model: str, kind: str) -> ModelShape:
    """The shape of --model (with LoRA: with_lora first) whose frozen base has every decoder layer's linears
    stored as `kind` ([Note: a quantized base]); the parameter counts are unchanged, their bytes are not."""
    _check_choice("--quantize", kind, tuple(QUANTIZE_KINDS))
    if shape.trainable is None:
        raise ValueError(f"--quantize={kind}: a quantized base is frozen, it is trained through adapters; "
                         f"add --lora R")
    from offload.quantized import record_bytes   # local import: it needs torch, the estimator does not

    config = _config_of(model)
    shapes = list(llama_linear_shapes(config).values())
    layers = int(config["num_hidden_layers"])
    layer_numel = sum(o * i for o, i in shapes)
    layer_bytes = sum(record_bytes(kind, s) for s in shapes)
    base = QuantizedBase(kind, layers * layer_numel, layers * layer_bytes,
                         llama_layer_numel(config) + (shape.trainable_unit_numel or 0), layer_numel, layer_bytes,
                         int(config["vocab_size"]) * int(config["hidden_size"]))
    return dataclasses.replace(shape, quantized=base, source=f"{shape.source}, the base's linears {kind}")


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
    itemsize, q = terms[0].bytes_per_param, shape.quantized
    states = model_state_bytes(shape.params, dp, terms, shape.trainable,
                               weight_bytes=q.weight_bytes(shape.params, itemsize) if q else None)
    runtime = runtime_bytes(shape.largest_unit_numel, terms, trainable_unit_numel=shape.trainable_unit_numel,
                            unit_bytes=q.unit_bytes(itemsize) if q else None,
                            **runtime_kwargs)  # gathered units are whole: no /D
    per_rank = {k: states[k] + runtime[k] for k in states}
    trainable = shape.params if shape.trainable is None else shape.trainable
    return {"params": shape.params, "trainable_params": trainable, "frozen_params": shape.params - trainable,
            "quantize": q.kind if q else None,
            "frozen_base": frozen_base(shape.params - trainable, itemsize, q) if shape.trainable is not None else None,
            "largest_unit_numel": shape.largest_unit_numel,
            "largest_unit_bytes": q.unit_bytes(itemsize) if q else shape.largest_unit_numel * itemsize,
            "source": shape.source,
            "dp": dp, "stage": stage, "offload_param": offload_param, "offload_optimizer": offload_optimizer,
            "precision": precision, "K": terms[2].bytes_per_param, "device": runtime_kwargs.get("device_type", "cuda"),
            "model_states": states, "runtime": runtime, "per_rank": per_rank,
            "all_ranks": {k: v * dp for k, v in per_rank.items()},
            "formula": formula(terms, runtime, frozen=shape.trainable is not None, quantized=q is not None)}


def frozen_base(frozen: int, itemsize: int, q: QuantizedBase | None) -> dict:
    """The frozen base's parameters and bytes: {"params", "bytes", "quantized_params", "quantized_bytes",
    "bits_per_quantized_param", "other_params", "other_bytes"} (others: at the compute dtype)."""
    qn, qb = (q.numel, q.nbytes) if q else (0, 0)
    return {"params": frozen, "bytes": qb + (frozen - qn) * itemsize, "quantized_params": qn, "quantized_bytes": qb,
            "bits_per_quantized_param": round(q.bits_per_param, 4) if q else None,
            "other_params": frozen - qn, "other_bytes": (frozen - qn) * itemsize}


def _weights_formula(t: Term, quantized: bool) -> str:
    d = "/D" if t.partitioned else ""
    return f"(Q + {t.bytes_per_param}(P - Pq)){d}" if quantized else f"{t.bytes_per_param}P{d}"


def formula(terms: list[Term], runtime: dict, frozen: bool = False, quantized: bool = False) -> str:
    """The ledger and runtime formulas per tier, P = params, D = ranks, U = largest unit numel; with frozen
    parameters T = the trained ones (only they have gradients and optimizer states); with a quantized base
    Q = the bytes of its Pq quantized parameters' records."""
    lines = []
    for tier in TIERS:
        ledger = [(_weights_formula(t, quantized) if t.name == "weights" else
                   f"{t.bytes_per_param}{'T' if frozen else 'P'}{'/D' if t.partitioned else ''}") + f" ({t.name})"
                  for t in terms if t.tier == tier]
        extra = [f"{p['formula']} ({p['name']})" for p in runtime["parts"] if p["tier"] == tier]
        lines.append(f"{tier} = " + (" + ".join(ledger + extra) or "0"))
    return "; ".join(lines)


def format_bytes(n: int) -> str:
    """3 significant digits in decimal units (GB = 1e9, as in the ZeRO paper)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def format_count(n: int) -> str:
    """3 significant digits: 6.48B, 262M, 8.39K."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def frozen_base_line(result: dict) -> str:
    """One line: the frozen base's parameters and bytes, quantized or not."""
    fb, q = result["frozen_base"], result["quantize"]
    if q is None:
        return (f"frozen base: {format_count(fb['params'])} parameters at {result['precision']}: "
                f"{format_bytes(fb['bytes'])}")
    return (f"frozen base: {format_count(fb['params'])} parameters, {format_count(fb['quantized_params'])} of them "
            f"(the decoder layers' linears) {q} ({fb['bits_per_quantized_param']:.3g} bits a parameter with their "
            f"quantization state; {QUANTIZE_KINDS[q]}): {format_bytes(fb['quantized_bytes'])}, the other "
            f"{format_count(fb['other_params'])} (embedding, lm_head, norms) at {result['precision']}: "
            f"{format_bytes(fb['other_bytes'])}; {format_bytes(fb['bytes'])} in all")


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
    base = [frozen_base_line(result)] if result.get("frozen_base") else []
    q = result.get("frozen_base") if result.get("quantize") else None
    quantized = (f"Q = {q['quantized_bytes']:,} B, the records of the Pq = {q['quantized_params']:,} quantized "
                 f"parameters, " if q else "")
    return "\n".join([head, *base, *rows, f"formula (P = params, {'T = trained params, ' if trained else ''}"
                      f"{quantized}D = ranks, U = {result['largest_unit_numel']:,}, "
                      f"the largest unit's numel): {result['formula']}",
                      "Not included unless given: activations (--activation-bytes), allocator slack."])

