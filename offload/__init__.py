"""offload: train PyTorch models whose weights and optimizer states live in hbm, dram or NVMe.

The public surface is small on purpose (see API.md): `initialize`, `Config`, `CPUAdam`,
`add_arguments`, `config_from_args`.
"""

__version__ = "0.1.0"

from offload.cpu_adam import CPUAdam  # noqa: E402
