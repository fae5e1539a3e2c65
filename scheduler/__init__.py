"""scheduler: when things move. Execution trace, prefetch plan, copy streams, overlap accounting.

Installed as offload.scheduler. Knows unit ids and byte sizes, not nn.Module; may import offload.swap,
nothing else of offload.
"""
