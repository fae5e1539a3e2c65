"""The compiled CPU kernels: CPU Adam over offloaded fp32 states (with the host allocator, csrc/) and the
cache its library is built into and loaded from. Imports offload.swap only."""
