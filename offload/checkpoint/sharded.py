"""Checkpoints: everything a run needs to continue exactly, streamed chunk by chunk from whichever tier
holds it, written atomically, verified on load, loadable at another placement: `engine.save_checkpoint`,
`engine.load_checkpoint`; also `engine.state_dict()` / `load_state_dict()` with real values. The files
and the manifest are offload.checkpoint.format's ([Note: the format], [Note: atomic saves]).

[Note: what a checkpoint holds]
Per parameter, by name: its fp32 master, exp_avg and exp_avg_sq and its own Adam step count (trainable),
or its weight in the compute dtype (frozen). The compute-dtype weights of trainable parameters are not
stored: they are their masters rounded to nearest even, which is exactly what CPU Adam writes. The
model's persistent buffers. The step pipeline's counters: step_count (also the lr schedule's position),
micro_step, loss_scale, good_steps, skipped_steps. With delayed_update, the accepted update not applied
yet is saved as it is (its lr, its grad scale and the gradient in the accumulator), not flushed:
flushing would change the run that saves (its next forward would see that update one step early).
Saved between the micro-steps of an accumulation window, the fp32 gradient accumulator is saved too
(with micro_step), so the window completes after the load. RNG states (torch CPU, CUDA when present,
python's random, numpy's global generator), the config's essentials (precision must match on load; other
differences are named in a warning) and `extra`, the caller's JSON state (offload train keeps its data
position there; `hf_config` and `hf_names` there feed `offload checkpoint export`).

[Note: ranks]
Over several ranks every rank calls save and load. zero_stage 0: every rank holds the same states, rank 0
writes them all (the others' data files are empty). zero_stage 1-3: each rank writes the optimizer-state
windows it holds to its own rank<r>.bin (stage 3: also its chunks of the frozen weights); rank 0 writes
the other frozen weights and the buffers (every rank holds those alike) and merges the ranks' ranges into
one manifest. Load: each rank reads the element
ranges of the windows it holds now, whichever files hold them, so a checkpoint resumes at another world
size or stage (2 ranks -> 1, 1 -> 4, stage 0 -> 2). The directory must be one every rank reaches (one
machine, or a shared filesystem). RNG states are per rank; a rank the checkpoint has none for keeps its own.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import sys
import time
import uuid
from collections import OrderedDict

import torch
from torch.nn.modules.module import _IncompatibleKeys

from offload.checkpoint import format as fmt
from offload.checkpoint.format import CheckpointError
from offload.state.materialize import unit_buffers, write_slots

log = logging.getLogger("offload")

STATES = ("master", "exp_avg", "exp_avg_sq")
# Compared on load: a difference is named in a warning (precision must match: it is an error)
CONFIG_KEYS = ("optimizer", "gradient_accumulation_steps", "gradient_clipping", "loss_scale", "lr_schedule",
               "delayed_update", "zero_stage")


# -- save ----------------------------------------------------------------------------------------------

def save(engine, directory: str, name: str | None = None, keep: int | None = None, extra: dict | None = None) -> str:
    """Writes a checkpoint of `engine` to <directory>/<name> atomically, points <directory>/latest at it
    and keeps the newest `keep`. Returns its path. Over several ranks every rank calls it ([Note: ranks])."""
    counters = engine.pipeline.checkpoint_state()
    accumulator = counters["pending_update"] is not None or counters["micro_step"] > 0
    if name is None:
        name = f"step{counters['step_count']:08d}" + (f"-micro{counters['micro_step']}" if counters["micro_step"] else "")
    if keep is not None and keep < 1:
        raise ValueError(f"keep={keep}: must be >= 1 (or None: keep every checkpoint)")
    manifest = _manifest_head(engine, counters, accumulator, extra)
    if engine.rt.world > 1:
        return _save_ranks(engine, directory, name, keep, manifest, accumulator)
    with fmt.writing(directory, name) as tmp:
        part = _save_part(engine, tmp, accumulator)
        fmt.write_manifest(tmp, {**manifest, **_merge([part])})
    return _published(engine, directory, name, keep)


def _published(engine, directory: str, name: str, keep: int | None) -> str:
    fmt.point_latest(directory, name)
    if keep is not None:
        fmt.prune(directory, keep, run_id(engine))
    return os.path.join(directory, name)


def run_id(engine) -> str:
    """The run `engine` continues: the one of the last checkpoint it loaded, else its own, made at its first
    save ([Note: a manifest that is checked]: `keep` prunes only this run's checkpoints)."""
    if engine.checkpoint_run_id is None:
        engine.checkpoint_run_id = uuid.uuid4().hex
    return engine.checkpoint_run_id


def _save_part(engine, tmp: str, accumulator: bool) -> dict:
    """This rank's data file in `tmp` and what the manifest says of it ([Note: ranks]): the optimizer states
    of the windows it holds (zero_stage 0: rank 0 holds all, the others write none), and on rank 0 the frozen
    weights and the buffers, which every rank holds alike."""
    first = engine.rt.rank == 0
    with fmt.DataFile(tmp, fmt.data_file_name(engine.rt.rank)) as out:
        tensors = _save_parameters(engine, out, accumulator, states=first or engine.rt.sharded, weights=first)
        buffers = _save_buffers(engine, out) if first else {}
        out.sync()
    return {"tensors": tensors, "buffers": buffers, "files": {out.name: {"rank": engine.rt.rank, "nbytes": out.nbytes}},
            "rng": {str(engine.rt.rank): _rng_state()}}


def _merge(parts: list[dict]) -> dict:
    """The manifest's tensors, buffers, files and rng from every rank's part (rank 0's first): each tensor's
    ranges of a kind are the union of the ranks' ranges, in element order."""
    tensors = json.loads(json.dumps(parts[0]["tensors"]))
    for part in parts[1:]:
        for name, entry in part["tensors"].items():
            for kind in (*STATES, "grad", "weight"):  # weight: stage 3's frozen chunks
                if kind in entry:
                    where = tensors[name].setdefault(kind, {"dtype": entry[kind]["dtype"], "ranges": []})
                    where["ranges"] += entry[kind]["ranges"]
    for entry in tensors.values():
        for kind in (*STATES, "grad", "weight"):
            if kind in entry:
                entry[kind]["ranges"].sort(key=lambda r: r["begin"])
    return {"tensors": tensors, "buffers": parts[0]["buffers"],
            "files": {k: v for p in parts for k, v in p["files"].items()},
            "rng": {k: v for p in parts for k, v in p["rng"].items()}}


def _save_ranks(engine, directory: str, name: str, keep: int | None, manifest: dict, accumulator: bool) -> str:
    """[Note: ranks] Over several ranks (a directory every rank can reach): rank 0 makes the temporary
    directory, every rank writes its part into it, rank 0 merges the parts into the manifest and publishes
    the checkpoint. An error on any rank is raised on every rank, and nothing is published."""
    import torch.distributed as dist

    dist.barrier()  # every rank finished the step being saved
    box: list = [None]
    if engine.rt.rank == 0:
        try:
            box = [fmt.begin(directory, name)]
        except Exception as e:
            box = [f"{type(e).__name__}: {e}"]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise CheckpointError(f"saving {os.path.join(directory, name)}: {box[0]}")
    final, tmp = box[0]
    try:
        part = _save_part(engine, tmp, accumulator)
    except Exception as e:
        part = f"rank {engine.rt.rank}: {type(e).__name__}: {e}"
    parts = [None] * engine.rt.world if engine.rt.rank == 0 else None
    dist.gather_object(part, parts, dst=0)
    outcome = [None]
    if engine.rt.rank == 0:
        try:
            failed = [p for p in parts if isinstance(p, str)]
            if failed:
                raise CheckpointError(f"saving {final}: " + "; ".join(failed) + "; nothing was published")
            fmt.write_manifest(tmp, {**manifest, "world_size": engine.rt.world, **_merge(parts)})
            fmt.commit(tmp, final)
            outcome = [_published(engine, directory, name, keep)]
        except BaseException as e:
            fmt.abort(tmp)
            outcome = [f"{type(e).__name__}: {e}"]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0].startswith(final):
        return outcome[0]
    raise CheckpointError(outcome[0])


