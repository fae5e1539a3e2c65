"""The 8-bit AdamW step: fp32 masters with int8 m and v ([Note: int8 optimizer states] in quant8.py).

Two backends compute the same bits:
- "compiled": adam8_step in offload/kernels/csrc/cpu_adam.cpp ([Note: the int8 step] there), in the CPU
  Adam library (built and cached as cpu_adam builds it), on cpu_adam's threads (set_num_threads) and
  instruction set (set_isa, $OFFLOAD_CPU_ADAM_ISA): one pass a block of 256 elements, bf16 grads in and bf16
  weights out moving 16 bytes a parameter where the fp32 states move 28.
- "torch": quant8.adam8_step, the reference the kernel is held to bit for bit (param, codes, absmax, out);
  also what tensors on another device run.
"auto" follows cpu_adam.kernel_backend().
"""

from __future__ import annotations

import functools

import torch

from offload.kernels import cpu_adam, quant8
from offload.kernels.cpu_adam import (
    _GRAD_DTYPES,
    _OUT_DTYPES,
    _check_flat,
    _check_hparams,
    _isa_code,
    _resolve,
)
from offload.kernels.quant8 import BLOCK

__all__ = ["LUT_NUMEL", "adam8_step", "bucket_bounds", "kernel_tables"]

LUT_NUMEL = 1 << 16  # buckets of [Note: nearest code by bucket] (cpu_adam.cpp): an fp32's top 16 bits


def bucket_bounds() -> tuple[torch.Tensor, torch.Tensor]:
    """(smallest, largest) fp32 value of each of the LUT_NUMEL buckets, bucket b holding the floats whose bit
    pattern >> 16 is b (NaN where such a pattern is a NaN). For negative buckets the smallest is the pattern
    with the low 16 bits all ones."""
    top = torch.arange(LUT_NUMEL, dtype=torch.int64) << 16
    neg = top >= (1 << 31)
    lo, hi = torch.where(neg, top | 0xFFFF, top), torch.where(neg, top, top | 0xFFFF)

    def as_f32(bits: torch.Tensor) -> torch.Tensor:
        return torch.where(bits >= (1 << 31), bits - (1 << 32), bits).to(torch.int32).view(torch.float32)
    return as_f32(lo), as_f32(hi)


