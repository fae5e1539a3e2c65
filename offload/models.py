"""A compact Llama-style causal LM, its presets, and `build_model` for presets or local HF directories.

The model is the embedded default of `offload train` and the subject of the benchmarks:
RMSNorm, rotary position embeddings, grouped-query attention through F.scaled_dot_product_attention,
a SwiGLU MLP, optional tied embeddings. Its transformer blocks are `model.layers`, an nn.ModuleList:
the Engine's units.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from offload.pretrained import PACKAGED, resolve_model

# [Note: seeding contract]
# Every module that owns parameters directly has `reset_parameters()`, and every random draw in it comes
# from the *CPU* default generator (then copied into the parameter, whatever its device or dtype). So:
#     torch.manual_seed(seed)
#     for m in model.modules():                      # module order, exactly this order
#         if owns_parameters(m): m.reset_parameters()
# gives the same weights on any device, and a model built on the meta device and materialized unit by
# unit (to_empty + reset_parameters, still in `model.modules()` order, under one manual_seed(seed)) equals
# the model built directly on the CPU with the same seed. `init_weights(model, seed)` is that loop; the
# normal constructor path (`build_model`) uses it too.


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 257            # bytes + EOS (offload.data.ByteTokenizer)
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2              # < n_heads: grouped-query attention
    d_ff: int = 384                  # SwiGLU hidden size
    max_seq_len: int = 256
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    checkpoint_activations: bool = False   # torch.utils.checkpoint per block (use_reentrant=False)

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model}: not divisible by n_heads={self.n_heads}; pick a multiple")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads}: must divide n_heads={self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"head_dim={self.d_model // self.n_heads}: rotary embeddings need an even head_dim")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def block_numel(self) -> int:
        d, kv = self.d_model, self.n_kv_heads * self.head_dim
        attention = 2 * d * d + 2 * d * kv      # wq, wo: d x d; wk, wv: d x kv
        return attention + 3 * d * self.d_ff + 2 * d   # + gate/up/down + two RMSNorms

    def num_params(self) -> int:
        embed = self.vocab_size * self.d_model
        head = 0 if self.tie_embeddings else embed
        return embed + self.n_layers * self.block_numel() + self.d_model + head


PRESETS: dict[str, ModelConfig] = {
    # ~0.8M: unit tests.
    "tiny": ModelConfig(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=384, max_seq_len=256),
    # ~12M: `offload train` with no flags, a few hundred steps on 2 CPU cores in minutes.
    "small": ModelConfig(d_model=384, n_layers=6, n_heads=6, n_kv_heads=2, d_ff=1024, max_seq_len=256),
    # ~203M: the benchmarks' model (bench/e2e.py; bench/RESULTS.md).
    "bench-200m": ModelConfig(vocab_size=320, d_model=1024, n_layers=16, n_heads=16, n_kv_heads=16,
                              d_ff=2752, max_seq_len=512, tie_embeddings=False),
    # Llama-3.2-3B's shape (3.21B parameters, tied 128256-row embedding).
    "3b": ModelConfig(vocab_size=128256, d_model=3072, n_layers=28, n_heads=24, n_kv_heads=8, d_ff=8192,
                      max_seq_len=2048, rope_theta=500000.0, tie_embeddings=True),
    # Llama-2-7B's shape (6.74B parameters, untied 32000-row embedding and head): the LoRA scale bench.
    "7b": ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, d_ff=11008,
                      max_seq_len=4096, tie_embeddings=False),
    # Llama-2-70B's shape (68.98B parameters, grouped-query attention): the QLoRA scale bench (nf4 base on nvme).
    "70b": ModelConfig(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672,
                       max_seq_len=4096, tie_embeddings=False),
}


def _normal_(param: torch.Tensor, std: float) -> None:
    # Draw on the CPU generator whatever the parameter's device: device-independent init (seeding contract).
    if param.is_meta:
        return
    with torch.no_grad():
        param.copy_(torch.randn(param.shape, dtype=torch.float32) * std)


class Linear(nn.Linear):
    """nn.Linear without bias, initialized N(0, std) from the CPU generator."""

    def __init__(self, in_features: int, out_features: int, std: float, device=None, dtype=None):
        self.std = std
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        _normal_(self.weight, self.std)


class Embedding(nn.Embedding):
    def __init__(self, num: int, dim: int, std: float = 0.02, device=None, dtype=None):
        self.std = std
        super().__init__(num, dim, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        _normal_(self.weight, self.std)


class TiedLinear(nn.Module):
    """The output projection of tied embeddings: it owns the embedding's very Parameter, so the Engine
    sees a module using that unit's weight and fetches the unit before it runs (a forward reading
    `self.embed.weight` directly would find it released). Initialized by the embedding, not here."""

    def __init__(self, embed: nn.Embedding):
        super().__init__()
        self.weight = embed.weight

    def reset_parameters(self) -> None:
        pass  # the weight is the embedding's, initialized (once) by Embedding.reset_parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            with torch.no_grad():
                self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.type_as(x) * self.weight


def rotary(seq_len: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [seq, head_dim], computed per call (no buffers, so meta-built models need nothing)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # [T, hd/2]
    angles = torch.cat((angles, angles), dim=-1)                                               # [T, hd]
    return angles.cos(), angles.sin()


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)                       # Llama's rotate_half convention
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated.float() * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        d, hd, std = cfg.d_model, cfg.head_dim, 0.02
        out_std = std / math.sqrt(2 * cfg.n_layers)   # GPT-2 style: residual writes scaled by depth
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, hd
        self.wq = Linear(d, cfg.n_heads * hd, std, device, dtype)
        self.wk = Linear(d, cfg.n_kv_heads * hd, std, device, dtype)
        self.wv = Linear(d, cfg.n_kv_heads * hd, std, device, dtype)
        self.wo = Linear(cfg.n_heads * hd, d, out_std, device, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)      # [B, H, T, hd]
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)   # [B, KV, T, hd]
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        if self.n_kv_heads != self.n_heads:           # GQA; sdpa's enable_gqa needs torch >= 2.5
            groups = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)                 # [B, H, T, hd]
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
        self.gate = Linear(cfg.d_model, cfg.d_ff, 0.02, device, dtype)
        self.up = Linear(cfg.d_model, cfg.d_ff, 0.02, device, dtype)
        self.down = Linear(cfg.d_ff, cfg.d_model, out_std, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """One transformer block: the Engine's unit."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, device, dtype)
        self.attn = Attention(cfg, device, dtype)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, device, dtype)
        self.mlp = MLP(cfg, device, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class LlamaLM(nn.Module):
    """forward(input_ids [B, T], labels [B, T] | None) -> loss (scalar) if labels else logits [B, T, V].

    Labels follow Hugging Face's convention: labels == input_ids, shifted inside (position t predicts
    t+1); -100 is ignored. So the same batches feed this model and transformers' LlamaForCausalLM.
    """

    attn_implementation = "sdpa"  # F.scaled_dot_product_attention, as HF names it ([Note: which attention runs])

    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.config = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.d_model, 0.02, device, dtype)
        self.layers = nn.ModuleList(Block(cfg, device, dtype) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, device, dtype)
        self.lm_head = (TiedLinear(self.embed) if cfg.tie_embeddings
                        else Linear(cfg.d_model, cfg.vocab_size, 0.02, device, dtype))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        T = input_ids.shape[1]
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length={T}: longer than max_seq_len={self.config.max_seq_len}; "
                             f"shorten the batches or raise max_seq_len")
        x = self.embed(input_ids)                                                   # [B, T, d]
        cos, sin = rotary(T, self.config.head_dim, self.config.rope_theta, x.device)
        for block in self.layers:
            if self.config.checkpoint_activations and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        x = self.norm(x)
        logits = self.lm_head(x)                                                    # [B, T, V]
        if labels is None:
            return logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                               labels[:, 1:].reshape(-1), ignore_index=-100)


