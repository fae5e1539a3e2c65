"""`offload train`'s recipe: its flags, the settings they resolve to, and the model and data they build
(the run itself, its loop, evaluation, checkpoints and stop handling: offload.train).

With no arguments it fine-tunes the `small` preset on the bundled corpus with weights and optimizer
states swapped to NVMe under ./.offload-swap, in the precision "auto" picks for the host (fp32 on a CPU
without native bf16), for a few minutes on two CPU cores. `--model` also
takes a local Hugging Face directory of any causal LM that transformers' AutoModelForCausalLM builds (Llama,
Mistral, Qwen2, an MoE, GPT-2, ...), whose weights stream tensor by tensor from its safetensors shards into
their tiers (the model is built on the meta device and never exists whole in memory).

[Note: precedence of settings]
Explicit flags win, then the --offload-config file, then the --deepspeed config, then this recipe's
defaults (shown in --help), then Config's own defaults. The recipe's placement (both kinds of state on
nvme) applies only when neither a flag nor a file says where any state lives. From a DeepSpeed config the
run also takes train_micro_batch_size_per_gpu as --batch-size and --steps for an "auto" total_num_steps.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import os

import torch

import offload
from offload.answers import DEFAULT_SAMPLE_TOKENS
from offload.data import BatchSampler, ByteTokenizer, load_data, load_tokens, make_sampler
from offload.flags import file_settings, put_flags
from offload.integrations.hf_io import DTYPES as SAVE_DTYPES
from offload.lora import LoraWeights, apply_lora, lora_settings, lora_targets
from offload.models import PRESETS, build_model, hf_llama_config
from offload.pretrained import PACKAGED, resolve_model
from offload.plan.config import Config, load_config
from offload.plan.settings import set_dotted

DEFAULT_SWAP_DIR = "./.offload-swap"
DEFAULT_CHECKPOINT_DIR = "./checkpoints"
DEFAULT_KEEP_CHECKPOINTS = 2
DEFAULT_EVAL_BATCHES = 8

# What `offload train` runs with no flags (`make demo` passes its own: docs/training.md "make demo"): sized to
# train within a few minutes on 2 CPU cores in fp32, with nothing but the package (timings: bench/RESULTS.md,
# "make demo at the auto precision", when `make demo` ran it).
RECIPE = {"model": "small", "steps": 150, "batch_size": 8, "seq_len": 128, "lr": 3e-3,
          "warmup_steps": 10, "grad_accum": 1, "clip": 1.0, "seed": 0}
# Train flags that are config keys: flag dest -> (config path, recipe default).
CONFIG_FLAGS = {"lr": ("optimizer.lr", RECIPE["lr"]),
                "warmup_steps": ("lr_schedule.warmup_steps", RECIPE["warmup_steps"]),
                "grad_accum": ("gradient_accumulation_steps", RECIPE["grad_accum"]),
                "clip": ("gradient_clipping", RECIPE["clip"]),
                "seed": ("seed", RECIPE["seed"])}


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `offload train` flags (defaults None: the recipe or the config file decides)."""
    g = parser.add_argument_group("training")
    g.add_argument("--model", default=None, metavar="PRESET|PACKAGED|HF_DIR",
                   help=f"a preset ({', '.join(PRESETS)}), a pretrained model a pip package ships "
                        f"({', '.join(PACKAGED)}: converted once into a cached Hugging Face directory, "
                        f"docs/training.md) or a local Hugging Face directory of a causal LM that "
                        f"AutoModelForCausalLM builds (Llama, Mistral, Qwen2, Mixtral, GPT-2, ...; default "
                        f"{RECIPE['model']})")
    g.add_argument("--data", default=None, metavar="PATH",
                   help="a local .txt file, or .jsonl (a record a line) / .json (an array) of records, all "
                        "{\"text\"}, all {\"prompt\",\"completion\"}, all {\"messages\": [{\"role\",\"content\"}...]} (the "
                        "tokenizer's chat template, else a plain one) or all Alpaca {\"instruction\",\"input\","
                        "\"output\"}; text is packed into --seq-len windows and trained on every token, the others "
                        "are one example per row, right-padded, with the loss on completions / assistant turns only "
                        "(default: bundled Shakespeare)")
    g.add_argument("--steps", type=int, default=None, help=f"optimizer steps (default {RECIPE['steps']})")
    g.add_argument("--batch-size", type=int, default=None, help=f"sequences per micro-batch (default {RECIPE['batch_size']})")
    g.add_argument("--seq-len", type=int, default=None, help=f"tokens per sequence (default {RECIPE['seq_len']})")
    g.add_argument("--lr", type=float, default=None, help=f"peak learning rate, cosine decay to 10%% (default {RECIPE['lr']})")
    g.add_argument("--warmup-steps", type=int, default=None, help=f"linear warmup steps (default {RECIPE['warmup_steps']})")
    g.add_argument("--grad-accum", type=int, default=None, help="micro-batches per optimizer step (default 1)")
    g.add_argument("--clip", type=float, default=None, help=f"gradient clipping norm, 0 = off (default {RECIPE['clip']})")
    g.add_argument("--seed", type=int, default=None, help="seed for initialization and batches (default 0)")
    g.add_argument("--out", default=None, metavar="DIR", help="report directory (default ./runs/<timestamp>)")
    g.add_argument("--save", default=None, metavar="DIR",
                   help="save the trained weights as a Hugging Face directory; with --lora the adapter as peft saves it "
                        "(docs/training.md 'LoRA')")
    g.add_argument("--save-merged", default=None, metavar="DIR",
                   help="with --lora: the model with its adapters merged (W + alpha/r B A) as a Hugging Face directory; "
                        "without: as --save")
    g.add_argument("--save-dtype", default=None, choices=("auto", *SAVE_DTYPES), metavar="auto|bf16|fp16|fp32",
                   help="the dtype --save and --save-merged write (config.json says it); auto (the default): the "
                        "model's own, as config.json gives it (a preset's fp32), and a LoRA adapter's fp32")
    g.add_argument("--json", action="store_true", help="print the report as one JSON object, the last stdout line")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--trace", default=None, metavar="PATH",
                   help="write a Chrome/Perfetto trace of the run (and PATH.png: the last step's timeline)")
    e = parser.add_argument_group("evaluation")
    e.add_argument("--eval-data", default=None, metavar="PATH",
                   help="a local file as --data takes, to evaluate on: the loss over the same --eval-batches batches "
                        "(forward only), before the first step, every --eval-every steps and after the last")
    e.add_argument("--eval-every", type=int, default=None, metavar="N", help="evaluate every N steps (default: "
                   "after the last step only)")
    e.add_argument("--eval-batches", type=int, default=None, metavar="B",
                   help=f"batches of --batch-size x --seq-len per evaluation (default {DEFAULT_EVAL_BATCHES})")
    e.add_argument("--sample-prompts", default=None, metavar="PATH",
                   help="a .txt file of prompts, one a line, that the model answers (greedy) before the first step "
                        "and after the last, put as --data's records put theirs (a chat: the tokenizer's chat "
                        "template); the answers are in the summary and the report")
    e.add_argument("--sample-tokens", type=int, default=None, metavar="N",
                   help=f"new tokens at most per answer to --sample-prompts (default {DEFAULT_SAMPLE_TOKENS})")
    lo = parser.add_argument_group("LoRA (peft: pip install 'offload[lora]'; in a source checkout "
                                   "pip install -e '.[lora]')")
    lo.add_argument("--lora", type=int, default=None, metavar="R",
                    help="train LoRA adapters of rank R on the frozen model (default: every parameter is trained)")
    lo.add_argument("--lora-alpha", type=float, default=None, metavar="A",
                    help="LoRA alpha: the update is scaled by A / R (default 2R)")
    lo.add_argument("--lora-targets", default=None, metavar="NAMES",
                    help="comma-separated linears to adapt in the model's own names (each must name one; a preset "
                         "takes transformers' Llama names), or all-linear: every linear but the output head "
                         "(default: peft's default for the model type, q_proj,v_proj for Llama and a preset)")
    lo.add_argument("--quantize", default=None, choices=("nf4", "fp4", "int8"),
                    help="with --lora: the frozen base quantized by bitsandbytes as it is materialized (QLoRA: nf4 with "
                         "double quantization; config quantize_base; pip install 'offload[qlora]', in a source checkout "
                         "pip install -e '.[qlora]')")
    lo.add_argument("--lora-dropout", type=float, default=None, metavar="P",
                    help="dropout on the adapters' input (default 0)")
    c = parser.add_argument_group("checkpoints")
    c.add_argument("--save-every", type=int, default=None, metavar="N",
                   help="save a checkpoint every N steps, at the last step and on SIGTERM (in --checkpoint-dir), "
                        "written in the background while training goes on (SIGTERM's: before stopping)")
    c.add_argument("--save-blocking", action="store_true",
                   help="with --save-every: training waits while each checkpoint is written")
    c.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help=f"where checkpoints go and `--resume latest` looks (default {DEFAULT_CHECKPOINT_DIR})")
    c.add_argument("--keep-checkpoints", type=int, default=None, metavar="K",
                   help=f"keep the newest K checkpoints (default {DEFAULT_KEEP_CHECKPOINTS})")
    c.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH|latest",
                   help="continue from a checkpoint (its directory, or a directory of checkpoints); `latest` (or "
                        "no value): the newest in --checkpoint-dir, or step 0 when there is none yet")
    return parser


