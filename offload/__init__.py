"""offload: train PyTorch models whose weights and optimizer states live in hbm, dram or NVMe.

The public surface is small on purpose (see API.md): `initialize`, `Config`, `CPUAdam`,
`add_arguments`, `config_from_args`.
"""

from offload.config import Config, add_arguments, config_from_args, load_config

__version__ = "0.1.0"


def initialize(model, config=None):
    """Wraps `model` in an Engine that trains it with the placement `config` asks for.

    config: an offload.Config, a dict, or the path of a .json / .yaml file (see README, "Config").
    """
    from offload.engine import Engine

    return Engine(model, config)


__all__ = ["Config", "add_arguments", "config_from_args", "initialize", "load_config"]