def owns_parameters(module: nn.Module) -> bool:
    return next(module.parameters(recurse=False), None) is not None


def init_weights(model: nn.Module, seed: int) -> nn.Module:
    """The seeding contract (module docstring): manual_seed(seed), then reset_parameters() in modules() order."""
    torch.manual_seed(seed)
    for module in model.modules():
        if owns_parameters(module):
            if not hasattr(module, "reset_parameters"):
                raise TypeError(f"{type(module).__name__} owns parameters but has no reset_parameters()")
            module.reset_parameters()
    return model


def loss_of(output) -> torch.Tensor:
    """The loss of our model (a tensor) or of a transformers model (an output with .loss)."""
    return output if isinstance(output, torch.Tensor) else output.loss


def hf_causal_lm(config, device="meta", dtype=None, seed: int = 0) -> nn.Module:
    """The model transformers' AutoModelForCausalLM builds from `config` (a local HF directory, its config.json,
    a config dict or a PretrainedConfig), with transformers' own init under `seed` (none on the meta device,
    where the weights come from a checkpoint or the Engine's init). One path for every architecture
    AutoModelForCausalLM knows: no table of them here."""
    try:
        from transformers import CONFIG_MAPPING, AutoModelForCausalLM, PretrainedConfig
    except ImportError as e:
        raise ValueError(f"--model={config}: a Hugging Face model needs transformers; "
                         f"pip install 'offload[hf]'") from e
    if not isinstance(config, PretrainedConfig):
        where, raw = "the config", config
        if isinstance(config, str):
            where = os.path.join(config, "config.json") if os.path.isdir(config) else config
            raw = _read_json(where)
        try:  # the config class of its model_type: never the hub, never a directory's own code (auto_map)
            config = CONFIG_MAPPING[raw.get("model_type")].from_dict(raw)
        except KeyError as e:
            import transformers

            raise ValueError(f"model_type={raw.get('model_type')!r} in {where}: transformers "
                             f"{transformers.__version__} does not know it; upgrade transformers, or pass a preset "
                             f"({', '.join(PRESETS)})") from e
    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise ValueError(f"model_type={config.model_type!r}: not a causal language model (AutoModelForCausalLM "
                         f"does not build {type(config).__name__}); pass a decoder-only language model (llama, "
                         f"mistral, qwen2, gpt2, ...)")
    torch.manual_seed(seed)          # transformers' own init, made repeatable
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype) if dtype is not None else model