def train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="offload train", description=__doc__.split("\n\n")[0])
    add_train_arguments(parser)
    offload.add_arguments(parser)
    return parser


def as_namespace(args_or_config) -> argparse.Namespace:
    """A Namespace from the parser's, or from a dict of the same keys (`{"model": "tiny", "steps": 2}`)."""
    if isinstance(args_or_config, argparse.Namespace):
        return args_or_config
    ns = train_parser().parse_args([])
    known = sorted(vars(ns))
    for key, value in dict(args_or_config or {}).items():
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            raise ValueError(f"{key}: unknown train setting; " + (f"did you mean {near[0]!r}?" if near
                             else f"valid keys: {', '.join(known)}"))
        setattr(ns, key, value)
    return ns


# --- settings ----------------------------------------------------------------------------------------


def _get(data: dict, path: str):
    for part in path.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def resolve(args: argparse.Namespace) -> tuple[Config, dict]:
    """(offload Config, run settings {model, data, steps, batch_size, seq_len}) per the precedence note."""
    steps = RECIPE["steps"] if args.steps is None else args.steps
    file = file_settings(args, total_steps=steps if isinstance(steps, int) and steps > 0 else None)
    data = copy.deepcopy(file)
    placement_given = bool(args.offload_param or args.offload_optimizer
                           or "offload_param" in file or "offload_optimizer" in file)
    if not placement_given:
        data["offload_param"] = {**data.get("offload_param", {}), "device": "nvme"}
        data["offload_optimizer"] = {**data.get("offload_optimizer", {}), "device": "nvme"}
    if args.offload_param:
        set_dotted(data, "offload_param.device", args.offload_param)
        if args.offload_param != "none" and not _get(data, "offload_optimizer.device"):
            set_dotted(data, "offload_optimizer.device", "cpu")  # as config_from_args: states follow weights off
    if args.offload_optimizer:
        set_dotted(data, "offload_optimizer.device", args.offload_optimizer)
    put_flags(args, data)
    data.setdefault("nvme_path", DEFAULT_SWAP_DIR)
    run = {k: RECIPE[k] if getattr(args, k, None) is None else getattr(args, k)
           for k in ("model", "steps", "batch_size", "seq_len")}
    if args.batch_size is None and args.deepspeed:
        from offload.integrations.deepspeed import micro_batch_size

        run["batch_size"] = micro_batch_size(args.deepspeed) or run["batch_size"]
    run["data"] = args.data
    run["eval"] = _eval_settings(args)
    run["prompts"] = _prompt_settings(args)
    run["lora"] = lora_settings(args)
    run["save_dtype"] = _save_dtype(args)
    if getattr(args, "quantize", None) is not None:
        data["quantize_base"] = args.quantize
    if data.get("quantize_base") is not None and run["lora"] is None:
        raise ValueError(f"--quantize={data['quantize_base']}: a quantized base cannot be trained itself (its weights "
                         "are integers; there is no gradient for them): it is frozen and trained through adapters; "
                         "add --lora R (QLoRA), or drop --quantize for a full fine-tune")
    for dest, (path, default) in CONFIG_FLAGS.items():
        value = getattr(args, dest)
        if dest == "warmup_steps" and isinstance(run["steps"], int):
            default = min(default, run["steps"] // 10)  # short runs get a short warmup
        if value is not None or _get(file, path) is None:
            set_dotted(data, path, default if value is None else value)
    _check_run(run, data)
    # the memory plan counts the activations of a micro-batch of the run (offload.plan.activation_memory)
    data.setdefault("activations", {"batch": run["batch_size"], "seq": run["seq_len"]})
    if "type" not in data.get("lr_schedule", {}):  # cosine over the run, down to 10%
        data["lr_schedule"].update(type="cosine", total_steps=run["steps"], min_ratio=0.1)
    return load_config(data), run


def _eval_settings(args) -> dict | None:
    """{data, every, batches} of the --eval-* flags, or None without --eval-data."""
    for flag in ("eval_every", "eval_batches"):
        value = getattr(args, flag)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"--{flag.replace('_', '-')}={value}: must be a positive integer")
    if args.eval_data is None:
        if args.eval_every is not None or args.eval_batches is not None:
            raise ValueError("--eval-every/--eval-batches: need --eval-data PATH (a local .txt or .jsonl file "
                             "to evaluate on)")
        return None
    batches = DEFAULT_EVAL_BATCHES if args.eval_batches is None else args.eval_batches
    return {"data": args.eval_data, "every": args.eval_every, "batches": batches}


