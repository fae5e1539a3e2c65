"""The offload flags of a training script: `add_arguments(parser)` adds them, `config_from_args(args)` reads
them into a Config, with --deepspeed (offload/integrations/deepspeed.py) and --offload-config below them."""

from __future__ import annotations

import argparse
import copy
import pathlib

from offload.integrations import deepspeed
from offload.plan.config import DEVICES, MASTER_CHOICES, PRECISION_CHOICES, STATE_CHOICES, Config, load_config
from offload.plan.settings import read_settings_file, set_dotted
from offload.swap.measure import parse_size

FLAG_KEYS = ("nvme_path", "zero_stage", "precision", "delayed_update",  # top-level keys set by add_arguments' flags
             "activation_checkpointing")
FLAG_PATHS = {"hbm": "budgets.hbm_bytes", "dram": "budgets.dram_bytes",  # flag dest -> the nested key it sets
              "offload_activations": "offload_activations.device", "optimizer_states": "optimizer.states",
              "master": "optimizer.master"}


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the offload flags to an existing training script's parser."""
    g = parser.add_argument_group("offload")
    g.add_argument("--offload-param", choices=DEVICES, default=None, help="where weights live between uses")
    g.add_argument("--offload-optimizer", choices=DEVICES, default=None, help="where fp32 optimizer states live")
    g.add_argument("--nvme-path", default=None, type=_swap_dirs, metavar="DIR[,DIR...]",
                   help="directory for swap files (needed for nvme); several, comma-separated (one per drive): "
                        "each rank of a node takes its turn")
    g.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None, help="ZeRO partitioning stage")
    g.add_argument("--precision", choices=PRECISION_CHOICES, default=None,
                   help="compute dtype (default auto: bf16 where the device runs it natively, fp16 on an older GPU, "
                        "fp32 on other CPUs)")
    g.add_argument("--delayed-update", action="store_true", default=None,
                   help="one-step delayed parameter update (the step overlaps the next backward; weights lag one step)")
    g.add_argument("--hbm", type=size_arg, default=None, metavar="SIZE",
                   help="accelerator memory budget, e.g. 2.5G (budgets.hbm_bytes; host memory on a CPU-only machine; "
                        "default: derived from the free memory)")
    g.add_argument("--dram", type=size_arg, default=None, metavar="SIZE",
                   help="host memory budget, e.g. 8G (budgets.dram_bytes; default: derived from the available RAM)")
    g.add_argument("--activation-checkpointing", action="store_true", default=None,
                   help="the engine checkpoints each unit's forward (a transformer block): keeps the unit's input, "
                        "runs its forward again in its backward; activations then take a block's input per layer "
                        "instead of everything a block computes, for about a third more compute (presets and "
                        "Hugging Face models alike; docs/python.md)")
    g.add_argument("--offload-activations", choices=DEVICES, default=None,
                   help="where the inputs the checkpoints keep wait for their backward (needs "
                        "--activation-checkpointing): none (hbm), cpu (dram) or nvme; they leave hbm as the forward "
                        "makes them and come back ahead of the backward, for a copy each way (docs/training.md)")
    g.add_argument("--optimizer-states", choices=STATE_CHOICES, default=None,
                   help="Adam's moments: fp32 (default) or int8, blockwise 8-bit codes with a fp32 scale per 256 "
                        "(half the optimizer bytes a step moves; docs/training.md)")
    g.add_argument("--master", "--optimizer-master", choices=MASTER_CHOICES, default=None, dest="master",
                   help="the master weights: fp32 (default) or split (precision bf16: the bf16 weight plus a "
                        "record of 2 + 1/8 bytes, bit for bit the fp32 master's training; docs/training.md); "
                        "under torchrun spell it --optimizer-master (torchrun takes --master as its --master-addr)")
    g.add_argument("--offload-config", default=None, metavar="PATH", help="a .json/.yaml config; flags override it")
    g.add_argument("--deepspeed", default=None, metavar="PATH",
                   help="a DeepSpeed JSON config, read into ours (docs/deepspeed.md); "
                        "--offload-config and flags override it")
    return parser


def file_settings(args: argparse.Namespace, total_steps: int | None = None) -> dict:
    """The config data of --deepspeed with --offload-config's laid over it, section by section (a new dict).
    total_steps fills a DeepSpeed "auto" total_num_steps (see offload/integrations/deepspeed.py)."""
    data = {}
    if getattr(args, "deepspeed", None):
        data = deepspeed.settings(args.deepspeed, Config, total_steps)
    if getattr(args, "offload_config", None):
        data = _merge(data, read_settings_file(pathlib.Path(args.offload_config)))
    return data


def _merge(base: dict, over: dict) -> dict:
    """`over` laid over `base` section by section (a new dict; neither is changed)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else copy.deepcopy(value)
    return out


def size_arg(text: str) -> int:
    """A size flag: "2.5G", "512M", "64K" or a byte count (binary units), more than 0 bytes."""
    try:
        nbytes = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 2.5G, 512M or a byte count") from None
    if nbytes <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0 bytes; write e.g. 2.5G or 512M")
    return nbytes


def put_flags(args: argparse.Namespace, data: dict) -> dict:
    """The config keys the explicit flags of FLAG_KEYS and FLAG_PATHS set, laid over `data` (in place)."""
    for key in FLAG_KEYS:
        if getattr(args, key, None) is not None:
            data[key] = getattr(args, key)
    for dest, path in FLAG_PATHS.items():
        if getattr(args, dest, None) is not None:
            set_dotted(data, path, getattr(args, dest))
    return data


def _swap_dirs(text: str) -> str | list[str]:
    """--nvme-path: one directory, or several comma-separated (a list)."""
    paths = [p for p in text.split(",") if p]
    return paths[0] if len(paths) == 1 else paths


def config_from_args(args: argparse.Namespace) -> Config:
    """The Config from --deepspeed and --offload-config (if any) with the explicit flags laid over them.

    Precedence: explicit flags, then --offload-config, then --deepspeed, then Config's defaults."""
    data = file_settings(args)
    if getattr(args, "offload_param", None):
        data.setdefault("offload_param", {})["device"] = args.offload_param
    if getattr(args, "offload_optimizer", None):
        data.setdefault("offload_optimizer", {})["device"] = args.offload_optimizer
    put_flags(args, data)
    if "nvme" in (data.get("offload_param", {}).get("device"), data.get("offload_optimizer", {}).get("device")):
        data.setdefault("offload_optimizer", {}).setdefault("device", "cpu")
    if data.get("offload_param", {}).get("device") in ("cpu", "nvme"):
        data.setdefault("offload_optimizer", {}).setdefault("device", "cpu")
    return load_config(data)
