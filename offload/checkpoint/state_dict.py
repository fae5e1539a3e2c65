"""torch's state dicts of an engine: `engine.state_dict()` (full, or sharded as DTensors: [Note: sharded
state dicts]) with real values from every tier, `engine.load_state_dict()` into the units' homes, and the
guard that keeps the wrapped model's own state_dict() and load_state_dict() from reading or writing
around the tiers. Also the names the checkpoint modules use: param_names, state_entries."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch.nn.modules.module import _IncompatibleKeys

from offload.state.homes import write_slots
from offload.step.pipeline import EngineClosed

# [Note: sharded state dicts]
# engine.state_dict(sharded=True), over ranks, holds on each rank only its part of every parameter, as
# FSDP2's sharded state dict does: a DTensor on a 1-D CPU mesh of the default group, Shard(0) (a 0-dim
# parameter: Replicate), its local part the rank's torch.chunk slice along dim 0. Its values are the
# same as the full state dict's; it is made unit by unit (each unit whole once, then sliced), so a rank
# never holds more than its slices and one unit. torch.distributed.checkpoint saves it (each rank its
# slices) and loads it into such a dict at another world size, or into a full one in one process;
# load_state_dict takes either (a DTensor is gathered whole, one unit at a time). The slices are not the
# engine's own windows (those cut across parameters): the state dict follows torch's layout, so any
# torch tool reads it. Needs a backend that carries CPU tensors (gloo); NCCL alone is refused.


def param_names(model) -> dict:
    """parameter -> every name it has in `model` (tied parameters: several), in named_parameters order."""
    names: dict = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(n)
    return names


def state_entries(model, params: bool = True):
    """(name, tensor, is_parameter) in model.state_dict()'s order: parameters (tied ones under each name)
    and persistent buffers."""
    for prefix, m in model.named_modules(remove_duplicate=False):
        p = f"{prefix}." if prefix else ""
        if params:
            yield from ((p + n, t, True) for n, t in m._parameters.items() if t is not None)
        yield from ((p + n, t, False) for n, t in m._buffers.items()
                    if t is not None and n not in m._non_persistent_buffers_set)


def state_dict(engine, prefix: str = "", sharded: bool = False) -> dict:
    """The wrapped module's state_dict() keys with real values on the CPU, from every tier: fp32 masters of
    trainable parameters, frozen ones upcast to fp32 (as FSDP's full state dict gives the original fp32
    parameters), tied names sharing one tensor, persistent buffers as they are. sharded: each parameter a
    DTensor whose local part is this rank's dim-0 slice ([Note: sharded state dicts])."""
    shard = _sharder() if sharded else None
    values, last, last_shard = {}, None, None
    for name, value in engine.state_items():  # unit by unit: one unit whole at a time
        if shard is not None and value is not last:  # tied names yield one tensor, one after another
            last, last_shard = value, shard(value)
        values[name] = last_shard if shard is not None else value
    return OrderedDict((prefix + name, values[name] if is_param else t.detach().cpu())
                       for name, t, is_param in state_entries(engine.module))


def _sharder():
    """value -> DTensor of this rank's dim-0 slice of it ([Note: sharded state dicts])."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("state_dict(sharded=True) needs torch.distributed initialized (one part per rank); "
                         "in one process call state_dict(), which is the whole model")
    if "gloo" not in str(dist.get_backend()):
        raise ValueError(f"state_dict(sharded=True): the process group's backend is {dist.get_backend()!r}; its "
                         "parts are CPU tensors, which need gloo (init_process_group('cpu:gloo,cuda:nccl') "
                         "gives both); or call state_dict() for the full one")
    DTensor, Shard, Replicate = _dtensor_types()
    from torch.distributed.device_mesh import init_device_mesh

    mesh, rank, world = init_device_mesh("cpu", (dist.get_world_size(),)), dist.get_rank(), dist.get_world_size()

    def shard(value: torch.Tensor):
        if value.dim() == 0:
            return DTensor.from_local(value, mesh, [Replicate()], run_check=False)
        parts = torch.chunk(value, world, dim=0)  # DTensor's Shard(0) layout: ceil(n / world) rows each
        local = parts[rank].clone() if rank < len(parts) else value.new_empty((0, *value.shape[1:]))
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=value.shape,
                                  stride=value.stride())
    return shard


def _dtensor_types():
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # torch 2.4
        from torch.distributed._tensor import DTensor, Replicate, Shard
    return DTensor, Shard, Replicate


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A state dict's value whole on this rank: a DTensor gathered (a collective), else itself."""
    if torch.distributed.is_available() and hasattr(t, "full_tensor") and hasattr(t, "placements"):
        return t.full_tensor()
    return t


