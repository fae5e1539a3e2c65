"""Activations in the memory plan: the bytes a forward and backward hold for a batch of B sequences of T
tokens, by formula from the model's shape, in the tier where they live.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.utils._pytree import tree_leaves

# [Note: the activations formula]
# N = B x T tokens, s = the compute dtype's itemsize, H hidden, I intermediate, A = heads x head_dim, Akv = the
# k and v heads attention keeps x head_dim, V vocab, L layers. What autograd keeps of a Llama-style block
# (pre-norm attention and SwiGLU MLP), per layer:
#     layer = N (2 (4 + 2 s) H  +  s (2 A + 2 Akv)  +  4 s I)  +  4 B heads T  [+ B heads T^2 (4 + s if s < 4)]
#         the two RMSNorms: each keeps its input in fp32, its normalized input before the weight and its output
#         (the next linears' input; 2 (4 + 2 s) H); attention: q, k, v and its output, which is o_proj's input
#         too (2 A + 2 Akv; a model that repeats k, v to every query head before attention keeps them at A); the
#         MLP: gate's output, its activation, up's output and their product (4 I); the fused attention kernels'
#         row statistic (4 B heads T); eager attention and SDPA's math path also keep the softmax's B x heads x
#         T x T weights, in fp32 and, below fp32, in the compute dtype too.
#     head = N ((4 + 2 s) H + (s + 16) V): the final norm, and at the loss's backward the logits in the compute
#         dtype, their fp32 copy for the loss, the log-probabilities, their gradient and the logits' gradient
#         (often the largest single term at long T).
#     backward = N 2 s I: a layer's backward holds two N x I gradients (the MLP's) beside what it keeps.
# The peak of one forward and backward:
#     without checkpointing: L x layer + max(head, backward)   (the loss's backward comes before any layer's)
#     with activation_checkpointing: L x s N H (each unit's kept input) + max(head, layer + backward)
#         (the largest unit's recompute: its forward's activations and its backward's working set)
# Kept inputs live in the tier offload_activations names (hbm for "none"); one unit's inputs, the working set
# and the head are in hbm in any case. Measured against the engine on the CPU backend within 15% over three
# sequence lengths, with and without checkpointing (tests/test_activation_memory.py).


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """The shape the formula reads: hidden, intermediate, heads, k/v heads kept, head_dim, vocab, layers."""
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int        # the k, v heads attention keeps (the presets repeat them to every query head: = heads)
    head_dim: int
    vocab: int
    layers: int


HF_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "num_hidden_layers")


def model_dims(model) -> tuple[ModelDims | None, str]:
    """(the dims of `model`, where they come from) from its `config`: a preset's offload.models.ModelConfig, or a
    Hugging Face config (hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim,
    vocab_size, num_hidden_layers); (None, what is missing) when they cannot be read."""
    config = next((getattr(m, "config", None) for m in model.modules() if getattr(m, "config", None) is not None),
                  None)
    if config is None:
        return None, "the model has no config (hidden size, layers, heads, vocab) to read its shape from"
    if hasattr(config, "d_model") and hasattr(config, "n_layers"):  # offload.models.ModelConfig
        # offload.models.Attention repeats k, v to every query head before attention: that is what is kept
        return ModelDims(config.d_model, config.d_ff, config.n_heads, config.n_heads, config.head_dim,
                         config.vocab_size, config.n_layers), "the preset's config"
    missing = [f for f in HF_FIELDS if not isinstance(getattr(config, f, None), int)]
    if missing:
        return None, f"its config has no {', '.join(missing)}"
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelDims(config.hidden_size, config.intermediate_size, heads, kv, head_dim, config.vocab_size,
                     config.num_hidden_layers), f"its config ({type(config).__name__})"


def activation_parts(dims: ModelDims, batch: int, seq: int, itemsize: int, scores: bool, checkpointing: bool,
                     tier: str = "hbm") -> list[dict]:
    """The activations' parts of the memory plan ([Note: the activations formula]): [{"name", "tier", "bytes",
    "formula"}] as offload.plan.memory.runtime_parts gives the runtime's. scores: the attention that runs keeps the
    T x T weights (eager, SDPA's math path). tier: where the kept inputs live (offload_activations)."""
    d, s, n = dims, itemsize, batch * seq
    tt = f" + B heads T^2 x {4 + (s if s < 4 else 0)}" if scores else ""
    layer = (n * (2 * (4 + 2 * s) * d.hidden + s * (2 * d.heads + 2 * d.kv_heads) * d.head_dim + 4 * s * d.intermediate)
             + 4 * batch * d.heads * seq + (batch * d.heads * seq * seq * (4 + (s if s < 4 else 0)) if scores else 0))
    head = n * ((4 + 2 * s) * d.hidden + (s + 16) * d.vocab)
    backward = n * 2 * s * d.intermediate
    shape = (f"B {batch} x T {seq}, s {s} B, H {d.hidden}, I {d.intermediate}, A {d.heads}x{d.head_dim}, "
             f"Akv {d.kv_heads}x{d.head_dim}, V {d.vocab}, L {d.layers}")
    terms = (f"layer = N (2 (4 + 2 s) H + s (2 A + 2 Akv) + 4 s I) + 4 B heads T{tt}; head = N ((4 + 2 s) H + "
             f"(s + 16) V); backward = N 2 s I; {shape}; layer {_mib(layer)}, head {_mib(head)}, backward "
             f"{_mib(backward)}")
    if not checkpointing:
        return [{"name": "activations", "tier": "hbm", "bytes": d.layers * layer + max(head, backward),
                 "formula": f"L x layer + max(head, backward); {terms}"}]
    unit_inputs = n * s * d.hidden
    parts = [{"name": "activations: one unit's recompute and the head", "tier": "hbm",
              "bytes": unit_inputs + max(head, layer + backward),
              "formula": f"N s H (its kept input) + max(head, layer + backward); {terms}"}]
    rest = (d.layers - 1) * unit_inputs
    if rest:
        parts.append({"name": "activations: kept unit inputs", "tier": tier, "bytes": rest,
                      "formula": f"(L - 1) x N s H, the checkpointed units' inputs (activation_checkpointing); "
                                 f"{shape}"})
    return parts


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def longest_seq(fits, limit: int) -> int:
    """The longest sequence length from 1 to `limit` for which fits(seq) holds (activations grow with T), or 0."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclasses.dataclass(frozen=True)
class ActivationModel:
    """What the plan needs to count a model's activations at any batch and sequence length: its dims (None: not
    readable, `source` says why), the compute itemsize, whether the attention that runs keeps T x T weights,
    whether the engine checkpoints, and the tier of the kept inputs (offload_activations)."""
    dims: ModelDims | None
    source: str
    itemsize: int
    scores: bool
    checkpointing: bool
    tier: str = "hbm"

    def parts(self, batch: int, seq: int) -> list[dict]:
        if self.dims is None:
            return []
        return activation_parts(self.dims, batch, seq, self.itemsize, self.scores, self.checkpointing, self.tier)

    def line(self, batch: int | None, seq: int | None) -> str:
        """The plan's one line on what it counts: the shape planned for, or why nothing."""
        if self.dims is None:
            return f"activations: not planned ({self.source}); the first forward's are not checked either"
        if batch is None:
            return ("activations: not planned until the first forward shows the batch's shape (config activations: "
                    "{\"batch\", \"seq\"} plans them up front); that forward is refused if they do not fit")
        return f"activations: planned for batch {batch} x seq {seq} from {self.source} (docs/design.md: the formula)"


