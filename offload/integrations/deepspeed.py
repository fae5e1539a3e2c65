"""DeepSpeed JSON configs read into our Config: `Config.from_deepspeed(path_or_dict)` and `--deepspeed PATH`."""

from __future__ import annotations

import pathlib
import typing
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from offload.plan.settings import CHUNK_ALIGN_BYTES, build, coerce_value, read_settings_file, set_dotted

# [Note: one table, one warning]
# Each DeepSpeed key we know is one row of KEYS: the Config key it sets (`To`, with a converter where the
# units differ), what we do instead (`Instead`: silent when the file asks for what we do anyway), or
# DERIVED: read by one of the three functions below the table, for the settings that need several keys at
# once (precision, the optimizer's kind, the lr schedule). Every key of the file that sets nothing here,
# known or not, is named in one warning, each with what we do instead: DeepSpeed ignores renamed keys
# silently (docs/design.md); we say so. A malformed file or a value of the wrong type is a ValueError naming the
# file and the key.
#
# [Note: "auto"]
# Hugging Face's Trainer writes "auto" where it fills a value from TrainingArguments. Here "auto" means
# not set: Config's default, or what the caller fills (`offload train`: its flags and recipe, and its step
# count for total_num_steps). An "auto" key is never named in the warning: nothing was asked of us.
# Sections DeepSpeed itself ignores are ignored too: fp16.* and bf16.* apply only when that precision is
# enabled (true or "auto").

AUTO = "auto"
SKIP = object()   # a converter's answer for "DeepSpeed's default, which is ours: nothing to set"


class DeepSpeedConfigWarning(UserWarning):
    """The keys of a DeepSpeed config that have no exact equivalent here, each with what we do instead."""


@dataclass(frozen=True)
class To:
    ours: str                                   # the Config key it sets
    convert: Callable[[Any], Any] | None = None  # DeepSpeed's value -> ours; may answer SKIP or an Instead
    note: str = ""                              # said whenever it is set: where the meaning differs a little


@dataclass(frozen=True)
class Instead:
    what: str                     # what we do instead
    ours: Any = SKIP              # a value that asks for what we do anyway: then nothing is said


DERIVED = Instead("")  # read by _precision, _optimizer or _schedule


