"""Memory estimate per rank and tier: the ZeRO ledger plus the runtime's own buffers. Pure functions, but
for what is estimated: a model is counted as built on the meta device (meta_model, shape_of_model).
"""

from __future__ import annotations

import dataclasses
import math
import os

from offload.plan.config import MASTER_CHOICES, STATE_CHOICES
from offload.plan.memory import OFFLOAD_TIER, TIERS, Knobs, runtime_parts

# [Note: the ledger] is LEDGER, which `offload estimate --help` prints
LEDGER = """Mixed precision with Adam, per parameter (Rajbhandari et al., ZeRO, 2020): 2 B bf16/fp16 weight,
2 B gradient, K = 12 B optimizer state (fp32 master, m, v). With D data-parallel ranks, stage 1
partitions the optimizer state (/D), stage 2 also the gradients, stage 3 also the weights. Offload
moves a term to another tier whole: `offload_param` the weights (dram or nvme), `offload_optimizer`
the optimizer state (dram or nvme) and, because the step then runs on the CPU, the gradients, which our
runtime accumulates in fp32 in dram (4 B, not 2). With fp32 precision the weight is its own master:
4 B weight, 4 B gradient, K = 8 (m, v). With int8 moments (--optimizer-states int8: one byte each
and a fp32 scale per 256) K = 4 + 2 + 8/256 (bf16) or 2 + 8/256 (fp32), the small parameters' fp32
moments aside. A split master (--master split, bf16: the weight plus a record of 2 + 1/8 bytes) takes
2.125 B of K's 4."""

# [Note: the runtime]
# Peak memory is never just the ledger. `runtime_bytes` adds what the runtime itself holds through
# offload.plan.memory.runtime_parts, the function the engine's placement checks (its formulas and note), with
# every unit as large as the largest (a unit is a module subtree such as one transformer block): the
# fetched units' weights in hbm, the gradients in flight before they leave hbm, and the dram pool of
# fixed-size chunks through which everything moves to and from NVMe. Activations depend on batch and
# sequence: counted by formula for a model at --batch x --seq (offload.plan.activation_memory, [Note: the activations
# formula]), or as given (--activation-bytes).
#
# [Note: a quantized base]
# With LoRA on a quantized base (`--quantize nf4|int8`, as bitsandbytes loads it through transformers) every
# nn.Linear but the output head (offload.plan.quantized.quantizable_linears) is stored as offload.plan.quantized's record,
# the packed weight and its quantization state (nf4: double quantization, blocksize 64, about 4.13 bits a
# parameter; int8: 1 byte a parameter and a fp32 scale per row), and that record is what every tier holds and
# every fetch moves (offload.plan.quantized.record_bytes gives its bytes). The embedding, the lm_head (transformers'
# bitsandbytes integration leaves the output head unquantized), the norms, the biases and the adapters stay at
# the compute dtype. The weights term and the fetched units' working set count those bytes; the frozen base has
# no gradient and no optimizer state either way.

DEFAULT_UNITS_FOR_PARAMS = 32      # --params alone: assume the model is this many equal units


@dataclasses.dataclass(frozen=True)
class Term:
    """One line of the ledger: bytes_per_param on `tier`, divided by D when `partitioned`."""
    name: str
    tier: str
    bytes_per_param: float  # whole bytes, but the int8 moments' scales (8/256)
    partitioned: bool