def attention_keeps_scores(model, device, dtype) -> bool:
    """Whether the attention `model` runs keeps each layer's T x T weights: eager, or SDPA's math path on
    `device` ([Note: which attention runs] in offload.step.activations); a model naming none: no."""
    from offload.plan.attention import named_attention, sdpa_kernel

    named = named_attention(model)
    if named is None:
        return False
    impl, config = named
    if impl == "eager":
        return True
    if impl != "sdpa" or (device.type != "cpu" and not torch.cuda.is_available()):
        return False  # other kernels (flex, flash_attention_2) keep no scores; a device not here: its fused kernel
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else 64)
    try:
        return sdpa_kernel(device, dtype, head_dim, float(getattr(config, "attention_dropout", 0.0) or 0.0)) is None
    except RuntimeError:
        return False


def activation_model(model, cfg, device) -> ActivationModel:
    """The ActivationModel of `model` trained with `cfg` (precision resolved) on `device`."""
    from offload.plan.memory import OFFLOAD_TIER

    dims, source = model_dims(model)
    dtype = cfg.compute_dtype
    scores = dims is not None and attention_keeps_scores(model, device, dtype)
    return ActivationModel(dims, source, dtype.itemsize, scores, cfg.activation_checkpointing,
                           OFFLOAD_TIER[cfg.offload_activations.device])


def batch_shape(args, kwargs) -> tuple[int, int] | None:
    """(B, T) of a forward's inputs: the first tensor of two or more dimensions (input_ids [B, T], or
    inputs_embeds [B, T, H]) among its arguments; None if there is none."""
    for x in tree_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            return int(x.shape[0]), int(x.shape[1])
    return None
