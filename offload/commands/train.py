"""`offload train`: the main job (offload/train.py); with no flags, the `make demo` run."""

from __future__ import annotations

import offload
from offload import train as recipe
from offload.signals import Stopped


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="fine-tune a model with weights and optimizer states in GPU memory, host RAM or on NVMe",
        description=recipe.__doc__.split("\n\n", 1)[1].replace("[Note: precedence of settings]\n", ""))
    recipe.add_train_arguments(p)
    offload.add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        recipe.train(args)
    except Stopped as stop:  # train() said so in one line and printed the partial report: no traceback
        return stop.exit_code
    return 0
