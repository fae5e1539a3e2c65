"""Module hooks: fetch a unit before its forward and backward, release it after each.

[Note: finding the backward of a module]
Pre-backward: a hook on every output tensor that requires grad fires when the gradient for that output
arrives, just before the module's own backward runs. Post-backward: the module's tensor inputs that
require grad pass through `_PostBackward`, an identity whose backward runs once the gradients of all
those inputs exist, i.e. after every autograd node between the inputs and the outputs ran. A unit
whose inputs need no gradient (the embedding) is released when backward() ends. Under activation
checkpointing the recomputed forward fires the forward hooks again; in backward they fetch but do not
release, since the recomputed forward's own backward follows at once.
"""

from __future__ import annotations

import time

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


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


def register(engine, unit, module: torch.nn.Module) -> list:
    """Hooks `module` (the unit's root or a module using its tied parameters) to fetch/release `unit`."""
    starts: list[float] = []  # forward start times (a stack: a module may call itself)

    def pre_forward(mod, args, kwargs):
        engine.fetch_for_use(unit)
        starts.append(time.perf_counter())
        if not torch.is_grad_enabled():
            return None
        flat, spec, idx = _tensors_requiring_grad((args, kwargs))
        if not idx:
            return None
        wrapped = _PostBackward.apply(lambda: engine.release_after_use(unit, backward=True), *[flat[i] for i in idx])
        wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
        for i, t in zip(idx, wrapped):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def post_forward(mod, args, kwargs, output):
        if starts:
            engine.telemetry.span("compute", f"forward {unit.name}", starts.pop(), time.perf_counter())
        if torch.is_grad_enabled():
            flat, _, idx = _tensors_requiring_grad(output)
            for i in idx:
                flat[i].register_hook(lambda grad: engine.fetch_for_use(unit, backward=True))
        engine.release_after_use(unit, backward=False)
        return None

    return [
        module.register_forward_pre_hook(pre_forward, with_kwargs=True),
        module.register_forward_hook(post_forward, with_kwargs=True),
    ]
