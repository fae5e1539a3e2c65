"""The main job as a plain function: `train(args_or_config) -> report dict` (the CLI is thin on top).

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
import errno
import json
import os
import signal
import sys
import threading
import time

import torch

import offload
from offload.plan.config import Config, load_config
from offload.plan.settings import set_dotted
from offload.kernels.cpu_adam import kernel_backend
from offload.data import BatchSampler, ByteTokenizer, load_data, load_tokens, make_sampler
from offload.flags import file_settings, put_flags
from offload.integrations.hf_io import DTYPES as SAVE_DTYPES
from offload.lora import (LoraWeights, apply_lora, base_name, check_mergeable, lora_settings, lora_targets, save_dtype,
                          transposed_layers)
from offload.models import PRESETS, build_model, hf_llama_config, hf_name, loss_of
from offload.state.ranks import reduced
from offload.signals import SIGNALS, Stopped, stop_on_signals
from offload.watchdog import LauncherWatch, SignalWatchdog

DEFAULT_SWAP_DIR = "./.offload-swap"
DEFAULT_CHECKPOINT_DIR = "./checkpoints"
DEFAULT_KEEP_CHECKPOINTS = 2
DEFAULT_EVAL_BATCHES = 8
PER_STEP = ("losses", "step_seconds", "lrs", "grad_norms", "stall_seconds")  # history: one entry per step

# What `make demo` runs: sized to train within a few minutes on 2 CPU cores in fp32 (docs/training.md, "make
# demo"; timings: bench/RESULTS.md, "make demo at the auto precision").
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
    g.add_argument("--model", default=None, metavar="PRESET|HF_DIR",
                   help=f"a preset ({', '.join(PRESETS)}) or a local Hugging Face directory of a causal LM that "
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
                        "(forward only), every --eval-every steps and after the last")
    e.add_argument("--eval-every", type=int, default=None, metavar="N", help="evaluate every N steps (default: "
                   "after the last step only)")
    e.add_argument("--eval-batches", type=int, default=None, metavar="B",
                   help=f"batches of --batch-size x --seq-len per evaluation (default {DEFAULT_EVAL_BATCHES})")
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
                   help="save a checkpoint every N steps, at the last step and on SIGTERM (in --checkpoint-dir)")
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


def _as_namespace(args_or_config) -> argparse.Namespace:
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
    run["lora"]["targets"] become the targets used (the model's default when none were given)."""
    name = run["model"]
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
        raise ValueError(f"--model={name}: neither a preset ({', '.join(PRESETS)}) nor a directory; "
                         f"pass a preset name or a local Hugging Face directory")
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


# --- the run -----------------------------------------------------------------------------------------


def train(args_or_config=None) -> dict:
    """Runs the job and returns its report (also written to --out). See the module docstring.

    SIGTERM or SIGINT ([Note: signals] in offload/signals.py) stop it: the engine closes (its swap files
    go), the partial report is written and printed, one line on stderr says so, and offload.Stopped is
    raised with the report as its `.report` (the CLI exits with 128 + the signal number). Under torchrun, a
    rank whose launcher is gone (torchrun killed with SIGKILL) stops as if the launcher had sent it SIGTERM
    ([Note: a rank whose launcher is gone] in offload/watchdog.py)."""
    args = _as_namespace(args_or_config)
    cfg, run = resolve(args)
    with LauncherWatch(label=f"offload train (rank {os.environ.get('RANK', 0)})") as watch:
        return _train(args, cfg, run, watch)