def _manifest_head(engine, counters: dict, accumulator: bool, extra: dict | None) -> dict:
    cfg = engine.rt.cfg
    extra = dict(extra or {})
    pretrained = getattr(sys.modules.get("transformers"), "PreTrainedModel", None)
    if pretrained is not None and isinstance(engine.module, pretrained) and "hf_config" not in extra:
        extra["hf_config"] = json.loads(json.dumps(engine.module.config.to_dict(), default=str))
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise ValueError(f"extra: not JSON-serializable ({e}); pass plain dicts, lists, numbers and strings") from e
    essentials = json.loads(json.dumps(cfg.to_dict()))
    return {"format": fmt.FORMAT, "format_version": fmt.FORMAT_VERSION, "world_size": engine.rt.world,
            "zero_stage": cfg.zero_stage, "precision": cfg.precision, **counters, "accumulator": accumulator,
            "saved_at": time.time(), "config": {k: essentials[k] for k in CONFIG_KEYS}, "extra": extra,
            "run_id": run_id(engine)}


def _save_parameters(engine, out: fmt.DataFile, accumulator: bool, states: bool = True, weights: bool = True) -> dict:
    """Every parameter's entry, unit by unit, each of its buffers chunk by chunk ([Note: the format]):
    `states` the optimizer's (the windows this rank holds), `weights` the frozen parameters'."""
    names = param_names(engine.module)
    tensors: dict = {}
    for unit in engine.units:
        st = engine.states[unit.index]
        steps = {s.offset: n for s, n in zip(st.slots, st.slot_steps)} if st is not None else {}
        got = {st.slots[k].offset for k in st.got_grad} if st is not None else set()
        entry = {}
        for s in unit.slots:
            name, *aliases = names[s.param]
            meta = entry[s.offset] = tensors[name] = {"shape": list(s.shape), "dtype": fmt.dtype_name(engine.rt.dtype),
                                                      "trainable": s.trainable, "aliases": aliases}
            if s.record is not None:  # its record's bytes as s.numel elements ([Note: quantized weights as records])
                meta.update(quantized=s.record.kind, quantized_elements=s.numel, quantized_params=s.record.numel,
                            quantization=s.record.spec())
            if s.trainable:
                meta["step"] = steps[s.offset]
                if accumulator:
                    meta["has_grad"] = s.offset in got
        kinds = (*STATES, *("grad",) * accumulator) if st is not None and states else ()
        if (weights or engine.weights[unit.index].partitioned) and any(not s.trainable for s in unit.slots):
            kinds = (*kinds, "weight")
        for kind in kinds:
            slots = [s for s in unit.slots if s.trainable == (kind != "weight")]
            for b, e, t in unit_buffers(engine, unit, kind):
                for s in slots:
                    lo, hi = max(b, s.offset), min(e, s.offset + s.numel)
                    if lo < hi:
                        piece = t[lo - b:hi - b]
                        if kind == "grad":
                            piece = piece.float()  # a one-micro-step accumulator may hold the compute dtype
                        where = entry[s.offset].setdefault(kind, {"dtype": fmt.dtype_name(piece.dtype), "ranges": []})
                        where["ranges"].append(out.write(piece, lo - s.offset, hi - s.offset))
    return tensors


