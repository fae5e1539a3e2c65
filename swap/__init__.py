"""swap: how bytes reach NVMe. Aligned host buffers and pools, the swap store, I/O backends, and the host
memory this process may use (hostmem).

Installed as offload.swap. Knows keys and bytes, never parameters; imports nothing else of offload.
"""

from .backends import Block, IOBackend, LibaioBackend, ThreadsBackend, libaio_available, open_backend
from .buffers import ALIGN_BYTES, BufferPool, PoolExhaustedError, aligned_empty, round_up
from .errors import SwapCorruptionError, SwapIOError
from .rundir import RunDir, clean, list_runs, remove_run_dirs
from .store import SwapStore
from .transfer import Ticket

__all__ = [
    "ALIGN_BYTES", "Block", "BufferPool", "IOBackend", "LibaioBackend", "PoolExhaustedError", "RunDir",
    "SwapCorruptionError", "SwapIOError", "SwapStore", "ThreadsBackend", "Ticket", "aligned_empty",
    "clean", "libaio_available", "list_runs", "open_backend", "remove_run_dirs", "round_up",
]
