"""swap: how bytes reach NVMe. Aligned host buffers and pools, the swap store, I/O engines.

Knows keys and bytes, never parameters; imports neither `scheduler` nor `offload`.
"""
