"""Blockwise dynamic 8-bit optimizer states: the maps, quantization, and the 8-bit AdamW step in plain PyTorch.

See [Note: int8 optimizer states] below; `adam8_step` here is the reference the compiled kernel
(offload.kernels.adam8) is held to bit for bit.
"""

from __future__ import annotations

import functools
import math

import torch

# [Note: int8 optimizer states]
# optimizer.states "int8" keeps Adam's exp_avg (m) and exp_avg_sq (v) as one byte per element: blocks of
# BLOCK = 256 elements in a parameter's flat run, each with one fp32 absmax, and codes into a 256-value dynamic
# map (Dettmers et al., "8-bit optimizers via block-wise quantization": a decade exponent and a linear
# fraction, dense near zero), signed for m and unsigned for v, as bitsandbytes' and torchao's 8-bit Adam use.
# A step dequantizes a block (code value x absmax), updates it in fp32 as AdamW does, takes the new block
# absmax and rounds each value / absmax to the nearest map value (ties to the lower one). Tensors under
# SMALL_NUMEL elements (norms, biases) keep fp32 m and v: their bytes are negligible and their updates the most
# sensitive. A trainable parameter starts at a multiple of 256 elements (offload.plan.units.TRAINABLE_ALIGN_NUMEL)
# and windows at multiples of 2048, so a block never spans two parameters or two windows, and a rank's shard
# quantizes alone.
# The fp32 master and the gradient are unchanged: 4 + 2 + 8/256 bytes of state a parameter instead of 12.
#
# `adam8_step` here is the reference the compiled kernel (offload.kernels.adam8) is held to: each fp32 operation
# rounded on its own, in the kernel's order (no fused multiply-add), so both give the same codes.

BLOCK = 256          # elements a block (one fp32 absmax each)
SMALL_NUMEL = 4096   # parameters with fewer elements keep fp32 states


def _f32(x: float) -> float:
    """x rounded to fp32, as a Python float (what the kernel computes its constants as)."""
    return torch.tensor(x, dtype=torch.float32).item()


@functools.lru_cache(maxsize=2)
def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 sorted fp32 values of the dynamic map: for each decade 10^(k-6), k = 0..6, the midpoints of
    2^k (signed; 2^(k+1) unsigned) equal steps over [0.1, 1] scaled by the decade (and their negatives when
    signed), then 0 and 1. The same values as bitsandbytes.functional.create_dynamic_map (tested)."""
    values: list[float] = []
    for k in range(7):
        steps = 2 ** k if signed else 2 ** (k + 1)
        edges = torch.linspace(0.1, 1, steps + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        scaled = (10 ** (k - 6)) * mids
        values += scaled.tolist() + ((-scaled).tolist() if signed else [])
    values += [0.0, 1.0]
    assert len(values) == 256
    return torch.tensor(sorted(values), dtype=torch.float32)


def zero_code(signed: bool) -> int:
    """The code of 0: what a moment's elements outside any parameter (a block's padding) hold, so that they
    stay 0 and out of their block's absmax (an all-zero byte is 0 for v, but -0.99 x absmax for m)."""
    return int((dynamic_map(signed) == 0).nonzero()[0])


@functools.lru_cache(maxsize=2)
def midpoints(signed: bool) -> torch.Tensor:
    """The 255 fp32 midpoints between neighbouring map values: a value's code is how many are below it."""
    q = dynamic_map(signed)
    return (q[:-1] + q[1:]) / 2.0


def quantize(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8, absmax fp32 per block) of flat fp32 `x` (a multiple of BLOCK elements)."""
    blocks = x.view(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1)
    return codes_of(blocks, absmax, signed).view(-1), absmax


def codes_of(blocks: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """The nearest map codes of blocks (n, BLOCK) scaled by their absmax (n,) (a zero block: zeros)."""
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    scaled = torch.where(absmax[:, None] > 0, blocks / safe[:, None], torch.zeros_like(blocks)).clamp_(-1, 1)
    mids = midpoints(signed).to(blocks.device)
    return torch.searchsorted(mids, scaled.contiguous(), right=False).to(torch.uint8)


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values of flat `codes` (uint8) with their blocks' `absmax`."""
    q = dynamic_map(signed).to(codes.device)
    return (q[codes.long()].view(-1, BLOCK) * absmax[:, None]).view(-1)


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """fp32 square root rounded to nearest, as IEEE (and the kernel's sqrtps) has it: torch's CPU sqrt goes
    through MKL's vsSqrt, one ulp off for ~20% of inputs (measured, torch 2.13). A root one ulp off moves to
    its neighbour when the exact (fp64) square of the point halfway to it shows the true root lies past it."""
    s, xd = torch.sqrt(x), x.double()
    for up in (True, False):
        n = torch.nextafter(s, torch.full_like(s, math.inf if up else -math.inf))
        half = (s.double() + n.double()) / 2  # 25 significant bits: its square is exact in fp64
        s = torch.where(half * half < xd if up else (half * half > xd) & (half > 0), n, s)
    return s


def adam8_step(param, grad, m_codes, m_absmax, v_codes, v_absmax, *, step: int, lr: float, beta1: float,
               beta2: float, eps: float, weight_decay: float, adamw: bool = True, grad_scale: float = 1.0,
               out=None) -> None:
    """One AdamW (adamw=False: Adam with L2 decay) update of flat fp32 `param` (a multiple of BLOCK elements)
    with 8-bit m and v, in place: codes (uint8) and absmax (fp32, one a block) of each. `out` (bf16/fp16)
    receives the new weight rounded to nearest even. The math of the compiled kernel, op for op."""
    c = coefficients(step, lr, beta1, beta2, eps, weight_decay, adamw, grad_scale)
    g = grad.float()
    if c["scaled"]:
        g = g * c["inv_scale"]
    p = param * c["decay"] if adamw else param
    if c["l2"]:
        g = g + p * c["l2"]
    m = dequantize(m_codes, m_absmax, True) * c["beta1"] + g * c["beta1_c"]
    v = dequantize(v_codes, v_absmax, False) * c["beta2"] + (g * g) * c["beta2_c"]
    denom = sqrt_rn(v) * c["inv_bc2_sqrt"] + c["eps"]
    param.copy_(p + (m / denom) * c["neg_step_size"])
    codes, absmax = quantize(m, True)
    m_codes.copy_(codes), m_absmax.copy_(absmax)
    codes, absmax = quantize(v, False)
    v_codes.copy_(codes), v_absmax.copy_(absmax)
    if out is not None:
        out.copy_(param)


def coefficients(step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, adamw: bool,
                 grad_scale: float) -> dict:
    """The step's fp32 constants, computed in double and rounded once (as the kernel's adam8_coeffs)."""
    return {"beta1": _f32(beta1), "beta1_c": _f32(1.0 - beta1), "beta2": _f32(beta2), "beta2_c": _f32(1.0 - beta2),
            "neg_step_size": _f32(-lr / (1.0 - beta1 ** step)), "inv_bc2_sqrt": _f32(1.0 / math.sqrt(1.0 - beta2 ** step)),
            "eps": _f32(eps), "decay": _f32(1.0 - lr * weight_decay) if adamw else 1.0,
            "l2": 0.0 if adamw else _f32(weight_decay), "inv_scale": _f32(1.0 / grad_scale), "scaled": grad_scale != 1.0}
