"""scheduler: when things move. Execution trace, prefetch plan, copy streams, overlap accounting.

Knows unit ids and byte sizes, not nn.Module; may import `swap`, never `offload`.
"""
