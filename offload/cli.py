"""The `offload` command line: one parser, one module per subcommand (offload/commands/)."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module defines register(subparsers); a subcommand sets `func(args) -> int` as its default.
_COMMAND_MODULES = (
    "offload.commands.nvme",
    "offload.commands.estimate",
    "offload.commands.train",
)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error and exit code 2 (argparse's own convention)."""

    def error(self, message: str) -> None:  # noqa: D401
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="offload", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    subparsers.required = True
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as e:  # user-facing errors: one line, exit code 2
        print(f"offload {args.command}: error: {e}", file=sys.stderr)
        return 2
