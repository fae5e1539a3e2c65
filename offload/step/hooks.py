"""Module hooks: fetch a unit before its forward and backward, release it after each."""

from __future__ import annotations

import time

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from offload.state.runtime import Runtime

# [Note: finding the backward of a module]
# Pre-backward: a hook on every output tensor that requires grad fires when the gradient for that output
# arrives, just before the module's own backward runs. Post-backward: the module's tensor inputs that
# require grad pass through `_PostBackward`, an identity whose backward runs once the gradients of all
# those inputs exist, i.e. after every autograd node between the inputs and the outputs ran. A unit
# whose inputs need no gradient (the embedding) is released when backward() ends. A model that checkpoints
# around a unit's call (torch.utils.checkpoint.checkpoint(block, ...)) fires the forward hooks again when it
# recomputes the unit in backward: that fetch is part of the unit's backward use (recorded as the backward's,
# after the output hook's fetch: one event in the trace, as without checkpointing), and the recomputed forward
# does not release, since its own backward follows at once. The engine's own checkpointing runs inside the hooks
# and fires none of them again ([Note: activation checkpointing] in offload.step.activations).
#
# [Note: backward without weights]
# An embedding lookup's backward reads the indices, not the table: a use of a unit by a module whose
# forward is nn.Embedding's needs no fetch for its backward, and none is hooked (a tied embedding table is
# not read again, nor held, at the end of the backward). Its released parameters take their
# shapes instead (WeightHandle.shape_only: the gradient accumulator checks the gradient against them). This
# is not inferred for other modules: activation checkpointing hides what a forward saves and recomputes it
# outside the module's hooks. As a guard, the use must also leave the unit's parameters and hbm storage
# with no more references than before it (anything autograd saved of them holds one; fewer is no sign of
# saving: an I/O thread letting go of the buffer it read the weights into, just after the fetch completed);
# a torch that cannot count them fetches always. With partitioned weights (zero_stage 3) the fetch is a gather, so the ranks
# agree on the answer ([Note: collective order] in offload.state.ranks): a count one rank read while another
# thread held a reference for a moment must not make it gather alone.


class _PostBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


def _tensors_requiring_grad(tree):
    flat, spec = tree_flatten(tree)
    idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    return flat, spec, idx


def register(prefetcher, weights, rt: Runtime, unit, module: torch.nn.Module) -> list:
    """Hooks `module` (the unit's root or a module using its tied parameters) to fetch/release `unit` through
    `prefetcher` (offload.step.prefetch); `weights`: the unit's handle; `rt`: the runtime (telemetry, ranks)."""
    starts: list[tuple[float, int | None]] = []  # forward start times and storage refs (a stack: a module may call itself)
    lookup = getattr(type(module), "forward", None) is torch.nn.Embedding.forward  # [Note: backward without weights]

    def pre_forward(mod, args, kwargs):
        prefetcher.fetch_for_use(unit, backward=prefetcher.in_backward())  # in backward: a recompute (module note)
        starts.append((time.perf_counter(), weights.refs() if lookup else None))
        if not torch.is_grad_enabled():
            return None
        flat, spec, idx = _tensors_requiring_grad((args, kwargs))
        if not idx:
            return None
        wrapped = _PostBackward.apply(lambda: prefetcher.release_after_use(unit, backward=True), *[flat[i] for i in idx])
        wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
        for i, t in zip(idx, wrapped):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def post_forward(mod, args, kwargs, output):
        refs = None
        if starts:
            t0, refs = starts.pop()
            rt.telemetry.span("compute", f"forward {unit.name}", t0, time.perf_counter())
        needs_weights = refs is None or weights.refs() > refs  # [Note: backward without weights]
        if lookup and weights.partitioned and torch.is_grad_enabled():  # the fetch gathers: every rank or none
            needs_weights = bool(rt.ranks.agree([float(needs_weights)], "max",
                                                       f"all_reduce: does {unit.name}'s backward need weights")[0])
        if torch.is_grad_enabled():
            flat, _, idx = _tensors_requiring_grad(output)
            before_backward = ((lambda grad: prefetcher.fetch_for_use(unit, backward=True)) if needs_weights
                               else (lambda grad: weights.shape_only()))
            for i in idx:
                flat[i].register_hook(before_backward)
        prefetcher.release_after_use(unit, backward=False)
        return None

    return [
        module.register_forward_pre_hook(pre_forward, with_kwargs=True),
        module.register_forward_hook(post_forward, with_kwargs=True),
    ]