def _number(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError("expected a number")
    return value


def _chunk_bytes(numel):
    # sub_group_size is DeepSpeed's grain of the NVMe optimizer step: a group of fp32 elements swapped in,
    # stepped and swapped out together. Ours is chunk_bytes of fp32, so elements x 4 bytes, rounded up to
    # the chunk alignment (chunks start where parameters may start).
    if _number(numel) <= 0:
        return Instead("chunk_bytes keeps its default (32 MiB)")
    return -(-int(numel) * 4 // CHUNK_ALIGN_BYTES) * CHUNK_ALIGN_BYTES


POOL = "the staging pool is counted from the placement in chunks of chunk_bytes (docs/design.md 'Chunks and budgets')"
PINNED = "host staging buffers are pinned whenever CUDA is present"
RANKS = "over several ranks each unit's gradient windows are reduced as its backward ends (docs/zero.md); nothing is bucketed"
BATCH = ("not a Config setting (the batch is your data loader's); `offload train` takes "
         "train_micro_batch_size_per_gpu as its --batch-size")
Z, PARAM, OPT = "zero_optimization.", "zero_optimization.offload_param.", "zero_optimization.offload_optimizer."

# DeepSpeed key -> row, applied in this order (a later key setting the same Config key wins, and says so).
KEYS: dict[str, To | Instead] = {
    Z + "stage": To("zero_stage"),
    Z + "cpu_offload": To("offload_optimizer.device", lambda on: "cpu" if on else SKIP),    # deprecated names
    Z + "cpu_offload_param": To("offload_param.device", lambda on: "cpu" if on else SKIP),
    Z + "cpu_offload_use_pin_memory": Instead(PINNED, ours=True),
    PARAM + "device": To("offload_param.device"),
    PARAM + "nvme_path": To("nvme_path"),
    PARAM + "pin_memory": Instead(PINNED, ours=True),
    PARAM + "buffer_count": Instead(POOL),
    PARAM + "buffer_size": Instead(POOL),
    PARAM + "max_in_cpu": Instead("which units' weights live in dram and which on nvme follows budgets.dram_bytes"),
    OPT + "device": To("offload_optimizer.device"),
    OPT + "nvme_path": To("nvme_path"),
    OPT + "pin_memory": Instead(PINNED, ours=True),
    OPT + "buffer_count": Instead(POOL),
    OPT + "pipeline_read": Instead("optimizer states are always read ahead of the CPU Adam step", ours=True),
    OPT + "pipeline_write": Instead("optimizer states are always written behind the CPU Adam step", ours=True),
    OPT + "fast_init": Instead("optimizer states are initialized chunk by chunk straight into their tier", ours=False),
    OPT + "ratio": Instead("the whole optimizer step runs on the CPU", ours=1),
    Z + "sub_group_size": To("chunk_bytes", _chunk_bytes),
    Z + "stage3_prefetch_bucket_size": To("prefetch_units", lambda n: 0 if _number(n) == 0 else Instead(
        "prefetch_units (default 2) units are fetched ahead along the recorded trace: a count of units, not elements")),
    Z + "stage3_max_live_parameters": Instead(
        "hbm holds 1 + prefetch_units + reuse_distance units at once, within budgets.hbm_bytes"),
    Z + "stage3_max_reuse_distance": Instead(
        "a unit stays in hbm when used again within reuse_distance fetches (default 1) or within reuse_bytes"),
    Z + "stage3_param_persistence_threshold": To(
        "units.min_numel", lambda n: max(1, int(_number(n))),
        "subtrees smaller than this stay resident in hbm as one unit; container elements are always units"),
    Z + "stage3_model_persistence_threshold": Instead("what stays resident follows units.min_numel"),
    Z + "stage3_gather_16bit_weights_on_model_save": Instead(
        "engine.full_state_dict() and `offload train --save` always gather the full weights", ours=True),
    Z + "gather_16bit_weights_on_model_save": Instead(
        "engine.full_state_dict() and `offload train --save` always gather the full weights", ours=True),
    Z + "overlap_comm": Instead("transfers always overlap compute", ours=True),
    Z + "contiguous_gradients": Instead("gradients always land in one flat buffer per unit", ours=True),
    Z + "reduce_bucket_size": Instead(RANKS),
    Z + "allgather_bucket_size": Instead(RANKS),
    Z + "reduce_scatter": Instead(RANKS, ours=True),
    Z + "allgather_partitions": Instead(RANKS, ours=True),
    Z + "round_robin_gradients": Instead(RANKS, ours=False),
    Z + "aio": Instead("DeepSpeed reads aio at the top level, not inside zero_optimization; ignored"),
    "aio.block_size": To("aio.block_bytes"),
    "aio.queue_depth": To("aio.queue_depth"),
    "aio.thread_count": Instead("the libaio engine keeps queue_depth requests in flight from one thread; "
                                "aio.threads (default 4) sizes the engine used without libaio"),
    "aio.intra_op_parallelism": Instead("the libaio engine keeps queue_depth requests in flight from one thread; "
                                        "aio.threads (default 4) sizes the engine used without libaio"),
    "aio.single_submit": Instead("requests are batched into io_submit calls", ours=False),
    "aio.overlap_events": Instead("completions are reaped while new requests are submitted", ours=True),
    "aio.use_gds": Instead("no GPUDirect Storage: NVMe data passes through host staging buffers", ours=False),
    "bf16.enabled": DERIVED,
    "fp16.enabled": DERIVED,
    "fp16.initial_scale_power": To("loss_scale.initial", lambda p: 2.0 ** _number(p)),
    "fp16.loss_scale": To("loss_scale.initial", lambda s: SKIP if _number(s) == 0 else s,
                          "a static scale: we scale dynamically from it (halved on overflow, doubled after "
                          "loss_scale_window steps without)"),
    "fp16.loss_scale_window": To("loss_scale.growth_interval"),
    "fp16.min_loss_scale": To("loss_scale.min_scale"),
    "fp16.hysteresis": Instead("the scale halves at every overflow (hysteresis 1)", ours=1),
    "fp16.consecutive_hysteresis": Instead("the scale halves at every overflow (hysteresis 1)", ours=False),
    "fp16.auto_cast": Instead("floating inputs are always cast to the compute dtype", ours=True),
    "optimizer.type": DERIVED,
    "optimizer.params.adam_w_mode": DERIVED,
    "optimizer.params.lr": To("optimizer.lr"),
    "optimizer.params.betas": To("optimizer.betas"),
    "optimizer.params.eps": To("optimizer.eps"),
    "optimizer.params.weight_decay": To("optimizer.weight_decay"),
    "optimizer.params.bias_correction": Instead("Adam's bias correction is always on", ours=True),
    "optimizer.params.amsgrad": Instead("Adam without AMSGrad", ours=False),
    "optimizer.params.torch_adam": Instead("the optimizer is always our own Adam", ours=False),
    "optimizer.params.fp32_optimizer_states": Instead("optimizer states are always fp32", ours=True),
    "scheduler.type": DERIVED,
    **{f"scheduler.params.{name}": DERIVED for name in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                                                         "warmup_type", "total_num_steps", "warmup_min_ratio",
                                                         "cos_min_ratio")},
    "gradient_accumulation_steps": To("gradient_accumulation_steps"),
    "gradient_clipping": To("gradient_clipping"),
    "train_micro_batch_size_per_gpu": Instead(BATCH),
    "train_batch_size": Instead(BATCH + " (train_batch_size = micro batch x gradient_accumulation_steps x ranks)"),
    "steps_per_print": Instead("`offload train` shows every step in its progress bar; engine.stats() any time"),
    "wall_clock_breakdown": Instead("engine.stats() and `offload train --trace` time every phase", ours=False),
    "zero_allow_untested_optimizer": Instead("the optimizer is always our own Adam"),
    "activation_checkpointing": Instead("this section sets up deepspeed.checkpointing, which a model calls itself; "
                                        "the engine checkpoints every unit's forward with our activation_checkpointing: "
                                        "true (--activation-checkpointing)"),
}
SECTIONS = {"zero_optimization", PARAM[:-1], OPT[:-1], "aio", "bf16", "fp16", "optimizer", "optimizer.params",
            "scheduler", "scheduler.params"}
ALIASES = {"bfloat16": "bf16"}  # DeepSpeed's older name
UNKNOWN = "no equivalent here; ignored"


# --- reading ------------------------------------------------------------------------------------------


def read(path_or_dict) -> tuple[dict, str]:
    """(the DeepSpeed config as a dict, its name for messages) from a path or a dict."""
    if isinstance(path_or_dict, dict):
        return path_or_dict, "DeepSpeed config"
    path = pathlib.Path(path_or_dict)
    return read_settings_file(path, flag="deepspeed"), str(path)


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    """{"zero_optimization.offload_param.device": "nvme", ...}: the known sections opened, any other value a leaf."""
    out = {}
    for key, value in data.items():
        path = ALIASES.get(f"{prefix}{key}", f"{prefix}{key}")
        if path in SECTIONS:
            if not isinstance(value, dict):
                raise ValueError(f"{path}={value!r}: expected an object ({{...}}); see DeepSpeed's config reference")
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def micro_batch_size(path_or_dict) -> int | None:
    """train_micro_batch_size_per_gpu of a DeepSpeed config (None when absent or "auto")."""
    data, source = read(path_or_dict)
    value = data.get("train_micro_batch_size_per_gpu")
    if value in (None, AUTO):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{source}: train_micro_batch_size_per_gpu={value!r}: expected a positive integer")
    return value


# --- converting ---------------------------------------------------------------------------------------


class _Result:
    """Our settings as flat Config keys, where each came from, and the notes for the warning."""

    def __init__(self):
        self.values: dict[str, Any] = {}
        self.origin: dict[str, str] = {}
        self.notes: list[str] = []

    def put(self, ours: str, value, key: str) -> None:
        if ours in self.values and self.values[ours] != value:
            self.note(key, f"sets {ours} to {value!r} over {self.origin[ours]}'s {self.values[ours]!r}")
        self.values[ours], self.origin[ours] = value, key

    def note(self, key: str, what: str) -> None:
        self.notes.append(f"{key}: {what}")

    def nested(self) -> dict:
        data: dict = {}
        for ours, value in self.values.items():
            set_dotted(data, ours, value)
        return data


def _hint(ours: str, schema: type):
    cls = schema
    *sections, name = ours.split(".")
    for section in sections:
        cls = typing.get_type_hints(cls)[section]
    return typing.get_type_hints(cls)[name]


def _apply(key: str, row, value, res: _Result, schema: type) -> None:
    if isinstance(row, To):
        try:
            converted = row.convert(value) if row.convert else value
        except (TypeError, ValueError) as e:
            raise ValueError(f"{key}={value!r}: {e}") from None
        if isinstance(converted, Instead):
            res.note(key, f"{value!r}: {converted.what}")
        elif converted is not SKIP:
            res.put(row.ours, coerce_value(_hint(row.ours, schema), converted, key), key)
            if row.note:
                res.note(key, row.note)
    elif row is not DERIVED and (row.ours is SKIP or value != row.ours):
        res.note(key, f"{value!r}: {row.what}")


def convert(ds: dict, schema: type, total_steps: int | None = None) -> _Result:
    """Our settings from a DeepSpeed config dict (see the notes at the top). total_steps fills an "auto"
    total_num_steps; without it such a decay is left out, and said."""
    flat = _flatten(ds)
    for precision in ("bf16", "fp16"):  # DeepSpeed reads a precision's section only when it is enabled
        if flat.get(f"{precision}.enabled", False) is False:
            flat = {k: v for k, v in flat.items() if not k.startswith(precision + ".") or k.endswith(".enabled")}
    res = _Result()
    for key, row in KEYS.items():
        if key in flat and flat[key] != AUTO:
            _apply(key, row, flat[key], res, schema)
    for key, value in flat.items():
        if key not in KEYS and value != AUTO and not key.startswith("scheduler.params."):
            res.note(key, UNKNOWN)
    _precision(flat, res)
    _optimizer(flat, res)
    _schedule(flat, res, total_steps)
    if res.values.get("offload_param.device") in ("cpu", "nvme") and "offload_optimizer.device" not in res.values:
        res.put("offload_optimizer.device", "cpu", "zero_optimization.offload_optimizer")  # as --offload-param does
        res.note("zero_optimization.offload_optimizer", "not set while the weights are offloaded: the optimizer "
                 "states go to cpu (as --offload-param alone does; offload_optimizer none keeps a small trained set's "
                 "states, a LoRA adapter's, in hbm)")
    return res


def _precision(flat: dict, res: _Result) -> None:
    on = {p: flat.get(f"{p}.enabled", False) for p in ("bf16", "fp16")}
    for p, v in on.items():
        if not isinstance(v, bool) and v != AUTO:
            raise ValueError(f'{p}.enabled={v!r}: expected true, false or "auto"')
    if on["bf16"] is True and on["fp16"] is True:
        raise ValueError("bf16.enabled and fp16.enabled are both true: enable one")
    if True in on.values():
        p = "bf16" if on["bf16"] is True else "fp16"
        res.put("precision", p, f"{p}.enabled")
    elif AUTO not in on.values():  # DeepSpeed trains in fp32 unless fp16 or bf16 is enabled
        res.put("precision", "fp32", "bf16.enabled")


def _optimizer(flat: dict, res: _Result) -> None:
    kind = flat.get("optimizer.type")
    if kind in (None, AUTO):
        return
    if not isinstance(kind, str) or kind.lower() not in ("adam", "adamw"):
        raise ValueError(f"optimizer.type={kind!r}: not supported here (the step is our CPU Adam); "
                         'use "AdamW" or "Adam", or leave the optimizer section out')
    w_mode = flat.get("optimizer.params.adam_w_mode", True)
    if not isinstance(w_mode, bool):
        raise ValueError(f"optimizer.params.adam_w_mode={w_mode!r}: expected true or false")
    # DeepSpeed's "Adam" decouples weight decay (AdamW) unless params.adam_w_mode is false; "AdamW" always does.
    res.put("optimizer.type", "adamw" if kind.lower() == "adamw" or w_mode else "adam", "optimizer.type")


# scheduler type -> (our lr_schedule.type, its parameters)
SCHEDULES = {
    "WarmupLR": ("constant", {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"}),
    "WarmupDecayLR": ("linear", {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"}),
    "WarmupCosineLR": ("cosine", {"warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type", "total_num_steps"}),
}


def _schedule(flat: dict, res: _Result, total_steps: int | None) -> None:
    params = {k[len("scheduler.params."):]: v for k, v in flat.items() if k.startswith("scheduler.params.")}
    kind = flat.get("scheduler.type")
    if kind is None and not params:
        return
    if kind not in SCHEDULES:
        why = "missing" if kind is None else "not supported here"
        raise ValueError(f"scheduler.type={kind!r}: {why}; use one of {', '.join(SCHEDULES)} "
                         "or leave the scheduler section out (lr_schedule decides)")
    ours, known = SCHEDULES[kind]
    for name in sorted(set(params) - known):
        if params[name] != AUTO:
            res.note(f"scheduler.params.{name}", f"not a parameter of {kind}; ignored")
    p = {**SCHEDULER_DEFAULTS, **({"warmup_max_lr": 1e-3} if kind == "WarmupDecayLR" else {}), **params,
         "given": set(params)}
    res.put("lr_schedule.type", ours, "scheduler.type")
    _set(res, p, "lr_schedule.warmup_steps", "warmup_num_steps")
    if p["warmup_type"] != "linear":
        given = f"{p['warmup_type']!r}" if "warmup_type" in params else "not set (DeepSpeed's default 'log')"
        res.note("scheduler.params.warmup_type", f"{given}: we warm up linearly, from lr/warmup_steps at the first step")
    _lr_range(kind, p, res)
    if ours == "constant":
        return
    if p["total_num_steps"] is None:
        raise ValueError(f"scheduler.params.total_num_steps: {kind} needs it; give the number of optimizer steps")
    if p["total_num_steps"] != AUTO:
        _set(res, p, "lr_schedule.total_steps", "total_num_steps")
    elif total_steps:
        res.put("lr_schedule.total_steps", total_steps, "scheduler.params.total_num_steps")
    else:
        res.values["lr_schedule.type"] = "constant"
        res.note("scheduler.params.total_num_steps", '"auto" and no run length here to fill it: constant lr '
                 "after the warmup; give the number of optimizer steps")


SCHEDULER_DEFAULTS = {"warmup_num_steps": 1000, "warmup_type": "log", "warmup_min_lr": 0.0, "warmup_max_lr": None,
                      "warmup_min_ratio": 0.0, "cos_min_ratio": 1e-4, "total_num_steps": None}  # DeepSpeed's


def _set(res: _Result, p: dict, ours: str, name: str) -> None:
    if p[name] not in (None, AUTO):
        res.put(ours, p[name], f"scheduler.params.{name}" + ("" if name in p["given"] else " (DeepSpeed's default)"))


def _lr_range(kind: str, p: dict, res: _Result) -> None:
    """The peak lr and where the decay ends: WarmupLR and WarmupDecayLR give lrs, WarmupCosineLR ratios."""
    if kind == "WarmupCosineLR":
        _set(res, p, "lr_schedule.min_ratio", "cos_min_ratio")
        if p["warmup_min_ratio"] not in (0, AUTO):
            res.note("scheduler.params.warmup_min_ratio", f"{p['warmup_min_ratio']!r}: our warmup starts from 0")
        return
    _set(res, p, "optimizer.lr", "warmup_max_lr")  # DeepSpeed's scheduler sets the peak over the optimizer's lr
    if p["warmup_min_lr"] in (0, AUTO):
        return
    decays = kind == "WarmupDecayLR"
    res.note("scheduler.params.warmup_min_lr", f"{p['warmup_min_lr']!r}: our warmup starts from 0"
             + (", and the decay ends at it (lr_schedule.min_ratio)" if decays else ""))
    if decays and p["warmup_max_lr"] != AUTO:
        try:
            ratio = _number(p["warmup_min_lr"]) / _number(p["warmup_max_lr"])
        except (TypeError, ZeroDivisionError):
            raise ValueError(f"scheduler.params.warmup_min_lr={p['warmup_min_lr']!r}, warmup_max_lr="
                             f"{p['warmup_max_lr']!r}: expected numbers, warmup_max_lr > 0") from None
        res.put("lr_schedule.min_ratio", ratio, "scheduler.params.warmup_min_lr")


# --- the entry points ---------------------------------------------------------------------------------


def settings(path_or_dict, schema: type, total_steps: int | None = None) -> dict:
    """Our config data (nested, only what the file sets) from a DeepSpeed config; warns once (see top)."""
    ds, source = read(path_or_dict)
    return _settings(ds, source, schema, total_steps)[0]


def _settings(ds: dict, source: str, schema: type, total_steps: int | None) -> tuple[dict, dict]:
    try:
        res = convert(ds, schema, total_steps)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    if res.notes:
        warnings.warn(f"{source}: {len(res.notes)} DeepSpeed setting(s) without an exact equivalent here "
                      "(docs/deepspeed.md):\n" + "\n".join(f"  {n}" for n in res.notes),
                      DeepSpeedConfigWarning, stacklevel=4)
    return res.nested(), res.origin


def to_config(path_or_dict, schema: type):
    """Config.from_deepspeed: the `schema` (offload.plan.config's Config, which calls this: the reader imports
    only offload.plan.settings) of a DeepSpeed config; a bad value names the DeepSpeed key."""
    ds, source = read(path_or_dict)
    data, origin = _settings(ds, source, schema, None)
    try:
        return build(schema, data, "")
    except ValueError as e:
        key = next((k for ours, k in origin.items() if str(e).startswith(ours)), None)
        raise ValueError(f"{source}: {e}" + (f" (from DeepSpeed's {key})" if key else "")) from None

