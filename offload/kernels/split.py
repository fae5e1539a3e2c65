"""The split master: an fp32 master as its bf16 working weight plus a record of 17 bits an element
([Note: split master] below). `split_` writes a record from masters, `join` the masters back from a record
and the working weights; both are exact for every fp32 bit pattern (NaN payloads aside: a NaN's working
weight is bf16's one NaN; tested over all 2^32 once, tests/test_split_master.py samples them). Backends as
cpu_adam's: "compiled" (split_master/join_master in csrc/cpu_adam.cpp, on its threads) or "torch" (the
reference here, also what tensors on another device run); "auto" follows cpu_adam.kernel_backend()."""

from __future__ import annotations

import sys

import torch

from offload.kernels import cpu_adam

# [Note: split master]
# optimizer.master "split" (precision bf16) keeps a trained element's fp32 master as the bf16 working weight
# the forward already reads plus a record: the master's low 16 bits, and one tie bit an element (8 a byte,
# after the low halves). The working weight is the master rounded to nearest even, as with an fp32 master, so
# the forward, the gradients and every update are the fp32-master run's bit for bit. The low half alone does
# not say whether the rounding went up: it did when the low half is above 0x8000, did not below, and at
# exactly 0x8000 (a tie) it went up from an odd high half and stayed on an even one. A working weight with an
# even high half is thus reached from 65,537 masters, one more than 16 bits can name (TransformerEngine's
# remainders round such ties away from zero instead, changing the working weight): the tie bit names the
# master that stayed (low half 0x8000 on an even high half). Record: 2 + 1/8 bytes an element in place of 4.
# Windows are multiples of 2048 elements, so a window's tie bits are whole bytes and records tile as masters do.

TIE_BITS = 8  # tie bits a byte
_LOW_TIE = -0x8000  # the low half 0x8000 as int16


def record_bytes(numel: int) -> int:
    """Bytes of the record of `numel` masters (a multiple of 8)."""
    if numel % TIE_BITS:
        raise ValueError(f"a split master's record covers whole bytes of tie bits; {numel} is not a multiple of 8")
    return 2 * numel + numel // TIE_BITS


def parts(record: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(low halves as int16, tie bits as uint8) of a record of `numel` masters."""
    if record.dtype != torch.uint8 or record.numel() != record_bytes(numel):
        raise ValueError(f"a split record of {numel} masters is {record_bytes(numel)} uint8 bytes; got "
                         f"{record.numel()} {record.dtype}")
    return record[:2 * numel].view(torch.int16), record[2 * numel:]


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) 16-bit halves of fp32 `t`, as int16 views (little-endian: low first)."""
    pairs = t.view(torch.int16).view(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def _shifts(device) -> torch.Tensor:
    return torch.arange(TIE_BITS, dtype=torch.uint8, device=device)


def _kernel(backend: str, *tensors: torch.Tensor):
    """The compiled kernel for `backend` where every tensor is a contiguous CPU one, else None (torch)."""
    kernel = cpu_adam._resolve(backend)
    return kernel if all(t.device.type == "cpu" and t.is_contiguous() for t in tensors) else None


def split_(master: torch.Tensor, record: torch.Tensor, backend: str = "auto") -> None:
    """Writes the record of fp32 `master` (flat) into `record` (uint8, record_bytes(master.numel()))."""
    low_out, ties_out = parts(record, master.numel())
    if master.dtype != torch.float32:
        raise ValueError(f"split_: the master is float32, got {master.dtype}")
    kernel = _kernel(backend, master, record)
    if kernel is not None:
        threads, isa = cpu_adam.get_num_threads(), cpu_adam._isa_code(kernel)
        return kernel.split_master(master.view(-1), record, threads, isa)
    low, high = _halves(master)
    low_out.copy_(low)
    tie = (low == _LOW_TIE) & ((high & 1) == 0)
    ties_out.copy_((tie.view(-1, TIE_BITS).to(torch.uint8) << _shifts(master.device)).sum(1, dtype=torch.uint8))


def join(weight: torch.Tensor, record: torch.Tensor, out: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """The fp32 masters of bf16 `weight` (flat, their working weights) and `record`, into `out`; returns it."""
    if weight.dtype != torch.bfloat16 or out.dtype != torch.float32 or weight.numel() != out.numel():
        raise ValueError(f"join: bf16 weights and an fp32 output of as many elements; got {weight.dtype} "
                         f"[{weight.numel()}] and {out.dtype} [{out.numel()}]")
    low, ties = parts(record, out.numel())
    kernel = _kernel(backend, weight, record, out)
    if kernel is not None:
        threads, isa = cpu_adam.get_num_threads(), cpu_adam._isa_code(kernel)
        kernel.join_master(weight.view(-1), record, out.view(-1), threads, isa)
        return out
    tie = ((ties.unsqueeze(1) >> _shifts(ties.device)) & 1).view(-1).bool()
    up = (low < 0) & ((low != _LOW_TIE) | ~tie)  # the rounding went up: the master's high half is one less
    out_low, out_high = _halves(out)
    out_low.copy_(low)
    torch.sub(weight.view(torch.int16), up.to(torch.int16), out=out_high)
    return out


assert sys.byteorder == "little", "the split master's int16 halves assume a little-endian host"
