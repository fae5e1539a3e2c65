"""Host memory as the kernel sees it (tests/test_swap_buffers.py, tests/test_engine.py): which pages of a
tensor are resident."""

import ctypes

import torch

from offload.swap import ALIGN_BYTES


def resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(resident, total) pages under t, from mincore(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    begin, nbytes = t.data_ptr(), t.numel() * t.element_size()
    pages = (nbytes + ALIGN_BYTES - 1) // ALIGN_BYTES
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(begin), ctypes.c_size_t(nbytes), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec), pages