def _train(args: argparse.Namespace, cfg: Config, run: dict, watch: LauncherWatch) -> dict:
    """train() once its settings are resolved."""
    from offload import report as rep

    rank, world = _join_torchrun(cfg.collective_timeout_s)
    if args.out is None:  # over ranks, one directory: rank 0's start time (the ranks agree on the earliest)
        started = reduced([time.time()], "min")[0] if world > 1 else time.time()
        args.out = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S", time.localtime(started)))
    if rank:  # one voice: rank 0 prints; the others write their reports under <out>/.rank<r>
        args.quiet_rank, args.no_progress = True, True
        args.out = os.path.join(args.out, f".rank{rank}")
    if world > 1:
        run = {**run, "ranks": world}  # each step trains ranks x batch_size sequences; losses are their mean
    model, weights, info = build(run, cfg)
    if args.save_merged and run["lora"] is not None:
        check_mergeable(model)  # before training, not after it
    sampler = _RankSlice(data_sampler("--data", run["data"], info["tokenizer"], run, cfg.seed), rank, world)
    evaluator = Evaluator.from_run(run, cfg, info["tokenizer"])  # every rank: the same batches, the same loss
    checkpoints = Checkpoints.from_args(args, run, cfg, model, info)
    resume = _resume_point(args, run, cfg)
    out_dir = args.out
    made = not os.path.isdir(out_dir)
    os.makedirs(out_dir, exist_ok=True)  # before training: an unwritable --out fails now, not after the run
    history = {**{k: [] for k in PER_STEP}, "eval_losses": [], "samples": []}
    engine, init_s = None, None
    t0 = time.perf_counter()
    with SignalWatchdog(label=f"offload train (rank {rank})" if world > 1 else "offload train"), \
            stop_on_signals((signal.SIGINT,) if checkpoints else SIGNALS) as check_stop:  # SIGTERM: saved first
        try:
            kernel_backend()  # build/load the CPU Adam kernel now, not inside the first timed step
            with offload.initialize(model, cfg, weights=weights) as engine:
                cfg = engine.cfg  # its precision as resolved for this host ("auto": offload.plan.precision)
                if resume is not None:
                    engine.load_checkpoint(resume[0])
                    run = {**run, "start_step": resume[1], "resumed_from": resume[0]}
                init_s = time.perf_counter() - t0
                rep.print_header(run, cfg, info, engine, quiet=args.json or getattr(args, "quiet_rank", False))
                if args.trace:
                    engine.start_trace()
                _loop(engine, sampler, run, cfg, history, check_stop, progress=not args.no_progress,
                      checkpoints=checkpoints, evaluator=evaluator)
                final = engine.stats()
                if args.trace:
                    engine.save_trace(args.trace)
                    rep.plot_timeline(engine.rt.telemetry.chrome_trace(), args.trace + ".png")
                saved = save(engine, info, args.save, run["lora"], dtype=run["save_dtype"]) if args.save else None
                merged = (save(engine, info, args.save_merged, run["lora"], merged=True, dtype=run["save_dtype"])
                          if args.save_merged else None)
            check_stop()
        except Stopped as stop:  # the engine is closed: its swap files are gone
            watch.stand_down()  # stopping already (its SIGTERM handler gone): the report is written, not cut off
            stop.report = _stopped(stop, args, run, cfg, info, history, engine, init_s, out_dir)
            raise
        except SaveFailed as failed:  # the steps done are reported; the last good checkpoint is untouched
            failed.report = _save_failed(failed, args, run, cfg, info, history, engine, init_s, out_dir)
            raise
        except BaseException:  # a failed run leaves no empty run directory behind
            if made and os.path.isdir(out_dir) and not os.listdir(out_dir):
                os.rmdir(out_dir)
            raise
        finally:
            if weights is not None:
                weights.close()
    report = rep.build_report(run, cfg, info, history, final, init_s, out_dir, saved)
    report["saved_merged"] = merged
    for key, adapter in (("saved", run["lora"] is not None), ("saved_merged", False)):  # what each holds
        dtype = save_dtype(info, run["save_dtype"], adapter) if report[key] else None
        report[f"{key}_dtype"] = str(dtype).removeprefix("torch.") if dtype else None
    _publish(report, args)
    return report


def _join_torchrun(timeout_s: float) -> tuple[int, int]:
    """Under torchrun (WORLD_SIZE > 1 in the environment): joins the default process group from its
    environment (gloo on CPUs, NCCL on GPUs; its collectives time out after `timeout_s`, as the engine's
    own do: [Note: collective order] in offload.state.ranks) and returns (rank, world size); (0, 1) otherwise.
    The engine then trains over the ranks (zero_stage 0, or 1-3 with states and weights partitioned) or
    refuses what is not built yet; never N copies."""
    import datetime

    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def _mean_over_ranks(x: float) -> float:
    import torch.distributed as dist

    return reduced([x])[0] / dist.get_world_size()


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


class _RankSlice:
    """Each rank trains its own batches: micro-batch i of rank r is the stream's batch i x world + r, so the
    global batch is world x batch_size and no two ranks see the same one."""

    def __init__(self, sampler: BatchSampler, rank: int, world: int):
        self.sampler, self.rank, self.world = sampler, rank, world

    def batch(self, i: int):
        return self.sampler.batch(i * self.world + self.rank)


def _publish(report: dict, args) -> None:
    from offload import report as rep

    rep.write(report, report["out_dir"])
    if getattr(args, "quiet_rank", False):  # not rank 0 under torchrun: its report is written, not printed
        return
    print(rep.summary_table(report), flush=True)
    if args.json:
        print(json.dumps(report), flush=True)