def _save_buffers(engine, out: fmt.DataFile) -> dict:
    buffers = {}
    for name, b, _ in state_entries(engine.module, params=False):
        t = b.detach().reshape(-1).cpu()
        buffers[name] = {"shape": list(b.shape), "dtype": fmt.dtype_name(b.dtype),
                         "ranges": [out.write(t, 0, t.numel())] if t.numel() else []}
    return buffers


# -- load ------------------------------------------------------------------------------------------------

def load(engine, path: str) -> dict:
    """Loads the checkpoint at `path` (or the one `path/latest` names) into `engine`, whatever its
    placement; returns the checkpoint's `extra`. Everything is checked (format, names, shapes, ranges,
    every checksum) before anything in the engine changes."""
    ckpt = fmt.resolve(path)
    manifest = fmt.read_manifest(ckpt)
    engine.pipeline.checkpoint_state()  # between steps, engine usable
    _check_config(engine.rt.cfg, manifest, ckpt)
    plan = _match_parameters(engine, manifest, ckpt)
    buffers = _match_buffers(engine.module, manifest, ckpt)
    with fmt.Reader(ckpt, manifest) as files:
        files.verify_all(manifest)
        try:
            _write_all(engine, manifest, plan, buffers, files)
        except BaseException as e:
            _fail_half_loaded(engine, ckpt, e)
            raise
    _set_rng_state(manifest["rng"].get(str(engine.rt.rank)))
    engine.checkpoint_run_id = manifest.get("run_id") or run_id(engine)  # the run it continues
    return manifest["extra"]


