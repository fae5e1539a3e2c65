"""Shared pieces of the Engine tests: small models, a plain reference trainer, comparisons."""

from __future__ import annotations

import copy

import torch

from offload.kernels.quant8 import BLOCK, SMALL_NUMEL, adam8_step
from torch import nn
from torch.utils.checkpoint import checkpoint

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Block(nn.Module):
    """ckpt: its forward runs its body under torch's checkpoint (inside the unit, as Hugging Face's layers do);
    dropout: after the activation."""

    def __init__(self, d: int, ckpt: bool = False, dropout: float = 0.0):
        super().__init__()
        self.fc1, self.fc2, self.ckpt = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), ckpt
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    def _f(self, x):
        return x + self.fc2(self.drop(torch.relu(self.fc1(x))))

    def forward(self, x):
        return checkpoint(self._f, x, use_reentrant=False) if self.ckpt and torch.is_grad_enabled() else self._f(x)


class MLP(nn.Module):
    """inp -> blocks (units) -> head; `frozen` freezes the input layer (as a LoRA base would be); `outer_ckpt`:
    each block is called under torch's checkpoint (around the unit, as the presets' checkpoint_activations do),
    "reentrant" for use_reentrant=True; ckpt, dropout: the blocks' (Block)."""

    def __init__(self, d: int = 64, n_blocks: int = 3, ckpt: bool = False, frozen: bool = False,
                 dropout: float = 0.0, outer_ckpt: bool | str = False):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList(Block(d, ckpt, dropout) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 4)
        self.outer_ckpt = outer_ckpt
        if frozen:
            self.inp.requires_grad_(False)
            self.blocks[0].fc1.weight.requires_grad_(False)

    def forward(self, x, y):
        h = self.inp(x)
        for b in self.blocks:
            if self.outer_ckpt and torch.is_grad_enabled():
                h = checkpoint(b, h, use_reentrant=self.outer_ckpt == "reentrant")
            else:
                h = b(h)
        return nn.functional.mse_loss(self.head(self.norm(h)).float(), y.float())


