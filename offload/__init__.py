"""offload: train PyTorch models whose weights and optimizer states live in hbm, dram or NVMe.

The public surface is small on purpose (see API.md): `initialize`, `Config`, `CPUAdam`,
`add_arguments`, `config_from_args`, and `stop_on_signals` / `Stopped` (docs/failures.md).
"""

from offload.flags import add_arguments, config_from_args
from offload.kernels.cpu_adam import CPUAdam
from offload.plan.config import Config, load_config
from offload.signals import Stopped, stop_on_signals

__version__ = "0.1.0"


def initialize(model, config=None, weights=None):
    """Wraps `model` in an Engine that trains it with the placement `config` asks for.

    config: an offload.Config, a dict, or the path of a .json / .yaml file (see docs/config.md).
    weights: optional callable `name -> tensor` giving each parameter's initial value (for example
    streamed from a safetensors directory); with a model built on the meta device, the model is
    then never materialized whole. Once the values are placed the engine lets it go, calling its close()
    if it has one (offload.integrations.hf_io.SafetensorsWeights unmaps its files).
    """
    from offload.engine import Engine

    return Engine(model, config, weights)


__all__ = ["CPUAdam", "Config", "Stopped", "add_arguments", "config_from_args", "initialize", "load_config",
           "stop_on_signals"]