def _write_all(engine, manifest: dict, plan: dict, buffers: dict, files: fmt.Reader) -> None:
    """The checkpoint's states into the units' homes, its buffers into the module, its counters into the
    step pipeline: the part of a load that changes the engine."""
    engine.prefetcher.release_all()  # no fetched copy may outlive the update of its home
    for unit in engine.units:
        _load_unit(engine, unit, {s.offset: plan[(unit.index, s.offset)] for s in unit.slots}, files,
                   manifest["accumulator"])
    for name, (b, entry) in buffers.items():
        value = torch.empty(b.numel(), dtype=fmt.dtype_of(entry["dtype"]))
        files.read_elements(entry, 0, b.numel(), value, f"buffer {name}")
        b.copy_(value.view(b.shape))
    engine.pipeline.restore(manifest)


# [Note: a load that fails half-way]
# Everything a load can check (manifest, names, shapes, ranges, every crc32) is checked before the first
# write; what can still fail after it is I/O (a swap write's ENOSPC or EIO, a file shortened while read).
# Staging the whole checkpoint beside the engine's states to swap it in at once would double their disk or
# memory, so a load that fails after its first write fails the engine, as a failed step does: every later
# forward, backward, step or save is refused with the cause, and the user loads into a new engine.

def _fail_half_loaded(engine, ckpt: str, error: BaseException) -> None:
    engine.pipeline.fail(f"loading the checkpoint {ckpt} failed after it began writing the engine's states "
                         f"({type(error).__name__}: {error}); weights and optimizer states are partly the "
                         "checkpoint's, so this engine trains no further. close() it and load the checkpoint "
                         "into a new engine (offload.initialize)")


def _load_unit(engine, unit, entries: dict, files: fmt.Reader, accumulator: bool) -> None:
    def source(*kinds):
        """Fills from the first of `kinds` the parameter's entry has (a parameter frozen in the checkpoint
        and trainable here takes its master from its weight, and zero moments)."""
        def fill(dst, slot, lo, hi):
            name, entry = entries[slot.offset]
            kind = next((k for k in kinds if k in entry), None)
            if kind is None:
                dst.zero_()
            else:
                files.read_elements(entry[kind], lo, hi, dst, f"{name} {kind}")
        return fill

    st = engine.states[unit.index]
    if st is not None:
        if accumulator:
            st.grad_dtype = torch.float32  # the accumulator's own dtype (see offload.step.accumulator.accumulate)
        for kind in (*STATES, *("grad",) * accumulator):
            write_slots(engine, unit, kind, st.slots, source(kind, "weight") if kind == "master" else source(kind),
                        keep=False)
        st.slot_steps = [entries[s.offset][1].get("step", 0) for s in st.slots]
        if accumulator:
            st.got_grad = {k for k, s in enumerate(st.slots) if entries[s.offset][1].get("has_grad")}
    trainable, frozen = source("master", "weight"), source("weight", "master")
    write_slots(engine, unit, "weight", unit.slots,
                lambda dst, s, lo, hi: (trainable if s.trainable else frozen)(dst, s, lo, hi), keep=False)


def _check_config(cfg, manifest: dict, ckpt: str) -> None:
    ours = json.loads(json.dumps(cfg.to_dict()))
    theirs = manifest["config"]
    if manifest["precision"] != cfg.precision:
        raise CheckpointError(f"precision={cfg.precision!r}: the checkpoint {ckpt} was trained in "
                              f"{manifest['precision']!r} (its weights and loss scale); resume with that precision")
    if manifest["pending_update"] is not None and not cfg.delayed_update:
        raise CheckpointError(f"delayed_update=False: the checkpoint {ckpt} holds a delayed update not applied "
                              "yet; resume with delayed_update: true")
    gas = theirs["gradient_accumulation_steps"]
    if manifest["micro_step"] and ours["gradient_accumulation_steps"] != gas:
        raise CheckpointError(f"gradient_accumulation_steps={ours['gradient_accumulation_steps']}: the checkpoint "
                              f"{ckpt} was saved after {manifest['micro_step']} of {gas} micro-steps; resume with {gas}")
    differ = [k for k in CONFIG_KEYS if theirs.get(k) != ours[k]]
    if differ:
        log.warning("offload: %s differ from the checkpoint %s (%s); training goes on with this config",
                    ", ".join(differ), ckpt, "; ".join(f"{k}: {theirs.get(k)} -> {ours[k]}" for k in differ))