def mlp_batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def llama(tied: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


class LlamaLoss(nn.Module):
    """Wraps an HF causal LM so forward(ids) returns the loss."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids, labels):
        return self.lm(input_ids=ids, labels=labels).loss


def llama_batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 128, (2, 16), generator=g)
        out.append((ids, ids.clone()))
    return out


class Reference:
    """A plain loop without offload: the same mixed-precision math the engine implements.

    Compute-dtype model for forward/backward; fp32 masters updated by torch.optim.AdamW/Adam
    (foreach=False); gradients summed in fp32 over micro-steps (loss / accumulation steps);
    torch's clip_grad_norm_; new weights = masters rounded to the compute dtype."""

    def __init__(self, model: nn.Module, precision: str, lr: float = 1e-2, weight_decay: float = 0.0,
                 adamw: bool = True, clip: float = 0.0, gas: int = 1, kernel: bool = False, delayed: bool = False,
                 states: str = "fp32"):
        self.dtype = DTYPES[precision]
        self.model = copy.deepcopy(model)
        for p in self.model.parameters():  # parameters only: the engine keeps buffers as they are
            p.data = p.data.to(self.dtype)
        self.pairs = [(p, orig.detach().float().clone().requires_grad_())
                      for p, orig in zip(self.model.parameters(), model.parameters()) if p.requires_grad]
        cls = torch.optim.AdamW if adamw else torch.optim.Adam
        self.opt = cls([m for _, m in self.pairs], lr=lr, weight_decay=weight_decay, foreach=False)
        self.clip, self.gas, self.kernel = clip, gas, kernel
        self.hp = dict(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=weight_decay, adamw=adamw)
        self.moments = [(torch.zeros_like(m), torch.zeros_like(m)) for _, m in self.pairs]
        if states == "int8":  # the plain-PyTorch 8-bit AdamW per parameter, padded to whole blocks
            self.moments = [_int8_moments(m) if m.numel() >= SMALL_NUMEL else ms for (_, m), ms in zip(self.pairs, self.moments)]
        self.steps = [0] * len(self.pairs)  # per parameter, as torch counts them
        self.delayed, self.pending = delayed, None  # delayed_update: (grads, scale, step) applied next step()

    def micro_step(self, *batch) -> float:
        batch = [t.to(self.dtype) if t.is_floating_point() else t for t in batch]
        loss = self.model(*batch)
        (loss / self.gas).backward()
        for p, m in self.pairs:
            if p.grad is not None:
                g = p.grad.float()
                m.grad = g if m.grad is None else m.grad + g
                p.grad = None
        return loss.item()

    def step(self) -> None:
        if self.kernel:
            return self._kernel_step()
        if self.clip:
            torch.nn.utils.clip_grad_norm_([m for _, m in self.pairs], self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in self.pairs:
                p.copy_(m)

    @torch.no_grad()
    def _kernel_step(self) -> None:
        """The same update through offload's CPU Adam kernel, parameter by parameter (the engine runs
        it over flat unit buffers): any difference from the engine is then the engine's. delayed: the
        documented semantics of delayed_update, applying the previous step's update after this step's
        forward and backward ran on weights one update behind. A parameter without a gradient is
        skipped and keeps its own step count, as torch's optimizers do."""
        grads = [m.grad for _, m in self.pairs]
        norm = sum(float(g.double().square().sum()) for g in grads if g is not None) ** 0.5
        scale = 1.0 / min(1.0, self.clip / (norm + 1e-6)) if self.clip else 1.0
        for _, m in self.pairs:
            m.grad = None
        update = (grads, scale)
        if self.delayed:
            update, self.pending = self.pending, update
        if update is not None:
            self._apply(*update)

    def flush(self) -> None:
        """delayed: applies the pending update (the engine's flush())."""
        if self.pending is not None:
            self._apply(*self.pending)
            self.pending = None

    @torch.no_grad()
    def _apply(self, grads, scale: float) -> None:
        from offload.kernels.cpu_adam import adam_step

        for i, ((p, m), g, (ea, eas)) in enumerate(zip(self.pairs, grads, self.moments)):
            if g is None:
                continue
            self.steps[i] += 1
            low = torch.empty_like(m, dtype=self.dtype) if self.dtype != torch.float32 else None
            if isinstance(ea, tuple):  # int8 moments (codes, absmax) of m and v: flats padded to whole blocks
                flat, grad, n = _padded(m), _padded(g.float()), m.numel()
                adam8_step(flat, grad, *ea, *eas, step=self.steps[i], grad_scale=scale, **self.hp)
                m.view(-1).copy_(flat[:n])
                if low is not None:
                    low.copy_(m)
            else:
                adam_step(m.view(-1), g.reshape(-1), ea.view(-1), eas.view(-1), step=self.steps[i], grad_scale=scale,
                          out=None if low is None else low.view(-1), **self.hp)
            p.copy_(m if low is None else low)

    def state(self) -> dict[str, torch.Tensor]:
        masters = {id(p): m for p, m in self.pairs}
        return {n: masters.get(id(p), p).detach().float() for n, p in self.model.named_parameters(remove_duplicate=False)}


def _padded(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return torch.cat([flat, flat.new_zeros(-flat.numel() % BLOCK)])


def _int8_moments(m: torch.Tensor):
    n = -(-m.numel() // BLOCK) * BLOCK
    return tuple((torch.zeros(n, dtype=torch.uint8), torch.zeros(n // BLOCK)) for _ in range(2))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item() or 1.0
    return (a.float() - b.float()).abs().max().item() / scale


def max_state_err(sd: dict, ref: dict) -> float:
    assert sd.keys() == ref.keys(), f"names differ: {sorted(set(sd) ^ set(ref))}"
    return max(rel_err(sd[n], ref[n]) for n in ref)


def train(eng, batches) -> list[float]:
    """A step per (x, y) batch through the engine; the losses."""
    losses = []
    for x, y in batches:
        loss = eng(x, y)
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    return losses
