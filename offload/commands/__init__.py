"""Subcommands of the `offload` CLI; each module has `register(subparsers)`."""
