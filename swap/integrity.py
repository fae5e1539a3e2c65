"""Swap integrity: the block digests that catch silent corruption of a swap file, and the spans they cover.

A key's bytes move as I/O blocks (`io_spans`: block_bytes pieces of the 4 KiB-multiple body, a partial last
page apart); with checksums on, one `block_digest` per block (`digest_spans`) is recorded when the key is
written and compared when it is read (`verify_block`, on the thread that completed the block). A caller
that hashes on its own (CPU Adam's step: offload.kernels.cpu_adam) takes the same spans in elements
(`digest_bounds`) and hashes them with `tensor_digests`.
"""

from __future__ import annotations

import numpy as np
import torch

from .backends import Block, host_buffer
from .buffers import ALIGN_BYTES
from .errors import SwapCorruptionError

_MASK64 = (1 << 64) - 1


def block_digest(addr: int, nbytes: int) -> int:
    """128-bit checksum of one I/O block: (xor << 64) | sum of its little-endian 64-bit words.

    [Note: why not crc32]
    zlib.crc32 on one core of a busy 2-core machine is slower than a fast drive, so it becomes the
    bottleneck of swap reads (bench/RESULTS.md, "Figures that code comments carried"). Two numpy
    reductions over a block that is already in cache run several times faster. They catch what goes
    wrong with swap files: flipped bits, zeroed, stale, misdirected or torn blocks, truncation; they do
    not catch 8-byte words swapped inside one block.
    """
    n8 = nbytes - nbytes % 8
    s = x = 0
    if n8:
        s, x = _word_digest(addr, n8)
    if nbytes > n8:
        rest = int.from_bytes(bytes(host_buffer(addr + n8, nbytes - n8)), "little")
        s, x = s + rest, x ^ (rest << 1)
    return (x << 64) | (s & _MASK64)


def _numpy_word_digest(addr: int, n8: int) -> tuple[int, int]:
    """(sum mod 2**64, xor) of the 64-bit words of the n8 bytes at addr, in two numpy passes."""
    words = np.frombuffer(host_buffer(addr, n8), dtype=np.uint64)
    return int(np.add.reduce(words, dtype=np.uint64)), int(np.bitwise_xor.reduce(words))


_word_digest = _numpy_word_digest


def use_word_digest(fn) -> None:
    """Makes block_digest take its (sum, xor) of 64-bit words from fn(addr, n8) -> (sum, xor), where n8
    is a multiple of 8; None: numpy's two passes again. offload hands in its compiled kernel's single
    pass (offload.kernels.cpu_adam.use_for_swap_digests), which swap cannot import."""
    global _word_digest
    _word_digest = _numpy_word_digest if fn is None else fn


def tensor_digests(t: torch.Tensor, bounds) -> tuple[int, ...]:
    """block_digest of each element span [bounds[i], bounds[i + 1]) of the contiguous tensor `t`
    (bounds from SwapStore.digest_bounds): what `write(digests=)` and `check_digests` take."""
    base, size = t.data_ptr(), t.element_size()
    return tuple(block_digest(base + b * size, (e - b) * size) for b, e in zip(bounds, bounds[1:]))


def io_spans(nbytes: int, block_bytes: int) -> list[tuple[int, int]]:
    """(start, bytes) of the I/O blocks over the 4 KiB-multiple body (a partial last page moves apart)."""
    body = nbytes - nbytes % ALIGN_BYTES
    return [(s, min(block_bytes, body - s)) for s in range(0, body, block_bytes)]


def digest_spans(nbytes: int, block_bytes: int) -> list[tuple[int, int]]:
    """(start, bytes) of what each recorded digest covers: the blocks, then the partial last page."""
    body = nbytes - nbytes % ALIGN_BYTES
    return io_spans(nbytes, block_bytes) + ([(body, nbytes - body)] if nbytes > body else [])


def digest_bounds(numel: int, itemsize: int, block_bytes: int) -> list[int]:
    """SwapStore.digest_bounds for a store of `block_bytes` blocks, without one."""
    starts = [s for s, _ in digest_spans(numel * itemsize, block_bytes)]
    if any(b % itemsize for b in starts):
        raise ValueError(f"itemsize={itemsize}: blocks of {block_bytes} bytes do not split into items")
    return [b // itemsize for b in starts] + [numel]


def verify_block(crcs: list[int], i: int, valid_bytes: int, write: bool, block: Block,
                 path: str) -> SwapCorruptionError | None:
    """The digest of the first `valid_bytes` of the completed block `i`: a write records it in crcs[i], a
    read compares it with crcs[i] and returns the error that names the block (None: it matches)."""
    digest = block_digest(block.addr, valid_bytes)
    if write:
        crcs[i] = digest
    elif digest != crcs[i]:
        return SwapCorruptionError(f"checksum mismatch (read {digest:#034x}, written {crcs[i]:#034x})",
                                   path=path, offset=block.offset, nbytes=block.nbytes)
    return None