def _prompt_settings(args) -> dict | None:
    """{path, max_new_tokens} of --sample-prompts and --sample-tokens, or None without --sample-prompts."""
    tokens = getattr(args, "sample_tokens", None)
    if tokens is not None and (not isinstance(tokens, int) or tokens < 1):
        raise ValueError(f"--sample-tokens={tokens}: must be a positive integer")
    if getattr(args, "sample_prompts", None) is None:
        if tokens is not None:
            raise ValueError("--sample-tokens: needs --sample-prompts PATH (a .txt file of prompts, one a line)")
        return None
    return {"path": args.sample_prompts, "max_new_tokens": DEFAULT_SAMPLE_TOKENS if tokens is None else tokens}


def _save_dtype(args) -> str:
    """--save-dtype, checked: "auto" when not given."""
    choice = getattr(args, "save_dtype", None)
    if choice is None:
        return "auto"
    if choice not in ("auto", *SAVE_DTYPES):
        raise ValueError(f"--save-dtype={choice}: not a dtype to save in; pass auto, {', '.join(SAVE_DTYPES)}")
    if args.save is None and args.save_merged is None:
        raise ValueError(f"--save-dtype={choice}: applies to what --save or --save-merged writes; add one of them")
    return choice


def _check_run(run: dict, data: dict) -> None:
    for key in ("steps", "batch_size", "seq_len"):
        if not isinstance(run[key], int) or run[key] < (2 if key == "seq_len" else 1):
            raise ValueError(f"--{key.replace('_', '-')}={run[key]}: must be a positive integer"
                             + (" >= 2" if key == "seq_len" else ""))
    warmup = _get(data, "lr_schedule.warmup_steps") or 0
    if warmup >= run["steps"] and "type" not in data.get("lr_schedule", {}):
        raise ValueError(f"--warmup-steps={warmup}: must be less than --steps={run['steps']}; "
                         f"shorten the warmup or train longer")