def _read_json(path: str) -> dict:
    with open(path) as f:  # OSError (a missing file) names the path
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); pass a HF config.json") from e


def build_model(name_or_dir: str | ModelConfig, device="cpu", dtype=None, seed: int = 0,
                checkpoint_activations: bool = False) -> nn.Module:
    """A preset name, a ModelConfig, a packaged model's name (offload.pretrained: its cached HF directory) or
    a local HF directory (config.json of a causal LM) -> model.

    Our models are initialized with init_weights(model, seed) unless device is "meta" (the Engine then
    materializes them under the same contract). A HF directory gives the model AutoModelForCausalLM builds
    from its config (hf_causal_lm); its weights come from its safetensors (offload.integrations.hf_io).
    """
    name_or_dir = resolve_model(name_or_dir)
    if isinstance(name_or_dir, str) and os.path.isdir(name_or_dir):
        return hf_causal_lm(name_or_dir, device, dtype, seed)
    if isinstance(name_or_dir, ModelConfig):
        cfg = name_or_dir
    elif name_or_dir in PRESETS:
        cfg = PRESETS[name_or_dir]
    else:
        raise ValueError(f"--model={name_or_dir}: neither a preset ({', '.join(PRESETS)}), a packaged model "
                         f"({', '.join(PACKAGED)}) nor a directory with config.json; pass one of those")
    if checkpoint_activations:
        cfg = dataclasses.replace(cfg, checkpoint_activations=True)
    model = LlamaLM(cfg, device=device, dtype=dtype)
    if torch.device(device).type != "meta":
        init_weights(model, seed)
    return model


# Our names -> transformers' LlamaForCausalLM names, for exporting our model as a HF directory.
_HF_NAMES = {"embed.": "model.embed_tokens.", "layers.": "model.layers.", "norm.": "model.norm.",
             "attn_norm.": "input_layernorm.", "mlp_norm.": "post_attention_layernorm.",
             "attn.wq.": "self_attn.q_proj.", "attn.wk.": "self_attn.k_proj.", "attn.wv.": "self_attn.v_proj.",
             "attn.wo.": "self_attn.o_proj.", "mlp.gate.": "mlp.gate_proj.", "mlp.up.": "mlp.up_proj.",
             "mlp.down.": "mlp.down_proj.", "lm_head.": "lm_head."}


def hf_name(name: str) -> str:
    """'layers.3.attn.wq.weight' -> 'model.layers.3.self_attn.q_proj.weight' (and so on)."""
    head, _, rest = name.partition(".")
    if head == "layers":
        index, _, rest = rest.partition(".")
        for ours, theirs in _HF_NAMES.items():
            if rest.startswith(ours):
                return f"model.layers.{index}.{theirs}{rest[len(ours):]}"
        raise KeyError(name)
    return _HF_NAMES[head + "."] + rest


def hf_llama_config(cfg: ModelConfig) -> dict:
    """The config.json of transformers' LlamaForCausalLM with our model's shape and math."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32"}
