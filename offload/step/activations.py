"""What a forward keeps for its backward: activation checkpointing by the engine (a unit's forward keeps its
inputs alone and runs again in its backward), and which attention a model runs (the plan says).
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from offload.plan.units import Unit
from offload.state.activation_tier import InputTier, KeptInput

# [Note: activation checkpointing]
# With `activation_checkpointing`, the forward of every unit made of layers (a root module with children: a
# transformer block; not a lone embedding or linear head, whose own forward keeps no more than its input) runs
# inside torch's non-reentrant checkpoint, `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`, as the
# unit's `forward`, so inside the engine's module hooks (offload.step.hooks). The forward keeps the unit's tensor
# inputs and nothing it computes; when the unit's backward needs what it computed, torch runs the forward again
# with the RNG state of the first run (dropout draws the same masks), so the numbers are bit for bit those of the
# model calling torch's checkpoint on each unit itself. The recompute's weights are the backward's: the hook on
# the unit's outputs fetches the unit before any of its backward runs, so the recompute fetches through the same
# path, is not a use of its own, and the recorded trace (and over ranks, the gathers that follow it) is the trace
# of a run without checkpointing.
#
# torch saves a checkpoint's inputs under the saved-tensor hooks outside it: the engine's are UnitInputs', which
# holds each unit's inputs until autograd frees them after the unit's backward; the one place where the inputs of
# every checkpointed unit are (the place from which they can move to a tier and come back ahead of the backward).
#
# A Hugging Face model left with `config.use_cache` on would build a cache of past keys and values in a
# training forward, and each unit's recompute would append its keys and values to it again (twice the length,
# held through the backward, right only where attention aligns a causal mask to the first keys): the engine
# passes `use_cache=False` to a checkpointed training forward of a model whose config has it (`no_cache`), as
# Hugging Face's own gradient checkpointing does, with a warning where the caller asked for the cache.
#
# A model that checkpoints inside its units already recomputes each unit once, not twice:
# - a checkpoint around the unit's call (the presets' `checkpoint_activations`: checkpoint(block, ...)) holds the
#   engine's: that one saves the inputs (through UnitInputs) and everything else in its own frame, so the model's
#   checkpoint saves nothing and never recomputes;
# - a checkpoint inside the unit's forward (Hugging Face's `gradient_checkpointing_enable()` checkpoints a layer's
#   forward; a block calling checkpoint on its body): the engine's saves the inputs of the model's, and its
#   recompute stops as soon as it recomputed them (torch's early stop, set for the engine's checkpoint), before
#   the body, which the model's checkpoint then recomputes;
# - a reentrant checkpoint around the unit's call runs the forward under no_grad, then again in the backward: a
#   forward that runs in the backward is not checkpointed by the engine. A reentrant one inside the unit's forward
#   would run the body a third time; use use_reentrant=False there (Hugging Face's default).

log = logging.getLogger("offload")


def checkpointed(unit: Unit) -> bool:
    """Whether the engine checkpoints `unit` (module note): a unit whose root module has children."""
    return unit.module is not None and next(unit.module.children(), None) is not None


class _Kept:
    """One saved input of a checkpointed unit's forward (what autograd holds in its place): the tensor, or its
    record in a tier ([Note: kept inputs in a tier] in offload.state.activation_tier)."""

    __slots__ = ("unit", "tensor", "moved", "__weakref__")

    def __init__(self, unit: int, tensor: torch.Tensor | None, moved: KeptInput | None = None):
        self.unit, self.tensor, self.moved = unit, tensor, moved


class UnitInputs:
    """The tensor inputs of the checkpointed units' forwards, per unit, from each forward until autograd frees
    them (after that forward's backward, or with its graph): `saving(unit)` around a unit's checkpoint
    collects them; `tier` (offload_activations cpu or nvme) moves them out of hbm as they are saved and back
    ahead of their backward. `nbytes` are the hbm bytes they hold now, `peak_bytes` the most at once."""

    def __init__(self, tier: InputTier | None = None):
        self.tier = tier
        self._kept: dict[int, weakref.WeakSet] = {}
        self._lock = threading.Lock()  # the forward adds while stats() reads (offload train samples on a thread)
        self.peak_bytes = 0

    def saving(self, unit: int) -> torch.autograd.graph.saved_tensors_hooks:
        def pack(t: torch.Tensor) -> _Kept:
            moved = self.tier.pack(unit, t) if self.tier is not None else None
            kept = _Kept(unit, None if moved else t, moved)
            if moved is not None:  # autograd lets go of it: its bytes are freed ([Note: kept inputs in a tier])
                weakref.finalize(kept, self.tier.forget, moved).atexit = False
            with self._lock:
                self._kept.setdefault(unit, weakref.WeakSet()).add(kept)
            self._note_peak()
            return kept

        def unpack(kept: _Kept) -> torch.Tensor:
            if kept.moved is None:
                return kept.tensor
            t = self.tier.unpack(kept.moved)
            self._note_peak()
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _note_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    @property
    def nbytes(self) -> int:
        """The hbm bytes of the kept inputs: the storages those that stay hold alive, each storage once (the
        rotary tables every layer takes are one), and the moved ones' while in hbm (on their way out: their
        source; back for their backward)."""
        with self._lock:
            held = {k.tensor.untyped_storage().data_ptr(): k.tensor.untyped_storage().nbytes()
                    for s in self._kept.values() for k in s if k.tensor is not None}
        return sum(held.values()) + (self.tier.held["hbm"] if self.tier is not None else 0)

    def stats(self) -> dict:
        """engine.stats()["activations"]' part on the kept inputs."""
        tier = self.tier.stats() if self.tier is not None else {"where": "hbm"}  # first: frees what autograd let go
        return {"inputs_bytes": self.nbytes, "inputs_peak_bytes": self.peak_bytes, **tier}

    def ahead_of_backward(self) -> None:
        if self.tier is not None:
            self.tier.ahead_of_backward()

    def mark(self) -> int:
        return self.tier.mark() if self.tier is not None else 0

    def drop_all(self, after: int = 0) -> None:
        """Frees what the moved inputs packed after `after` (mark()'s) hold: those of a failed forward; all of
        them on a failed backward and close(). Their unpack raises from then on."""
        if self.tier is not None:
            self.tier.drop_all(after)