def _stopped(stop: Stopped, args, run: dict, cfg: Config, info: dict, history: dict, engine, init_s,
             out_dir: str) -> dict | None:
    """After a signal: the partial report (none when training had not started) and the one-line message."""
    from offload import report as rep
    from offload.swap import list_runs

    done = min(len(history[k]) for k in PER_STEP)  # the signal may split a step's appends
    for k in PER_STEP:
        del history[k][done:]
    report = None
    if engine is not None:
        stats = history.get("stats") or engine.stats()  # closed now: its swap file is gone
        report = rep.build_report(run, cfg, info, history, stats, init_s, out_dir, None)
        report["stopped"] = {"signal": stop.name, "steps_done": done}
        _publish(report, args)
    left = [str(r.path) for r in list_runs(cfg.swap_dir(getattr(engine, "rank", 0)))
            if r.pid == os.getpid()] if cfg.nvme_path else []
    if left:  # not closed (stopped while the engine was being built): atexit still removes them
        files = f"swap files still in {', '.join(left)}"
    elif "nvme" in (cfg.offload_param.device, cfg.offload_optimizer.device):
        files = "swap files removed"
    else:
        files = "no swap files"
    where = "after" if engine is not None else "while setting up, before"
    print(f"offload train: stopped by {stop.name} {where} step {done} of {run['steps']}; {files}"
          + (f"; partial report in {out_dir}" if report else ""), file=sys.stderr, flush=True)
    return report


def _save_failed(failed: "SaveFailed", args, run: dict, cfg: Config, info: dict, history: dict, engine, init_s,
                 out_dir: str) -> dict:
    """After a checkpoint save failed: the report of the steps done, with what failed."""
    from offload import report as rep

    report = rep.build_report(run, cfg, info, history, engine.stats(), init_s, out_dir, None)
    report["failed"] = {"checkpoint": failed.path, "step": failed.step, "error": str(failed.cause),
                        "last_good_checkpoint": failed.last_good}
    _publish(report, args)
    failed.out_dir = out_dir
    return report


def _loop(engine, sampler: BatchSampler, run: dict, cfg: Config, history: dict, check_stop, progress: bool,
          checkpoints: "Checkpoints | None" = None, evaluator: "Evaluator | None" = None) -> None:
    """Trains from run["start_step"] (0, or where --resume continues) to run["steps"], appending to
    `history` as each step ends (a stopped run keeps what it has); check_stop() after each step raises a
    signal's Stopped that something swallowed (offload/signals.py). With checkpoints, a SIGTERM is held
    until the step ends, the checkpoint is saved, and then the run stops as for any signal. The evaluator's
    loss (when due) is taken after the step's timing, so step times and stalls are training's alone."""
    from offload.report import Progress, Sampler, tokens_per_step as run_tokens

    gas = cfg.gradient_accumulation_steps
    tokens_per_step = run_tokens(run, cfg)
    start = run.get("start_step", 0)
    engine.train()
    with Sampler(engine) as samples, Progress(run["steps"] - start, tokens_per_step, enabled=progress) as bar, \
            _SaveOnSigterm(checkpoints is not None) as sigterm:
        history["samples"] = samples.rows
        for step in range(start, run["steps"]):
            t = time.perf_counter()
            stall0 = engine.rt.telemetry.stall_seconds  # not stats(): that lists the swap directory
            lr, loss_sum = engine.lr, 0.0
            for micro in range(gas):
                ids, labels = sampler.batch(step * gas + micro)
                loss = loss_of(engine(ids.to(engine.device), labels=labels.to(engine.device)))
                engine.backward(loss)
                loss_sum += loss.item()
            engine.step()
            if getattr(engine, "world", 1) > 1:  # the global batch's loss (the d2h thread is idle now)
                loss_sum = _mean_over_ranks(loss_sum)
            seconds = time.perf_counter() - t
            engine.rt.telemetry.span("step", f"step {step + 1}", t, t + seconds)
            stats = history["stats"] = engine.stats()  # the last one also serves a stopped run's report
            history["losses"].append(loss_sum / gas)
            history["step_seconds"].append(seconds)
            history["lrs"].append(lr)
            history["grad_norms"].append(getattr(engine, "last_grad_norm", None))
            history["stall_seconds"].append(stats["stall_seconds"] - stall0)
            if evaluator is not None and evaluator.due(step + 1):
                history["eval_losses"].append({"step": step + 1, "loss": evaluator.loss(engine)})
                bar.eval_loss = history["eval_losses"][-1]["loss"]
            bar.update(loss_sum / gas, seconds, stats, stats["stall_seconds"] - stall0)
            preempted = sigterm.agreed(getattr(engine, "world", 1))
            if checkpoints is not None and (checkpoints.due(step + 1) or preempted):
                path = checkpoints.save(engine, step + 1)
                if preempted:
                    print(f"offload train: SIGTERM: saved {path} after step {step + 1}; continue with --resume",
                          file=sys.stderr, flush=True)
                    raise Stopped(signal.SIGTERM)
            check_stop()


