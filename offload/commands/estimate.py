"""`offload estimate`: bytes per rank and tier (hbm, dram, nvme): the ZeRO ledger plus runtime buffers."""

from __future__ import annotations

import dataclasses
import json
import math

import torch

from offload import estimate as est
from offload.lora import target_names
from offload.plan.chunks import planned_chunk_bytes
from offload.plan.config import MASTER_CHOICES, STATE_CHOICES, Config, load_config
from offload.plan.precision import resolve_precision

# `offload train`'s placement when no flag or config file names one (offload/recipe.py, resolve)
TRAIN_PLACEMENT = {"offload_param": "nvme", "offload_optimizer": "nvme"}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "estimate", help="memory needed per GPU, in host RAM and on NVMe, for a model, ZeRO stage and offload choice",
        description=__doc__ + " GB = 1e9 bytes. " + est.LEDGER)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=str, metavar="N", help="parameter count: 7.5e9, 7.5B, 350M")
    what.add_argument("--model", metavar="HF_CONFIG_OR_DIR",
                      help="a HF config.json, a directory with one (any causal LM AutoModelForCausalLM builds: counted "
                           "from the model built on the meta device), a preset name, or a packaged pretrained model "
                           "(smollm2: converted once into a cached directory, docs/training.md)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks (default 1)")
    p.add_argument("--stage", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage (default 0)")
    p.add_argument("--offload-param", default=None, choices=("none", "cpu", "nvme"),
                   help="where weights live (default none: nothing offloaded, the plain ZeRO ledger; `offload train` "
                        f"with no placement flags uses {TRAIN_PLACEMENT['offload_param']})")
    p.add_argument("--offload-optimizer", default=None, choices=("none", "cpu", "nvme"),
                   help="where fp32 optimizer states live (default none; `offload train` with no placement flags uses "
                        f"{TRAIN_PLACEMENT['offload_optimizer']})")
    p.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp16", "fp32"),
                   help="compute dtype of weights and gradients (default auto: what the engine picks on this host, "
                        "docs/precision.md)")
    p.add_argument("--unit-numel", type=int, default=None,
                   help="parameters in the largest unit (default: from the model; with --params, params/"
                        f"{est.DEFAULT_UNITS_FOR_PARAMS})")
    p.add_argument("--resident-units", type=int, default=None,
                   help="units whose full weights are in hbm at once (default 4: the one in use, 2 prefetched, "
                        "1 kept for its next use; the engine's defaults)")
    p.add_argument("--seq", type=int, default=None, metavar="T",
                   help="with --model and --batch: tokens per sequence; activations are counted by formula from the "
                        "model's shape (hidden size, layers, heads, vocab; docs/design.md \"Activations\")")
    p.add_argument("--batch", type=int, default=None, metavar="B", help="with --seq: sequences per micro-batch")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="the engine checkpoints each unit: activations are each unit's kept input and one unit's "
                        "recompute (as `offload train --activation-checkpointing`)")
    p.add_argument("--offload-activations", default="none", choices=("none", "cpu", "nvme"),
                   help="with --activation-checkpointing: where the kept unit inputs live (default none: hbm)")
    p.add_argument("--activation-bytes", type=int, default=0,
                   help="activations in hbm, if known: replaces the formula of --seq and --batch")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="the compute device the runtime buffers are for (default: this machine's, cuda when a GPU "
                        "is visible, else cpu: on the CPU backend an nvme fetch reads straight into the hbm copy, "
                        "with no staging chunk)")
    p.add_argument("--lora", type=int, default=None, metavar="R",
                   help="with --model: LoRA adapters of rank R trained, the model's own parameters frozen (weights "
                        "only: no gradient, no optimizer state), as `offload train --lora R`")
    p.add_argument("--lora-targets", default=None, metavar="NAMES",
                   help="with --lora: the adapted linears, in the model's own names, or all-linear (default: as "
                        "offload train --lora: peft's default for the model type; q_proj,v_proj for a preset)")
    p.add_argument("--quantize", default=None, choices=tuple(est.QUANTIZE_KINDS),
                   help="with --lora: the frozen base loaded quantized by bitsandbytes, every linear but the output "
                        "head counted at its record's bytes in every tier (nf4: double quantization, blocksize 64, "
                        "about 4.13 bits a parameter; int8: 1 byte and a fp32 scale per row); the embedding, lm_head "
                        "and norms stay at the compute dtype")
    p.add_argument("--optimizer-states", default="fp32", choices=STATE_CHOICES,
                   help="Adam's moments: fp32 (default) or int8 (a byte each and a fp32 scale per 256 elements)")
    p.add_argument("--master", default="fp32", choices=MASTER_CHOICES,
                   help="the master weights: fp32 (default) or split (bf16 only: the bf16 weight plus a record of "
                        "2 + 1/8 bytes, K's 4 B master becomes 2.125 B)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _shape(args):
    """(ModelShape, the model built on the meta device or None for --params): what is estimated."""
    if args.quantize is not None and args.params is not None:
        raise ValueError(f"--quantize={args.quantize}: needs --model (which weights are quantized, and their bytes, "
                         f"come from the layers' shapes, which --params does not give)")
    if args.quantize is not None and args.lora is None:
        raise ValueError(f"--quantize={args.quantize}: a quantized base is frozen, it is trained through adapters; "
                         f"add --lora R")
    if args.quantize is not None and args.unit_numel is not None:
        raise ValueError(f"--unit-numel={args.unit_numel}: with --quantize the largest unit's bytes come from the "
                         f"model's layers; drop --unit-numel")
    if args.lora is not None and args.model is None:
        raise ValueError("--lora: needs --model (the adapters' sizes come from the model's layers)")
    model = None
    if args.params is not None:
        params = est.parse_count(args.params)
        shape = est.ModelShape(params, math.ceil(params / est.DEFAULT_UNITS_FOR_PARAMS),
                               f"--params (largest unit assumed params/{est.DEFAULT_UNITS_FOR_PARAMS}; "
                               f"--unit-numel sets it)")
    else:
        model, source = est.meta_model(args.model)
        records = est.quantized_weights(model, args.quantize) if args.quantize is not None else None
        if args.lora is not None:  # as offload train --lora wraps it
            model, line = est.with_lora(model, args.lora, target_names(args.lora_targets))
            source = f"{source} {line}"
        shape = est.shape_of_model(model, source)
        if records is not None:
            shape = est.with_quantized_base(shape, model, args.quantize, records)
    if args.unit_numel is not None:
        if args.unit_numel < 1:
            raise ValueError(f"--unit-numel={args.unit_numel}: must be >= 1")
        shape = dataclasses.replace(shape, largest_unit_numel=args.unit_numel)
    return shape, model


def _check_activation_flags(args) -> None:
    for flag in ("seq", "batch"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag}={value}: must be a positive integer")
    if (args.seq is None) != (args.batch is None):
        given = "seq" if args.batch is None else "batch"
        raise ValueError(f"--{given}={getattr(args, given)}: activations need both --seq and --batch; add "
                         f"--{'batch' if given == 'seq' else 'seq'}")
    if args.seq is not None and args.model is None:
        raise ValueError(f"--seq={args.seq}: needs --model (the activations' formula reads the hidden size, layers, "
                         f"heads and vocab from the model); or pass --activation-bytes")
    if args.offload_activations != "none" and not args.activation_checkpointing:
        raise ValueError(f"--offload-activations={args.offload_activations}: places the inputs the engine's "
                         f"checkpoints keep; add --activation-checkpointing")


def _activation_parts(model, args, device_type: str) -> list[dict]:
    """The activations' parts for --batch x --seq by formula (offload.plan.activation_memory), or those given by
    --activation-bytes, or none; a model whose shape cannot be read: none, and one line says so."""
    if args.activation_bytes:
        return [{"name": "activations", "tier": "hbm", "bytes": args.activation_bytes, "formula": "given"}]
    if args.seq is None:
        return []
    from offload.plan.activation_memory import ActivationModel, attention_keeps_scores, model_dims
    from offload.plan.memory import OFFLOAD_TIER

    dims, source = model_dims(model)
    if dims is None:
        print(f"activations: not counted ({source})")
        return []
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.precision]
    scores = attention_keeps_scores(model, torch.device(device_type), dtype)
    return ActivationModel(dims, source, dtype.itemsize, scores, args.activation_checkpointing,
                           OFFLOAD_TIER[args.offload_activations]).parts(args.batch, args.seq)


