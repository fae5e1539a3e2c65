"""`offload checkpoint inspect|export`: a checkpoint's manifest summarized; its weights as a HF directory."""

from __future__ import annotations

import datetime
import json
import os

import torch

from offload.checkpoint import format as ck

EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def register(subparsers) -> None:
    group = subparsers.add_parser("checkpoint", help="inspect a checkpoint, or export its weights for Hugging Face")
    actions = group.add_subparsers(dest="action", metavar="ACTION", parser_class=type(group))
    actions.required = True
    what = "a checkpoint directory, or a directory of checkpoints (then the one its `latest` names)"
    inspect = actions.add_parser("inspect", help="the manifest, summarized: step, precision, tensors, files")
    inspect.add_argument("ckpt", metavar="CKPT", help=what)
    inspect.add_argument("--verify", action="store_true", help="also read every range and check its crc32")
    inspect.add_argument("--json", action="store_true", help="print the summary as one JSON object, the last line")
    inspect.set_defaults(func=run_inspect)
    export = actions.add_parser(
        "export", help="the weights as Hugging Face safetensors shards (+ index, + config.json when known)",
        description="Writes the fp32 masters of trainable parameters and the weights of frozen ones (tied names "
                    "too) and the persistent buffers as safetensors shards with model.safetensors.index.json, and "
                    "config.json when the run's model was a Hugging Face one or a preset; from_pretrained loads it.")
    export.add_argument("ckpt", metavar="CKPT", help=what)
    export.add_argument("out", metavar="OUT", help="the directory to write (created if missing)")
    export.add_argument("--dtype", choices=tuple(EXPORT_DTYPES), default="fp32",
                        help="floating tensors as (default fp32: the masters, exactly)")
    export.add_argument("--max-shard-bytes", type=int, default=2 << 30, help="bytes per shard (default 2 GiB)")
    export.set_defaults(func=run_export)


def summary(ckpt: str, manifest: dict) -> dict:
    tensors = manifest["tensors"].values()
    numel = {n: _numel(e["shape"]) for n, e in manifest["tensors"].items()}
    return {"path": ckpt, "format_version": manifest["format_version"], "world_size": manifest["world_size"],
            "zero_stage": manifest["zero_stage"], "precision": manifest["precision"],
            "optimizer_states": manifest["config"].get("optimizer", {}).get("states", "fp32"),
            "step_count": manifest["step_count"], "micro_step": manifest["micro_step"],
            "loss_scale": manifest["loss_scale"], "skipped_steps": manifest["skipped_steps"],
            "parameters": len(numel), "trainable": sum(e["trainable"] for e in tensors),
            "elements": sum(numel.values()), "buffers": len(manifest["buffers"]),
            "files": {name: info["nbytes"] for name, info in manifest["files"].items()},
            "pending_update": manifest["pending_update"], "accumulator": manifest["accumulator"],
            "saved_at": manifest["saved_at"], "extra": sorted(manifest["extra"])}


def run_inspect(args) -> int:
    path = ck.resolve(args.ckpt)
    manifest = ck.read_manifest(path)
    info = summary(path, manifest)
    if args.verify:
        ck.verify(path, manifest)
        info["verified"] = True
    saved = datetime.datetime.fromtimestamp(info["saved_at"]).strftime("%Y-%m-%d %H:%M:%S")
    pending = ("a delayed update (lr {lr:.3g}) and its gradient".format(**info["pending_update"])
               if info["pending_update"] else f"the gradients of {info['micro_step']} micro-step(s)"
               if info["accumulator"] else "nothing")
    lines = [f"checkpoint  {path} (format {info['format_version']}, saved {saved})",
             f"run         {info['precision']}, world size {info['world_size']}, ZeRO stage {info['zero_stage']}, "
             f"{info['optimizer_states']} moments",
             f"step        {info['step_count']} (micro-step {info['micro_step']}); loss scale {info['loss_scale']:g}, "
             f"{info['skipped_steps']} skipped",
             f"tensors     {info['parameters']} parameters ({info['trainable']} trainable), {info['elements']:,} "
             f"elements; {info['buffers']} buffers",
             f"pending     {pending}",
             "files       " + ", ".join(f"{n} {b / 2**20:.1f} MiB" for n, b in info["files"].items()),
             f"extra       {', '.join(info['extra']) or '-'}"]
    if args.verify:
        lines.append("verified    every range's crc32")
    print("\n".join(lines))
    if args.json:
        print(json.dumps(info))
    return 0


def run_export(args) -> int:
    from offload.integrations.hf_io import copy_companions, save_hf_directory, with_dtype

    path = ck.resolve(args.ckpt)
    manifest = ck.read_manifest(path)
    dtype = EXPORT_DTYPES[args.dtype]
    extra = manifest["extra"]
    rename = extra.get("hf_names") or {}
    config = extra.get("hf_config")
    if config is not None:
        config = with_dtype(config, dtype)
    items = ck.iter_weights(path, manifest, dtype, dequantize=_dequantize)
    if extra.get("lora"):  # offload train --lora: the adapters merged into their weights, names without peft's
        from offload.lora import merged_items

        lora = extra["lora"]
        items = merged_items(items, lora["alpha"] / lora["r"], transposed=lora.get("transposed", ()))
    items = ((rename.get(n, n), t) for n, t in items) if rename else _as_saved(config, items)
    files = save_hf_directory(items, config, args.out, max_shard_bytes=args.max_shard_bytes)
    source = extra.get("hf_source")
    missing = source is not None and not os.path.isdir(source)
    companions = copy_companions(None if missing else source, args.out, config)
    print(f"offload checkpoint export: {len(files)} shard(s) in {args.out}"
          + (f", with {', '.join(companions)}" if companions else "")
          + ("" if config else " (no config.json: the checkpoint's model was not a Hugging Face one)")
          + (f" (the tokenizer files were not copied: {source}, the run's model directory, is gone)" if missing else ""))
    return 0


def _dequantize(spec: dict, record: torch.Tensor) -> torch.Tensor:
    """A QLoRA run's quantized base weight from its record's bytes, by bitsandbytes (the qlora extra)."""
    from offload.plan.quantized import dequantize_bytes

    return dequantize_bytes(spec, record)


def _as_saved(config: dict | None, items):
    """A Hugging Face model's tensors under the keys save_pretrained writes for it ([Note: checkpoint names] in
    offload.integrations.hf_io), from the model AutoModelForCausalLM builds from its config on the meta device;
    the names as they are for any other model."""
    from offload.integrations.hf_io import checkpoint_items
    from offload.models import hf_causal_lm

    try:
        model = hf_causal_lm(config, device="meta") if config is not None else None
    except (ValueError, TypeError):  # not a model AutoModelForCausalLM builds (transformers absent, another kind)
        model = None
    return items if model is None else checkpoint_items(model, items)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