def no_cache(model, kwargs: dict) -> dict:
    """The kwargs of a training forward the engine checkpoints, with use_cache=False where `model` is one that
    caches past keys and values (module note: a config with a boolean use_cache)."""
    if not isinstance(getattr(getattr(model, "config", None), "use_cache", None), bool):
        return kwargs
    if kwargs.get("use_cache"):
        _warn_cache_off()
    return {**kwargs, "use_cache": False}


@functools.cache
def _warn_cache_off() -> None:
    """Once a process, as Hugging Face warns of the same under its own gradient checkpointing."""
    log.warning("offload: use_cache=True is of no use to a training forward the engine checkpoints (each "
                "recompute would append to the cache); running it with use_cache=False")


class Checkpointing:
    """Runs the forward of each checkpointed unit of `units` under torch's checkpoint, its inputs saved through
    `inputs` (module note); in_backward(): whether a backward runs (a forward then is a model's own recompute,
    run as it is). close() gives the modules their forwards back."""

    def __init__(self, units: list[Unit], inputs: UnitInputs, in_backward):
        self.inputs, self.in_backward = inputs, in_backward
        self.units = [u for u in units if checkpointed(u)]
        self._own = {}  # module -> the forward it held as its own attribute (accelerate sets one), or None
        for u in self.units:
            self._wrap(u)

    def _wrap(self, unit: Unit) -> None:
        module = unit.module
        self._own[module] = module.__dict__.get("forward")
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args, **kwargs):
            if not torch.is_grad_enabled() or self.in_backward():
                return inner(*args, **kwargs)
            flat, spec = tree_flatten((args, kwargs))
            at = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]

            def run(*tensors):  # every tensor input is passed to checkpoint, so it is saved through `inputs`
                leaves = list(flat)
                for i, t in zip(at, tensors):
                    leaves[i] = t
                a, k = tree_unflatten(leaves, spec)
                return inner(*a, **k)

            with self.inputs.saving(unit.index), set_checkpoint_early_stop(True):
                return checkpoint(run, *(flat[i] for i in at), use_reentrant=False)

        module.forward = forward

    def close(self) -> None:
        for module, own in self._own.items():
            if own is None:
                del module.forward
            else:
                module.forward = own
        self._own.clear()