def run(args) -> int:
    if (args.resident_units is not None and args.resident_units < 1) or args.activation_bytes < 0:
        raise ValueError(f"--resident-units={args.resident_units}, --activation-bytes={args.activation_bytes}: "
                         f"need at least 1 resident unit and non-negative bytes")
    _check_activation_flags(args)
    if args.master != "fp32":
        load_config({"precision": args.precision, "optimizer": {"master": args.master}})  # says why where refused
    placement_given = args.offload_param is not None or args.offload_optimizer is not None
    args.offload_param, args.offload_optimizer = args.offload_param or "none", args.offload_optimizer or "none"
    choice = resolve_precision(args.precision)  # as the engine would resolve it on this host
    args.precision = choice.name
    shape, model = _shape(args)
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    result = est.estimate(shape, dp=args.dp, stage=args.stage, offload_param=args.offload_param,
                          offload_optimizer=args.offload_optimizer, precision=args.precision,
                          states=args.optimizer_states, master=args.master, hbm_units=args.resident_units,
                          activations=_activation_parts(model, args, device_type),
                          device_type=device_type,
                          chunk_bytes=planned_chunk_bytes(Config().chunk_bytes, shape.largest_unit_numel))
    result["precision_reason"] = choice.line()
    plannable = model is not None and args.dp == 1
    if plannable and args.quantize is None:   # the model on the meta device, unquantized
        result["engine_plan"] = _engine_plan(model, args)
    table = est.format_table(result) + "\n" + choice.line()
    if plannable and args.quantize is not None:
        table += "\nthe engine's own plan: not shown with --quantize yet (the formula above counts the records)"
    if "engine_plan" in result:
        plan = result["engine_plan"]
        table += ("\nthe engine's own plan for this model in one process (padded unit buffers, staging, working "
                  "set, weights kept for their backward (reuse_bytes) on this machine): " + ", ".join(f"{t} {est.format_bytes(plan[f'{t}_bytes'])}" for t in est.TIERS))
    if not placement_given:
        table += "\n" + _placement_line()
    print(json.dumps(result) if args.json else table)
    return 0


def _placement_line() -> str:
    """What a run without placement flags shows, and how to see what `offload train`'s default needs."""
    flags = " ".join(f"--{key.replace('_', '-')} {device}" for key, device in TRAIN_PLACEMENT.items())
    return ("placement: nothing offloaded (this command's default: the plain ZeRO ledger); `offload train` with no "
            f"placement flags keeps weights and optimizer states on {TRAIN_PLACEMENT['offload_param']}: add "
            f"{flags} for its figures")


def _engine_plan(model, args) -> dict:
    """The Engine's placement for the model built on the meta device (nothing is allocated)."""
    from offload.plan.placement import engine_plan

    activations = {} if args.seq is None or args.activation_bytes else {
        "activations": {"batch": args.batch, "seq": args.seq},
        "activation_checkpointing": args.activation_checkpointing,
        "offload_activations": {"device": args.offload_activations}}
    return engine_plan(model, {"precision": args.precision, "offload_param": {"device": args.offload_param},
                               "offload_optimizer": {"device": args.offload_optimizer}, "nvme_path": ".",
                               "optimizer": {"states": args.optimizer_states},
                               **activations})
