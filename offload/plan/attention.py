"""Which attention a model runs and what it keeps for its backward: the memory plan's line on it and the
activations formula's choice between T x T scores and a fused kernel's row statistic."""

from __future__ import annotations

import torch

# The fused kernels of F.scaled_dot_product_attention (aten ops): none keeps the T x T scores for the backward.
SDPA_KERNELS = {"_scaled_dot_product_flash_attention_for_cpu": "torch's flash kernel for the CPU",
                "_scaled_dot_product_flash_attention": "the flash kernel",
                "_scaled_dot_product_efficient_attention": "the memory-efficient kernel",
                "_scaled_dot_product_cudnn_attention": "cuDNN's kernel"}


# [Note: which attention runs]
# Attention's activations grow with the sequence squared where the scores are kept: eager attention keeps each
# layer's batch x heads x T x T weights for its backward, as does SDPA's math path. SDPA's fused kernels (on the
# CPU, torch's flash kernel) keep the output and a row statistic. A model names its attention: a Hugging Face
# model's config._attn_implementation, the presets' class attribute attn_implementation ("sdpa"). For "sdpa" the
# kernel torch picks depends on the device, dtype, head size and dropout, so it is asked: one tiny causal call
# (the RNG state kept), whose aten op names the kernel. The memory plan prints the answer.


def named_attention(model: torch.nn.Module) -> tuple[str, object] | None:
    """(implementation, the config it is named in) of the attention `model` names, or None ([Note: which
    attention runs])."""
    for m in model.modules():
        config = getattr(m, "config", None)
        impl = getattr(m, "attn_implementation", None) or getattr(config, "_attn_implementation", None)
        if isinstance(impl, str):
            return impl, config
    return None


def sdpa_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, dropout: float) -> str | None:
    """The fused kernel F.scaled_dot_product_attention runs for a causal training call on `device` (no mask, as
    a causal LM calls it), in words; None: its math path."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    q = torch.zeros(1, 1, 4, head_dim, device=device, dtype=dtype, requires_grad=True)
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.enable_grad(), Ops():
        torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=dropout, is_causal=True)
    return next((SDPA_KERNELS[op] for op in seen if op in SDPA_KERNELS), None)


def attention_line(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> str | None:
    """The memory plan's line on the attention `model` runs; None when it names none."""
    named = named_attention(model)
    if named is None:
        return None
    impl, config = named
    if impl != "sdpa":
        keeps = (" (keeps each layer's batch x heads x T x T attention weights for its backward; "
                 'attn_implementation="sdpa" keeps none of them)') if impl == "eager" else ""
        return f"attention: {impl}{keeps}"
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else 64)
    try:
        kernel = sdpa_kernel(device, dtype, head_dim, float(getattr(config, "attention_dropout", 0.0) or 0.0))
    except RuntimeError as e:  # the plan's line only: training goes on
        return f"attention: sdpa (which kernel it runs here could not be asked: {str(e).splitlines()[0]})"
    if kernel is None:
        return "attention: sdpa, its math path on this device (keeps each layer's batch x heads x T x T scores)"
    return f"attention: sdpa, {kernel} (no T x T scores kept)"