class Evaluator:
    """The loss on --eval-data: the mean over the same `batches` batches at every evaluation (batch i of a
    sampler over the eval tokens, seeded as training's), forward only, through the engine under no_grad
    with the model in eval mode."""

    def __init__(self, sampler: BatchSampler, every: int | None, batches: int, last_step: int):
        self.sampler, self.every, self.batches, self.last_step = sampler, every, batches, last_step

    @classmethod
    def from_run(cls, run: dict, cfg: Config, tokenizer) -> "Evaluator | None":
        ev = run["eval"]
        if ev is None:
            return None
        if not os.path.isfile(ev["data"]):
            raise FileNotFoundError(2, "eval data file not found; pass --eval-data with a local .txt, .jsonl or .json file",
                                    ev["data"])
        sampler = data_sampler("--eval-data", ev["data"], tokenizer, run, cfg.seed)
        return cls(sampler, ev["every"], ev["batches"], run["steps"])

    def due(self, step: int) -> bool:
        return step == self.last_step or (self.every is not None and step % self.every == 0)

    @torch.no_grad()
    def loss(self, engine) -> float:
        engine.eval()
        try:
            total = 0.0
            for i in range(self.batches):
                ids, labels = self.sampler.batch(i)
                total += loss_of(engine(ids.to(engine.device), labels=labels.to(engine.device))).item()
            return total / self.batches
        finally:
            engine.train()


# --- checkpoints ---------------------------------------------------------------------------------------


def _identity(run: dict, cfg: Config) -> dict:
    """What fixes the batch sequence: a resumed run must have the same."""
    return {"model": run["model"], "data": run["data"], "batch_size": run["batch_size"], "seq_len": run["seq_len"],
            "seed": cfg.seed, "grad_accum": cfg.gradient_accumulation_steps, "lora": run.get("lora")}


