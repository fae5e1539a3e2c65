"""Activation checkpointing by the engine: a unit's forward keeps its inputs alone and runs again in its backward.

[Note: activation checkpointing]
With `activation_checkpointing`, the forward of every unit made of layers (a root module with children: a
transformer block; not a lone embedding or linear head, whose own forward keeps no more than its input) runs
inside torch's non-reentrant checkpoint, `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`, as the
unit's `forward`, so inside the engine's module hooks (offload.hooks). The forward keeps the unit's tensor
inputs and nothing it computes; when the unit's backward needs what it computed, torch runs the forward again
with the RNG state of the first run (dropout draws the same masks), so the numbers are bit for bit those of the
model calling torch's checkpoint on each unit itself. The recompute's weights are the backward's: the hook on
the unit's outputs fetches the unit before any of its backward runs, so the recompute fetches through the same
path, is not a use of its own, and the recorded trace (and over ranks, the gathers that follow it) is the trace
of a run without checkpointing.

torch saves a checkpoint's inputs under the saved-tensor hooks outside it: the engine's are UnitInputs', which
holds each unit's inputs until autograd frees them after the unit's backward; the one place where the inputs of
every checkpointed unit are (the place from which they can move to a tier and come back ahead of the backward).

A model that checkpoints inside its units already recomputes each unit once, not twice:
- a checkpoint around the unit's call (the presets' `checkpoint_activations`: checkpoint(block, ...)) holds the
  engine's: that one saves the inputs (through UnitInputs) and everything else in its own frame, so the model's
  checkpoint saves nothing and never recomputes;
- a checkpoint inside the unit's forward (Hugging Face's `gradient_checkpointing_enable()` checkpoints a layer's
  forward; a block calling checkpoint on its body): the engine's saves the inputs of the model's, and its
  recompute stops as soon as it recomputed them (torch's early stop, set for the engine's checkpoint), before
  the body, which the model's checkpoint then recomputes;
- a reentrant checkpoint around the unit's call runs the forward under no_grad, then again in the backward: a
  forward that runs in the backward is not checkpointed by the engine. A reentrant one inside the unit's forward
  would run the body a third time; use use_reentrant=False there (Hugging Face's default).
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from offload.units import Unit


def checkpointed(unit: Unit) -> bool:
    """Whether the engine checkpoints `unit` (module note): a unit whose root module has children."""
    return unit.module is not None and next(unit.module.children(), None) is not None


class _Kept:
    """One saved input of a checkpointed unit's forward (what autograd holds in its place)."""

    __slots__ = ("unit", "tensor", "__weakref__")

    def __init__(self, unit: int, tensor: torch.Tensor):
        self.unit, self.tensor = unit, tensor


class UnitInputs:
    """The tensor inputs of the checkpointed units' forwards, per unit, from each forward until autograd frees
    them (after that forward's backward, or with its graph): `saving(unit)` around a unit's checkpoint
    collects them; `nbytes` are those held now, `peak_bytes` the most held at once."""

    def __init__(self):
        self._kept: dict[int, weakref.WeakSet] = {}
        self.peak_bytes = 0

    def saving(self, unit: int) -> torch.autograd.graph.saved_tensors_hooks:
        def pack(t: torch.Tensor) -> _Kept:
            kept = _Kept(unit, t)
            self._kept.setdefault(unit, weakref.WeakSet()).add(kept)
            self.peak_bytes = max(self.peak_bytes, self.nbytes)
            return kept

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda kept: kept.tensor)

    def kept(self, unit: int) -> list[torch.Tensor]:
        return [k.tensor for k in self._kept.get(unit, ())]

    @property
    def nbytes(self) -> int:
        """The bytes of the storages the kept inputs hold alive, each storage once (the rotary tables every
        layer takes are one)."""
        held = {k.tensor.untyped_storage().data_ptr(): k.tensor.untyped_storage().nbytes()
                for s in self._kept.values() for k in s}
        return sum(held.values())


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
