"""`offload train`: the main job (offload/train.py, its recipe in offload/recipe.py); with no flags, the `make
demo` run."""

from __future__ import annotations

import offload
from offload import recipe
from offload.signals import Stopped
from offload.train import train

# What `offload train --help` says about being stopped: the library itself handles no signal
# ([Note: signals] in offload/signals.py); this command does.
SIGNALS_HELP = (
    "signals: SIGTERM (what SLURM and Kubernetes send) and SIGINT (Ctrl-C) stop the run: with --save-every, "
    "SIGTERM first lets the current step end and saves a checkpoint (continue with --resume); then the engine "
    "closes, the partial report is written and the exit code is 128 + the signal (143 for SIGTERM, 130 for "
    "SIGINT). The swap data file has no name, so a run ended any other way (SIGKILL, the OOM killer) leaves no "
    "swap bytes; `offload clean` removes its run directory.")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="fine-tune a model with weights and optimizer states in GPU memory, host RAM or on NVMe",
        description=recipe.__doc__.split("\n\n", 1)[1].replace("[Note: precedence of settings]\n", ""),
        epilog=SIGNALS_HELP)
    recipe.add_train_arguments(p)
    offload.add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        train(args)
    except Stopped as stop:  # train() said so in one line and printed the partial report: no traceback
        return stop.exit_code
    return 0