def _check_choice(field: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{field}={value}: not one of {', '.join(map(str, allowed))}; pick one of those")


def ledger_terms(stage: int, offload_param: str = "none", offload_optimizer: str = "none",
                 precision: str = "bf16", dram_grad_bytes: int = 4, states: str = "fp32",
                 master: str = "fp32") -> list[Term]:
    """The three ledger terms (weights, gradients, optimizer) for a ZeRO stage and offload choice.

    dram_grad_bytes: bytes per gradient element when the optimizer runs on the CPU (4: fp32 accumulation).
    states: the moments, "fp32" or "int8" ([Note: int8 optimizer states]); master: "fp32" or "split" (bf16:
    [Note: split master] in offload/kernels/split.py).
    """
    _check_choice("optimizer states", states, STATE_CHOICES)
    _check_choice("master", master, MASTER_CHOICES)
    if master == "split" and precision != "bf16":
        raise ValueError(f"master=split: the bf16 weight plus a record, and precision is {precision} (auto picks it "
                         "where bf16 is not native); use bf16 (--precision bf16)")
    _check_choice("stage", stage, (0, 1, 2, 3))
    _check_choice("offload_param", offload_param, tuple(OFFLOAD_TIER))
    _check_choice("offload_optimizer", offload_optimizer, tuple(OFFLOAD_TIER))
    _check_choice("precision", precision, ("bf16", "fp16", "fp32"))
    weight_bytes = 4 if precision == "fp32" else 2
    k = 8 if precision == "fp32" else 12
    if states == "int8":
        k = k - 8 + 2 + 8 / 256  # m and v: a byte each and a fp32 absmax per block of each
    if master == "split":
        k = k - 4 + 2 + 1 / 8  # the master's low half and a tie bit
    opt_tier = OFFLOAD_TIER[offload_optimizer]
    grad_bytes = weight_bytes if opt_tier == "hbm" else dram_grad_bytes   # CPU step: fp32 accumulators
    # The engine keeps each unit's fp32 gradient accumulator beside its optimizer states (dram or nvme), so
    # with the optimizer offloaded it partitions the accumulator with the states from stage 1 on (its stage 1
    # holds what the paper's stage 2 holds; [Note: windows over ranks] in offload.state.optim).
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
        out[f"{term.tier}_bytes"] += math.ceil(term.bytes_per_param * (math.ceil(n / dp) if term.partitioned else n))
    return out


def runtime_bytes(unit_numel: int, terms: list[Term], device_type: str = "cuda", states: str = "fp32",
                  master: str = "fp32", chunk_bytes: int = 32 << 20, activations: list[dict] = (), hbm_units: int | None = None,
                  trainable_unit_numel: int | None = None, unit_bytes: int | None = None) -> dict:
    """The runtime's buffers and working set per rank, on top of the ledger: offload.plan.memory.runtime_parts,
    the function the engine's placement checks, with every unit as large as the largest (unit_numel).
    hbm_units: fetched units in hbm at once (None: the engine's default, 1 + prefetch_units + reuse_distance).
    trainable_unit_numel: the trained parameters of the largest unit, when not all of them are (LoRA).
    unit_bytes: the largest unit's bytes as fetched, when not unit_numel x the weight's bytes (a quantized base).
    activations: their parts (offload.plan.activation_memory.activation_parts, or one "given"), added as they are.
    Returns {"hbm_bytes", "dram_bytes", "nvme_bytes", "parts": [{"name", "tier", "bytes", "formula"}]}."""
    w, _, opt = terms
    knobs = Knobs()
    if hbm_units is not None:
        knobs = Knobs(prefetch_units=hbm_units - 1, reuse_distance=0)
    n_fetched = 1 + knobs.prefetch_units + knobs.reuse_distance
    trained = unit_numel if trainable_unit_numel is None else trainable_unit_numel
    parts = runtime_parts([unit_numel] * n_fetched if w.tier != "hbm" else [], [trained] * knobs.grad_units,
                          w.bytes_per_param, w.tier, opt.tier, device_type, chunk_bytes, knobs,
                          hbm_trained=w.tier == "hbm" or trainable_unit_numel is None,  # all trained: the rest too
                          states=states, master=master)
    if unit_bytes is not None:
        _fetch_bytes(parts, n_fetched, unit_bytes, knobs)
    parts += [dict(p) for p in activations]
    out = {f"{t}_bytes": sum(p["bytes"] for p in parts if p["tier"] == t) for t in TIERS}
    out["parts"] = parts
    return out


def _fetch_bytes(parts: list[dict], n_fetched: int, unit_bytes: int, knobs: Knobs) -> None:
    """The fetched units' working set at unit_bytes each (their records' bytes, not numel x itemsize)."""
    for part in parts:
        if part["name"] == "fetched weights":
            part["bytes"] = n_fetched * unit_bytes
            part["formula"] = (f"the largest {n_fetched} units x the largest unit's bytes as fetched, {unit_bytes:,} B "
                               f"(its linears as their quantized records; 1 in use + "
                               f"{knobs.prefetch_units} prefetched + {knobs.reuse_distance} kept by reuse_distance)")


# -- what the estimate is of: a parameter count, a HF config, or a preset ----------------------------

@dataclasses.dataclass(frozen=True)
class ModelShape:
    params: int
    largest_unit_numel: int
    source: str               # how params and the unit size were obtained, for the report
    trainable: int | None = None               # parameters trained when not all are (LoRA); the rest frozen
    trainable_unit_numel: int | None = None    # of those, in the largest unit
    quantized: QuantizedBase | None = None     # the frozen base's linears stored quantized


QUANTIZE_KINDS = {"nf4": "nf4 with double quantization, blocksize 64", "int8": "int8 with a fp32 scale per row"}


@dataclasses.dataclass(frozen=True)
class QuantizedBase:
    """A frozen base whose linears are stored quantized ([Note: a quantized base]): their parameters and record
    bytes, and per unit what it fetches; every other parameter at the compute dtype."""
    kind: str                     # nf4 or int8
    numel: int                    # parameters stored quantized: the linears bitsandbytes quantizes
    nbytes: int                   # their records' bytes (offload.plan.quantized.record_bytes)
    units: tuple[tuple[int, int, int], ...]   # per unit: (parameters, of those quantized, their records' bytes)

    @property
    def bits_per_param(self) -> float:
        return 8 * self.nbytes / self.numel

    def weight_bytes(self, params: int, itemsize: int) -> int:
        """Bytes of `params` weights (all the model's, adapters included) with these linears quantized."""
        return self.nbytes + (params - self.numel) * itemsize

    def unit_bytes(self, itemsize: int) -> int:
        """Bytes of the largest unit as fetched: its records and its other parameters at the compute dtype."""
        return max(qbytes + (numel - qnumel) * itemsize for numel, qnumel, qbytes in self.units)


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


def meta_model(model: str):
    """(--model built on the meta device, where it came from): a preset of offload.models, or the model
    AutoModelForCausalLM builds from a config.json or a directory holding one (any architecture it knows:
    the counts are the built model's, no formula per architecture), a packaged model's (offload.pretrained)
    from its cached directory."""
    from offload.models import PRESETS, build_model, hf_causal_lm  # local: the ledger itself needs no torch
    from offload.pretrained import PACKAGED, resolve_model

    model = resolve_model(model)  # a packaged model: its cached directory (converted on first use)
    if os.path.isdir(model) or model.endswith(".json") or os.sep in model:
        path = os.path.join(model, "config.json") if os.path.isdir(model) else model
        built = hf_causal_lm(path, device="meta")
        return built, f"{path} (model_type {built.config.model_type})"
    if model not in PRESETS:
        raise ValueError(f"--model={model}: no such file, directory or preset ({', '.join(PRESETS)}), nor a packaged "
                         f"model ({', '.join(PACKAGED)}); pass a config.json, a HF model directory or one of those")
    return build_model(model, device="meta"), f"preset {model!r}"


def model_shape(model: str) -> ModelShape:
    """--model: a config.json file, a directory holding one, or a preset name of offload.models."""
    return shape_of_model(*meta_model(model))


def shape_of_model(model, source: str | None = None, min_numel: int | None = None) -> ModelShape:
    """ModelShape of a built nn.Module (meta device is fine), as the runtime splits it into units
    (offload.plan.units.partition at units.min_numel): its parameters, counted once (tied ones too), its largest
    unit, and when some are frozen (a LoRA model) the trained ones and those of the unit holding the most."""
    from offload.plan.config import Config
    from offload.plan.units import partition

    units = partition(model, Config().units.min_numel if min_numel is None else min_numel)
    params = sum(s.numel for u in units for s in u.slots)
    trainable = sum(s.numel for u in units for s in u.slots if s.trainable)
    frozen = trainable < params
    return ModelShape(params, max(sum(s.numel for s in u.slots) for u in units), source or type(model).__name__,
                      trainable=trainable if frozen else None,
                      trainable_unit_numel=max(sum(s.numel for s in u.slots if s.trainable) for u in units)
                      if frozen else None)


def with_lora(model, r: int, targets) -> tuple[object, str]:
    """(the peft LoRA model of rank r around `model` on the meta device, its line for the source), as
    `offload train --lora r` wraps it: the model's parameters frozen, the adapters trained; targets None:
    the model's default."""
    from offload.lora import apply_lora, lora_targets
    from offload.models import LlamaLM

    info = {"kind": "preset" if isinstance(model, LlamaLM) else "hf"}
    if r < 1:
        raise ValueError(f"--lora={r}: the LoRA rank must be a positive integer")
    lora = {"r": r, "alpha": 2.0 * r, "targets": targets, "dropout": 0.0}
    lora["targets"] = lora_targets(model, info, lora)
    return apply_lora(model, info, lora), f"with LoRA r {r} on {','.join(lora['targets'])}"


def quantized_weights(model, kind: str) -> dict:
    """{parameter: its record's bytes} of the weights bitsandbytes stores as `kind` when `--quantize kind` loads
    `model` (offload.plan.quantized.quantizable_linears: every linear but the output head)."""
    _check_choice("--quantize", kind, tuple(QUANTIZE_KINDS))
    from offload.plan.quantized import quantizable_linears, record_bytes  # local import: it needs torch

    linears = quantizable_linears(model, f"--quantize={kind}")
    return {m.weight: record_bytes(kind, tuple(m.weight.shape)) for _, m in linears}


def with_quantized_base(shape: ModelShape, model, kind: str, records: dict) -> ModelShape:
    """The shape of `model` (built on meta, LoRA-wrapped: the base is frozen) whose weights in `records`
    (quantized_weights, taken before the LoRA wrapping) are stored as `kind` ([Note: a quantized base]);
    the parameter counts are unchanged, their bytes are not."""
    _check_choice("--quantize", kind, tuple(QUANTIZE_KINDS))
    if shape.trainable is None:
        raise ValueError(f"--quantize={kind}: a quantized base is frozen, it is trained through adapters; "
                         f"add --lora R")
    from offload.plan.config import Config
    from offload.plan.units import partition

    units = tuple((sum(s.numel for s in u.slots), sum(s.numel for s in u.slots if s.param in records),
                   sum(records.get(s.param, 0) for s in u.slots)) for u in partition(model, Config().units.min_numel))
    base = QuantizedBase(kind, sum(u[1] for u in units), sum(u[2] for u in units), units)
    return dataclasses.replace(shape, quantized=base, source=f"{shape.source}, the base's linears {kind}")


def estimate(shape: ModelShape, dp: int = 1, stage: int = 0, offload_param: str = "none",
             offload_optimizer: str = "none", precision: str = "bf16", dram_grad_bytes: int = 4,
             states: str = "fp32", master: str = "fp32", **runtime_kwargs) -> dict:
    """The whole estimate as the JSON of `offload estimate --json`."""
    if dp < 1:
        raise ValueError(f"dp={dp}: must be >= 1 (the number of data-parallel ranks)")
    terms = ledger_terms(stage, offload_param, offload_optimizer, precision, dram_grad_bytes, states, master)
    itemsize, q = terms[0].bytes_per_param, shape.quantized
    model_states = model_state_bytes(shape.params, dp, terms, shape.trainable,
                                     weight_bytes=q.weight_bytes(shape.params, itemsize) if q else None)
    runtime = runtime_bytes(shape.largest_unit_numel, terms, states=states, master=master, trainable_unit_numel=shape.trainable_unit_numel,
                            unit_bytes=q.unit_bytes(itemsize) if q else None,
                            **runtime_kwargs)  # gathered units are whole: no /D
    per_rank = {k: model_states[k] + runtime[k] for k in model_states}
    trainable = shape.params if shape.trainable is None else shape.trainable
    return {"params": shape.params, "trainable_params": trainable, "frozen_params": shape.params - trainable,
            "quantize": q.kind if q else None,
            "frozen_base": frozen_base(shape.params - trainable, itemsize, q) if shape.trainable is not None else None,
            "largest_unit_numel": shape.largest_unit_numel,
            "largest_unit_bytes": q.unit_bytes(itemsize) if q else shape.largest_unit_numel * itemsize,
            "source": shape.source,
            "dp": dp, "stage": stage, "offload_param": offload_param, "offload_optimizer": offload_optimizer,
            "precision": precision, "optimizer_states": states, "master": master, "K": terms[2].bytes_per_param, "device": runtime_kwargs.get("device_type", "cuda"),
            "model_states": model_states, "runtime": runtime, "per_rank": per_rank,
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
        extra = [f"{p['formula']} ({p['name']})" if not p["name"].startswith("activations") else
                 f"{p['name']} (runtime.parts: by formula)" for p in runtime["parts"] if p["tier"] == tier]
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
            f"(its linears but the output head) {q} ({fb['bits_per_quantized_param']:.3g} bits a parameter with their "
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
    acts = [p for p in result["runtime"]["parts"] if p["name"].startswith("activations")]
    lines = [f"{p['tier']} {p['name']}: {format_bytes(p['bytes'])} = {p['formula']}" for p in acts]
    missing = "allocator slack" if acts else "activations (--seq and --batch, or --activation-bytes), allocator slack"
    return "\n".join([head, *base, *rows, *lines, f"formula (P = params, {'T = trained params, ' if trained else ''}"
                      f"{quantized}D = ranks, U = {result['largest_unit_numel']:,}, "
                      f"the largest unit's numel): {result['formula']}",
                      f"Not included: {missing}."])