class Checkpoints:
    """offload train's checkpoints: every `every` steps and at the last one, in `directory`, the newest
    `keep` kept. Each holds the data position (the next step: batch i depends only on (seed, i)), what
    fixes the batch sequence, and for a preset its Hugging Face config and names (for export)."""

    def __init__(self, directory: str, every: int, keep: int, steps: int, extra: dict):
        self.directory, self.every, self.keep, self.steps, self.extra = directory, every, keep, steps, extra

    @classmethod
    def from_args(cls, args, run: dict, cfg: Config, model, info: dict) -> "Checkpoints | None":
        for flag in ("save_every", "keep_checkpoints"):
            if getattr(args, flag) is not None and getattr(args, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')}={getattr(args, flag)}: must be a positive integer")
        if args.save_every is None:
            return None
        extra = {"train": {"run": _identity(run, cfg)}}
        if info["kind"] == "hf":  # export: the config as the directory had it, and its tokenizer files
            extra["hf_config"], extra["hf_source"] = info["hf_config"], info["source"]
        if info["kind"] == "preset":  # a LoRA run's export merges the adapters (offload.lora.merged_items)
            extra["hf_config"] = info["hf_config"]
            names = [base_name(n) for n, _ in model.named_parameters(remove_duplicate=False) if ".lora_" not in n]
            extra["hf_names"] = {n: hf_name(n) for n in names}
        if run.get("lora") is not None:  # export merges as --save-merged: weights stored [in, out] transposed
            extra["lora"] = {**run["lora"], "transposed": transposed_layers(model)}
        keep = DEFAULT_KEEP_CHECKPOINTS if args.keep_checkpoints is None else args.keep_checkpoints
        return cls(args.checkpoint_dir or DEFAULT_CHECKPOINT_DIR, args.save_every, keep, run["steps"], extra)

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.steps

    def save(self, engine, step: int) -> str:
        """Saves after `step`; a save that fails (a full disk) raises SaveFailed naming the path and step."""
        from offload.checkpoint.format import CheckpointError

        extra = {**self.extra, "train": {**self.extra["train"], "step": step}}
        name, again = f"step{step:08d}", 0
        while os.path.lexists(os.path.join(self.directory, name)):  # resumed from an earlier one: never overwrite
            again += 1
            name = f"step{step:08d}-{again}"
        try:
            return engine.save_checkpoint(self.directory, name=name, keep=self.keep, extra=extra)
        except (OSError, CheckpointError) as e:  # saves are atomic: the previous checkpoints are as they were
            raise SaveFailed(os.path.join(self.directory, name), step, e, self.last_good()) from e

    def last_good(self) -> str | None:
        from offload.checkpoint import format as fmt

        try:
            return fmt.resolve(self.directory) if os.path.isfile(os.path.join(self.directory, fmt.LATEST)) else None
        except (OSError, ValueError):
            return None


class SaveFailed(OSError):
    """A checkpoint `offload train` could not save (ENOSPC on --checkpoint-dir): training stops after that
    step, the report of the steps done is written, the last good checkpoint stays as it was; the CLI
    prints this one line and exits 2."""

    def __init__(self, path: str, step: int, cause: BaseException, last_good: str | None):
        super().__init__(getattr(cause, "errno", None) or errno.EIO, str(cause), path)
        self.path, self.step, self.cause, self.last_good = path, step, cause, last_good
        self.out_dir: str | None = None  # set once the report is written
        self.report: dict | None = None

    def __str__(self) -> str:
        resume = (f"the last good checkpoint is {self.last_good} (continue from it with --resume)"
                  if self.last_good else "no checkpoint was saved before it")
        report = f"; report in {self.out_dir}" if self.out_dir else ""
        return (f"saving the checkpoint {self.path} after step {self.step} failed ({self.cause}); training stopped "
                f"there and {resume}{report}; free space on --checkpoint-dir or point it elsewhere")


def _resume_point(args, run: dict, cfg: Config) -> tuple[str, int] | None:
    """(checkpoint path, the step to continue at) for --resume, checked against this run before anything
    is built; None without --resume, or for `latest` when the directory holds no checkpoint yet."""
    from offload.checkpoint import format as fmt

    if args.resume is None:
        return None
    path = args.resume
    if path == "latest":
        path = args.checkpoint_dir or DEFAULT_CHECKPOINT_DIR
        if not os.path.isfile(os.path.join(path, fmt.LATEST)):
            print(f"offload train: no checkpoint in {path} yet; starting at step 0", file=sys.stderr, flush=True)
            return None
    ckpt = fmt.resolve(path)
    position = fmt.read_manifest(ckpt)["extra"].get("train")
    if position is None:
        raise ValueError(f"--resume={args.resume}: {ckpt} was not saved by offload train (it has no data position); "
                         "load it with engine.load_checkpoint() in your own loop")
    ours = _identity(run, cfg)
    differ = [k for k in ours if position["run"].get(k) != ours[k]]
    if differ:
        raise ValueError(f"--resume={args.resume}: {ckpt} was trained with " + ", ".join(
            f"{k}={position['run'].get(k)!r}" for k in differ) + " (here " + ", ".join(f"{k}={ours[k]!r}" for k in differ)
            + "), so the batches would not continue its sequence; resume with the same settings")
    if position["step"] >= run["steps"]:
        raise ValueError(f"--steps={run['steps']}: {ckpt} is at step {position['step']}, nothing is left to train; "
                         "raise --steps")
    return ckpt, position["step"]


class _SaveOnSigterm:
    """With checkpoints on, SIGTERM (a preempted job) makes the loop save after the step it is in and stop."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.received = False

    def _handle(self, signum, frame) -> None:
        self.received = True

    def agreed(self, world: int) -> bool:
        """Whether to save and stop after this step. Over several ranks a SIGTERM may reach them during
        different steps (or reach one alone): the ranks agree, so they all save the same step together
        (a save is a collective) and stop, however many received it."""
        if not self.enabled or world == 1:
            return self.received
        return bool(reduced([float(self.received)], "max")[0])

    def __enter__(self) -> "_SaveOnSigterm":
        if self.enabled:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)


def save(engine, info: dict, directory: str, lora: dict | None = None, merged: bool = False,
         dtype: str = "auto") -> str:
    """Writes the trained weights as a HF directory (shards + index + config.json) in `--save-dtype dtype` and
    returns it; a LoRA run's adapter, or with `merged` its merged model ([Note: what a LoRA run saves] in
    offload.lora)."""
    from offload import lora as lo

    engine.flush()  # delayed_update: the last step's update is still pending
    if lora is not None and merged:
        return lo.save_merged(engine, info, lora, directory, save_dtype(info, dtype))
    if lora is not None:
        return lo.save_adapter(engine, engine.module, info, lora, directory, dtype)
    return lo.write_run_directory(engine, engine.state_items(), info, directory, save_dtype(info, dtype))