# --- model and weights --------------------------------------------------------------------------------


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def _hf_tokenizer(directory: str):
    """The directory's own tokenizer (local files only), or None when it has none (then: bytes)."""
    if not any(os.path.isfile(os.path.join(directory, f)) for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as e:  # a broken or incomplete tokenizer: say which, rather than train on garbage ids
        raise ValueError(f"--model={directory}: its tokenizer files do not load ({e}); fix or remove them") from e


def load_token_ids(path: str | None, tokenizer=None) -> torch.Tensor:
    """Token ids of a text --data file (or the bundled corpus): bytes by default, else the model's own
    tokenizer (int32: real vocabularies exceed int16), each document followed by its EOS. Instruction
    records are read by offload.data.load_data ([Note: what --data reads] there)."""
    return load_tokens(path, tokenizer)


def build(run: dict, cfg: Config):
    """(model, weights source or None, info dict) for a preset or a HF directory (built on meta); a LoRA run's
    run["lora"]["targets"] become the targets used (the model's default when none were given). A packaged
    model's name (offload.pretrained) is its cached directory."""
    name = resolve_model(run["model"])
    if os.path.isdir(name):
        from offload.integrations.hf_io import SafetensorsWeights

        model = build_model(name, device="meta")  # AutoModelForCausalLM's; buffers made by the Engine's init
        saved_config = json.loads(json.dumps(model.config.to_dict(), default=str))  # as the directory has it
        model.config.use_cache = False  # training needs no cache of past keys and values
        weights = SafetensorsWeights(name, model=model)  # the model's names, tied or converted
        max_len = getattr(model.config, "max_position_embeddings", None)  # GPT-2: n_positions, by its attribute_map
        vocab = getattr(model.config, "vocab_size", None)
        tokenizer = _hf_tokenizer(name)
        info = {"kind": "hf", "hf_config": saved_config, "tokenizer": tokenizer, "source": os.path.abspath(name)}
    elif name in PRESETS:
        preset = PRESETS[name]
        model = build_model(name, device="meta")  # the Engine materializes it unit by unit (seeded)
        weights, max_len, vocab = None, preset.max_seq_len, preset.vocab_size
        info = {"kind": "preset", "name": name, "hf_config": hf_llama_config(preset), "tokenizer": None,
                "source": None}
    else:
        raise ValueError(f"--model={name}: neither a preset ({', '.join(PRESETS)}), a packaged model "
                         f"({', '.join(PACKAGED)}) nor a directory; pass one of those or a local Hugging Face "
                         f"directory")
    if max_len is not None and run["seq_len"] > max_len:
        raise ValueError(f"--seq-len={run['seq_len']}: longer than the model's maximum of {max_len}; "
                         f"pass --seq-len {max_len} or less")
    tok = info["tokenizer"]
    need = len(tok) if tok is not None else ByteTokenizer.vocab_size
    if vocab is not None and vocab < need:
        raise ValueError(f"--model={name}: vocab_size={vocab} is smaller than the tokenizer's {need} "
                         f"({'its own' if tok is not None else 'bytes + EOS'}); use a model with at least that "
                         f"many embeddings")
    if cfg.quantize_base is not None:  # bitsandbytes layers, quantized as the engine materializes them
        from offload.plan.quantized import bitsandbytes, replace_linears

        bitsandbytes()
        info["quantized"] = {"kind": cfg.quantize_base, "layers": len(replace_linears(model, cfg.quantize_base,
                                                                                      cfg.compute_dtype))}
    if run.get("lora") is not None:  # the frozen base and peft's adapters (offload.lora)
        run["lora"] = {**run["lora"], "targets": lora_targets(model, info, run["lora"])}  # the model's default
        model = apply_lora(model, info, run["lora"])
        weights = LoraWeights(weights, model, cfg.seed) if weights is not None else None
    info["params"] = sum(p.numel() for p in model.parameters())
    info["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return model, weights, info


# --- data ------------------------------------------------------------------------------------------------


def data_sampler(flag: str, path: str | None, tokenizer, run: dict, seed: int):
    """The sampler over the file of --data or --eval-data (`flag`; [Note: what --data reads] in offload/data.py).
    Its errors start with the flag: reading's name the file and the line or record, the sampler's do not, so
    the flag carries the path."""
    try:
        data = load_data(path, tokenizer)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from e
    try:
        return make_sampler(data, run["batch_size"], run["seq_len"], seed=seed)
    except ValueError as e:
        raise ValueError(f"{flag}={path}: {e}") from e


class RankSlice:
    """Each rank trains its own batches: micro-batch i of rank r is the stream's batch i x world + r, so the
    global batch is world x batch_size and no two ranks see the same one."""

    def __init__(self, sampler: BatchSampler, rank: int, world: int):
        self.sampler, self.rank, self.world = sampler, rank, world

    def batch(self, i: int):
        return self.sampler.batch(i * self.world + self.rank)