def load_state_dict(engine, sd: dict, strict: bool = True) -> _IncompatibleKeys:
    """Writes parameters into their homes (masters, and weights in the compute dtype) and buffers in place,
    with torch's strict semantics; optimizer moments and step counts are untouched. Everything is checked
    before anything is written."""
    engine.pipeline.checkpoint_state()  # between steps, engine usable
    shapes = {s.param: s.shape for u in engine.units for s in u.slots}
    entries = list(state_entries(engine.module))
    missing = [n for n, _, _ in entries if n not in sd]
    expected = {n for n, _, _ in entries}
    unexpected = [k for k in sd if k not in expected]
    errors = []
    if strict and unexpected:
        errors.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ". ")
    if strict and missing:
        errors.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ". ")
    for n, t, is_param in entries:
        shape = shapes[t] if is_param else t.shape
        if n in sd and tuple(sd[n].shape) != tuple(shape):
            errors.append(f"size mismatch for {n}: copying a param with shape {tuple(sd[n].shape)} from checkpoint, "
                          f"the shape in current model is {tuple(shape)}.")
    if errors:
        raise RuntimeError("Error(s) in loading state_dict for Engine:\n\t" + "\n\t".join(errors))
    names = param_names(engine.module)
    source = {p: sd[next(n for n in ns if n in sd)] for p, ns in names.items() if any(n in sd for n in ns)}

    def fill(dst, slot, lo, hi):
        dst.copy_(value[slot.param][lo:hi])

    engine.prefetcher.release_all()
    for unit in engine.units:  # a sharded state dict's DTensors whole one unit at a time, in the same order on every rank
        value = {s.param: _whole(source[s.param]).detach().reshape(-1) for s in unit.slots if s.param in source}
        st, given = engine.states[unit.index], [s for s in unit.slots if s.param in value]
        if st is not None:
            write_slots(engine.rt, engine.weights[unit.index], st, "master", [s for s in given if s.trainable], fill,
                        keep=True)
        write_slots(engine.rt, engine.weights[unit.index], st, "weight", given, fill, keep=True)
    with torch.no_grad():
        for n, t, is_param in entries:
            if not is_param and n in sd:
                t.copy_(sd[n])
    return _IncompatibleKeys(missing, unexpected)


CLOSED = ("this model's weights were held by an offload engine that is now closed: use close(keep_weights=True), "
          "full_state_dict() or a saved directory (offload train --save)")


def guard_module(model, closed: bool = False) -> list:
    """model.state_dict() would return the empty placeholders of released parameters, and
    model.load_state_dict() would write around the tiers: on every module holding parameters both raise,
    pointing at the engine's own. closed: the engine is closed and the parameters empty for good: those two
    and the module's forward raise EngineClosed, saying how to keep the weights. Returns the hook handles."""
    if closed:
        def refuse(module, *args, **kwargs):
            raise EngineClosed(f"{type(module).__name__}: {CLOSED}")

        return [h for m in model.modules() if any(True for _ in m.parameters())
                for h in (m.register_forward_pre_hook(refuse), m.register_state_dict_pre_hook(refuse),
                          m.register_load_state_dict_pre_hook(refuse))]

    def refuse_save(module, *args):
        raise RuntimeError(f"{type(module).__name__}.state_dict(): this model is wrapped by offload, whose "
                           "parameters live in the engine's tiers (here: empty placeholders); use engine.state_dict() "
                           "(real fp32 values from every tier) or engine.save_checkpoint(dir)")

    def refuse_load(module, *args):
        raise RuntimeError(f"{type(module).__name__}.load_state_dict(): this model is wrapped by offload, whose "
                           "parameters live in the engine's tiers; use engine.load_state_dict(state_dict) or "
                           "engine.load_checkpoint(path)")

    return [h for m in model.modules() if any(True for _ in m.parameters())
            for h in (m.register_state_dict_pre_hook(refuse_save), m.register_load_state_dict_pre_hook(refuse_load))]
