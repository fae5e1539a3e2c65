"""What the Hugging Face integrations share: the user's offload config as the keys it sets, and the keys
the host framework owns (Trainer's TrainingArguments, the Accelerator) laid over it.

[Note: who owns a setting]
Under Trainer or Accelerate, the learning rate, Adam's hyperparameters, gradient accumulation, clipping
and precision are already set where the user set them (TrainingArguments, the Accelerator); the offload
config says where states live. A key set in both with different values is an error naming both (as
Hugging Face's DeepSpeed integration does), never a silent choice; a key set in one only is taken. So
we need to know which keys a config *sets*: a dict or a file says so itself; a Config object is read as
its values that differ from the defaults; a DeepSpeed config as DeepSpeed's own rules ("auto" = not set).
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

from offload.plan.config import Config, LRScheduleConfig, load_config
from offload.plan.settings import read_settings_file, set_dotted

# Top-level keys only a DeepSpeed config has: such a mapping is read as one (offload/integrations/deepspeed.py).
DEEPSPEED_KEYS = {"zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size", "bf16", "fp16",
                  "scheduler", "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer"}


def settings(offload_config) -> dict:
    """The keys `offload_config` sets, nested (a new dict). offload_config: None, a Config, a dict, the path
    of a .json/.yaml file of ours, or a DeepSpeed JSON config (a dict or a path)."""
    if offload_config is None:
        return {}
    if isinstance(offload_config, Config):
        return _changed(offload_config.to_dict(), Config().to_dict())
    if isinstance(offload_config, (str, pathlib.Path)):
        data = read_settings_file(pathlib.Path(offload_config), flag="offload_config")
    elif isinstance(offload_config, dict):
        data = offload_config
    else:
        raise ValueError(f"offload_config={offload_config!r}: expected an offload.Config, a dict or the path of a "
                         ".json/.yaml file (ours or DeepSpeed's)")
    if DEEPSPEED_KEYS & data.keys():
        from offload.integrations import deepspeed

        return deepspeed.settings(offload_config, Config)
    load_config(data)  # a wrong key or value is named now, before anything is merged
    return _copy(data)


def _copy(data: dict) -> dict:
    return {k: _copy(v) if isinstance(v, dict) else v for k, v in data.items()}


def _changed(values: dict, defaults: dict) -> dict:
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            sub = _changed(value, defaults[key])
            if sub:
                out[key] = sub
        elif value != defaults[key]:
            out[key] = value
    return out


def _get(data: dict, path: str, missing=None):
    for part in path.split("."):
        if not isinstance(data, dict) or part not in data:
            return missing
        data = data[part]
    return data


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return tuple(a) == tuple(b)  # betas: a JSON list, a tuple here
    return a == b


def with_owned(data: dict, owned: dict[str, tuple[Any, str]], owner: str, lr_from: str) -> Config:
    """The Config of `data` with the keys `owner` sets laid in. owned: {dotted Config key: (value, where the
    owner sets it)}. A key `data` sets to another value is a ValueError naming both (module note). The lr
    is driven from outside (Engine.lr, set from `lr_from`), so an lr_schedule would be ignored: refused."""
    data = _copy(data)
    default = dataclasses.asdict(LRScheduleConfig())
    schedule = {k: v for k, v in (_get(data, "lr_schedule") or {}).items() if not _same(v, default.get(k))}
    if schedule:
        raise ValueError(f"offload_config: lr_schedule={schedule!r}: the learning rate follows {lr_from}; "
                         "remove lr_schedule from the offload config and set the schedule there")
    conflicts = []
    for key, (value, where) in owned.items():
        mine = _get(data, key, missing=dataclasses.MISSING)
        if mine is not dataclasses.MISSING and not _same(mine, value):
            conflicts.append(f"{key}={mine!r} but {where} (the {owner} owns it)")
        set_dotted(data, key, value)
    if conflicts:
        raise ValueError(f"offload_config: {'; '.join(conflicts)}; remove these keys from the offload config "
                         f"or make them equal")
    return load_config(data)