def _match_parameters(engine, manifest: dict, ckpt: str) -> dict:
    """{(unit index, slot offset): (name, entry)}; raises naming every parameter that does not fit."""
    tensors = manifest["tensors"]
    by_name = {n: name for name, e in tensors.items() for n in (name, *e.get("aliases", []))}
    names = param_names(engine.module)
    plan, used, missing, errors = {}, set(), [], []
    for unit in engine.units:
        for s in unit.slots:
            name = next((by_name[n] for n in names[s.param] if n in by_name), None)
            if name is None:
                missing.append(names[s.param][0])
                continue
            used.add(name)
            entry = tensors[name]
            if list(entry["shape"]) != list(s.shape):
                errors.append(f"{name}: shape {tuple(entry['shape'])} in the checkpoint, {tuple(s.shape)} here")
            for kind in ("master", "exp_avg", "exp_avg_sq", "grad", "weight"):
                if kind in entry:
                    errors += fmt.check_ranges(f"{name} {kind}", entry[kind], s.numel, manifest["files"])
            if s.numel and "master" not in entry and "weight" not in entry:
                errors.append(f"{name}: neither master nor weight in the checkpoint")
            plan[(unit.index, s.offset)] = (name, entry)
    if missing:
        errors.append(f"absent from the checkpoint: {_few(missing)}")
    if set(tensors) - used:
        errors.append(f"absent from this model: {_few(sorted(set(tensors) - used))}")
    if errors:
        raise CheckpointError(f"{ckpt}: does not match this model: " + "; ".join(errors))
    return plan


def _match_buffers(model, manifest: dict, ckpt: str) -> dict:
    ours = {name: b for name, b, _ in state_entries(model, params=False)}
    theirs = manifest["buffers"]
    errors = []
    if set(ours) != set(theirs):
        errors.append(f"buffers differ: absent from the checkpoint {_few(sorted(set(ours) - set(theirs)))}; "
                      f"absent from this model {_few(sorted(set(theirs) - set(ours)))}")
    for name in set(ours) & set(theirs):
        if list(theirs[name]["shape"]) != list(ours[name].shape):
            errors.append(f"buffer {name}: shape {tuple(theirs[name]['shape'])} in the checkpoint, "
                          f"{tuple(ours[name].shape)} here")
        errors += fmt.check_ranges(f"buffer {name}", theirs[name], ours[name].numel(), manifest["files"])
    if errors:
        raise CheckpointError(f"{ckpt}: does not match this model: " + "; ".join(errors))
    return {name: (ours[name], theirs[name]) for name in ours}


# -- state_dict --------------------------------------------------------------------------------------------

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
    shard = _sharder(engine) if sharded else None
    values, last, last_shard = {}, None, None
    for name, value in engine.state_items():  # unit by unit: one unit whole at a time
        if shard is not None and value is not last:  # tied names yield one tensor, one after another
            last, last_shard = value, shard(value)
        values[name] = last_shard if shard is not None else value
    return OrderedDict((prefix + name, values[name] if is_param else t.detach().cpu())
                       for name, t, is_param in state_entries(engine.module))


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

def _sharder(engine):
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
            write_slots(engine, unit, "master", [s for s in given if s.trainable], fill, keep=True)
        write_slots(engine, unit, "weight", given, fill, keep=True)
    with torch.no_grad():
        for n, t, is_param in entries:
            if not is_param and n in sd:
                t.copy_(sd[n])
    return _IncompatibleKeys(missing, unexpected)


def guard_module(model) -> list:
    """model.state_dict() would return the empty placeholders of released parameters, and
    model.load_state_dict() would write around the tiers: on every module holding parameters both raise,
    pointing at the engine's own. Returns the hook handles."""
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


# -- small helpers -------------------------------------------------------------------------------------------

def _rng_state() -> dict:
    version, internal, gauss = random.getstate()
    state = {"python": [version, list(internal), gauss], "torch": _b64(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def _set_rng_state(state: dict | None) -> None:
    if state is None:
        return
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_unb64(s), i)
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def _few(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")
