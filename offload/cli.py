"""The `offload` command line: one parser, one module per subcommand (offload/commands/)."""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from offload import __version__

# Each module defines register(subparsers); a subcommand sets `func(args) -> int` as its default.
_COMMAND_MODULES = (
    "offload.commands.nvme",
    "offload.commands.estimate",
    "offload.commands.train",
    "offload.commands.generate",
    "offload.commands.checkpoint",
    "offload.commands.doctor",
)

# What `offload --help` says: for users, so no internals (the docstring above is for developers).
DESCRIPTION = """\
Train PyTorch models larger than your GPU: weights and optimizer states live
in GPU memory, host RAM or files on an NVMe drive, and move as training needs
them. `offload train` with no flags fine-tunes a small model for a few minutes;
`offload COMMAND --help` describes each command."""
EXAMPLES = """\
examples:
  offload train                                 fine-tune the small preset
  offload train --model ./my-llama --deepspeed ds_config.json --steps 100
  offload estimate --params 7e9 --offload-optimizer nvme
  offload bench nvme --dir /mnt/nvme --size 4G  how fast the drive swaps
  offload train --save-every 50 --resume        checkpoints, continued after a crash
  offload checkpoint export checkpoints ./hf    the latest checkpoint as a HF directory
  offload generate --model ./hf --prompt "Hi" --offload-param nvme   complete prompts, weights on NVMe
  offload doctor                                what this host runs fast, and what to fix"""


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error and exit code 2 (argparse's own convention)."""

    def error(self, message: str) -> None:  # noqa: D401
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="offload", description=DESCRIPTION, epilog=EXAMPLES,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    subparsers.required = True
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


_format_warning = warnings.formatwarning


def _user_warning(message, category, filename, lineno, line=None) -> str:
    """A DeepSpeed config's or a data file's warning reads as a message to the user, not as a source location."""
    from offload.data import DataWarning
    from offload.integrations.deepspeed import DeepSpeedConfigWarning

    if issubclass(category, (DeepSpeedConfigWarning, DataWarning)):
        return f"offload: warning: {message}\n"
    return _format_warning(message, category, filename, lineno, line)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.formatwarning = _user_warning
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as e:  # user-facing errors: one line, exit code 2
        print(f"offload {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # `python -m offload.cli ...` (also under torchrun), as `python -m offload ...`
    raise SystemExit(main())