@functools.lru_cache(maxsize=1)
def kernel_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled step's tables, row 0 for m (signed map), row 1 for v (unsigned): the 256 map values
    (quant8.dynamic_map, fp32) and per bucket c << 16 | t (int32, LUT_NUMEL), c the midpoints below its
    smallest value and t the low 16 bits of the midpoint inside it (xor 0xFFFF in negative buckets; 0xFFFF
    when none): [Note: nearest code by bucket] in cpu_adam.cpp. RuntimeError if a bucket would hold two."""
    maps = torch.stack([quant8.dynamic_map(True), quant8.dynamic_map(False)])
    luts = torch.empty(2, LUT_NUMEL, dtype=torch.int32)
    lo, hi = bucket_bounds()
    ordered = ~(lo.isnan() | hi.isnan())
    neg = torch.arange(LUT_NUMEL) >= (1 << 15)
    for row, signed in enumerate((True, False)):
        mid = quant8.midpoints(signed)
        below = torch.searchsorted(mid, lo)  # midpoints < lo (right=False)
        inside = torch.where(ordered, torch.searchsorted(mid, hi, right=True) - below, 0)  # in [lo, hi]
        if bool((inside > 1).any()):
            raise RuntimeError("adam8: a 16-bit bucket holds two midpoints of the dynamic map; the kernel's "
                               "lookup needs finer buckets (quant8.dynamic_map changed?)")
        low = mid[below.clamp(max=254)].view(torch.int32).long() & 0xFFFF  # the midpoint in the bucket, if any
        t = torch.where(inside == 1, torch.where(neg, low ^ 0xFFFF, low), 0xFFFF)
        luts[row] = ((below << 16) | t).to(torch.int32)
    return maps, luts


def adam8_step(param, grad, m_codes, m_absmax, v_codes, v_absmax, *, step: int, lr: float, beta1: float,
               beta2: float, eps: float, weight_decay: float, adamw: bool = True, grad_scale: float = 1.0,
               out=None, backend: str = "auto", split=None) -> None:
    """One AdamW (adamw=False: Adam with L2 decay) update of a flat fp32 shard with 8-bit m and v, in place.

    param: contiguous fp32, numel a multiple of 256 (quant8.BLOCK); grad: bf16/fp16/fp32, same numel;
    m_codes, v_codes: uint8, same numel; m_absmax, v_absmax: fp32, one per block of 256. `out` (bf16/fp16)
    receives the new weight rounded to nearest even. Arguments and checks as cpu_adam.adam_step (the caller
    checks grad_sq_sum for inf/nan first; `split` too). backend "torch", or tensors off the CPU:
    quant8.adam8_step.
    """
    numel = param.numel() if isinstance(param, torch.Tensor) else None
    if numel is not None and numel % BLOCK:
        raise ValueError(f"param.numel()={numel}: not a multiple of {BLOCK}; int8 states come in blocks of "
                         f"{BLOCK} elements: pad the shard (see [Note: int8 optimizer states])")
    hp = {"step": step, "lr": float(lr), "beta1": float(beta1), "beta2": float(beta2), "eps": float(eps),
          "weight_decay": float(weight_decay), "adamw": bool(adamw), "grad_scale": float(grad_scale)}
    _check_hparams(step, hp["lr"], hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"], hp["grad_scale"])
    states = (m_codes, m_absmax, v_codes, v_absmax)
    if split is not None and (_resolve(backend) is None or param.device.type != "cpu"):
        raise ValueError("split=: a split master steps fused in the compiled kernel only; join and split around it")
    if numel is not None and param.device.type != "cpu":
        _check_device(param, grad, *states, out, backend=backend)
        quant8.adam8_step(param, grad, *states, out=out, **hp)
        return
    _check_flat("param", param, None, (torch.float32,))
    _check_flat("grad", grad, numel, _GRAD_DTYPES)
    for name, codes, absmax in (("m", m_codes, m_absmax), ("v", v_codes, v_absmax)):
        _check_flat(f"{name}_codes", codes, numel, (torch.uint8,))
        _check_flat(f"{name}_absmax", absmax, None, (torch.float32,))
        if absmax.numel() != numel // BLOCK:
            raise ValueError(f"{name}_absmax.numel()={absmax.numel()}: must be param.numel() / {BLOCK} = "
                             f"{numel // BLOCK} (one absmax a block)")
    if out is not None:
        _check_flat("out", out, numel, _OUT_DTYPES)
    kernel = _resolve(backend)
    if numel == 0:
        return
    if kernel is None:
        quant8.adam8_step(param, grad, *states, out=out, **hp)
        return
    with torch.profiler.record_function("offload::cpu_adam8"):
        kernel.adam8_step(param, grad, *states, out, list(kernel_tables()), step, hp["lr"], hp["beta1"],
                          hp["beta2"], hp["eps"], hp["weight_decay"], hp["adamw"], hp["grad_scale"],
                          cpu_adam.get_num_threads(), _isa_code(kernel), split)


def _check_device(param, *tensors, backend: str) -> None:
    """Tensors off the CPU run the reference: all on param's device, and not backend="compiled"."""
    if backend not in cpu_adam._BACKENDS:
        raise ValueError(f"backend={backend!r}: not a backend; use one of {cpu_adam._BACKENDS}")
    if backend == "compiled":
        raise ValueError(f"backend='compiled' runs on CPU tensors, param is on {param.device}; use 'auto' or "
                         "'torch' (the reference) or move the tensors to the CPU")
    for t in tensors:
        if t is not None and (not isinstance(t, torch.Tensor) or t.device != param.device):
            where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"adam8_step: a tensor is on {where}, param on {param.device}; put all on one device")
