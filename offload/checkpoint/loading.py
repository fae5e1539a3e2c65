"""Loading a checkpoint into an engine whatever its placement, world size or zero_stage ([Note: ranks] in
offload.checkpoint.saving): `engine.load_checkpoint` runs `load`. Everything is checked (format, names,
shapes, ranges, every checksum) before the first write into the units' homes."""

from __future__ import annotations

import base64
import json
import logging
import random

import torch
from torch import nn

from offload.checkpoint import format as fmt
from offload.checkpoint.format import CheckpointError
from offload.checkpoint.saving import CONFIG_KEYS, SCALES, STATES, run_id
from offload.kernels.quant8 import BLOCK
from offload.checkpoint.state_dict import param_names, state_entries
from offload.plan.config import Config
from offload.plan.units import Unit
from offload.state.homes import slot_pieces, unit_buffers, write_slots
from offload.state.optim import OptimState
from offload.state.residency import WeightHandle
from offload.state.runtime import Runtime
from offload.step.pipeline import StepPipeline

log = logging.getLogger("offload")


def load(engine, path: str) -> dict:
    """Loads the checkpoint at `path` (or the one `path/latest` names) into `engine`, whatever its
    placement; returns the checkpoint's `extra`. Everything is checked (format, names, shapes, ranges,
    every checksum) before anything in the engine changes."""
    ckpt = fmt.resolve(path)
    manifest = fmt.read_manifest(ckpt)
    engine.pipeline.checkpoint_state()  # between steps, engine usable
    _check_config(engine.cfg, manifest, ckpt)
    plan = _match_parameters(engine.module, engine.units, manifest, ckpt)
    buffers = _match_buffers(engine.module, manifest, ckpt)
    with fmt.Reader(ckpt, manifest) as files:
        files.verify_all(manifest)
        try:
            _write_all(engine, manifest, plan, buffers, files)
        except BaseException as e:
            _fail_half_loaded(engine.pipeline, ckpt, e)
            raise
    _set_rng_state(manifest["rng"].get(str(engine.rt.rank)))
    engine.checkpoint_run_id = manifest.get("run_id") or run_id(engine)  # the run it continues
    return manifest["extra"]


def _write_all(engine, manifest: dict, plan: dict, buffers: dict, files: fmt.Reader) -> None:
    """The checkpoint's states into the units' homes, its buffers into the module, its counters into the
    step pipeline: the part of a load that changes the engine."""
    engine.prefetcher.release_all()  # no fetched copy may outlive the update of its home
    for unit in engine.units:
        _load_unit(engine.rt, engine.weights[unit.index], engine.states[unit.index],
                   {s.offset: plan[(unit.index, s.offset)] for s in unit.slots}, files, manifest["accumulator"])
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

def _fail_half_loaded(pipeline: StepPipeline, ckpt: str, error: BaseException) -> None:
    pipeline.fail(f"loading the checkpoint {ckpt} failed after it began writing the engine's states "
                  f"({type(error).__name__}: {error}); weights and optimizer states are partly the "
                  "checkpoint's, so this engine trains no further. close() it and load the checkpoint "
                  "into a new engine (offload.initialize)")


def _load_unit(rt: Runtime, w: WeightHandle, st: OptimState | None, entries: dict, files: fmt.Reader,
               accumulator: bool) -> None:
    """The checkpoint's `entries` ({slot offset: (name, manifest entry)}) into the homes of the unit of
    `w` (its weight handle) and `st` (its optimizer state, None when it trains nothing)."""
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

    if st is not None:
        if accumulator:
            st.grad_dtype = torch.float32  # the accumulator's own dtype (see offload.step.accumulator.accumulate)
        for kind in st.state_kinds if st.int8 else ():  # codes and scales as stored
            for b, e, t in unit_buffers(rt, w, st, kind, write=True, keep=False):
                for s in st.slots:
                    for name, view, lo, hi in slot_pieces(st, kind, b, e, t, s):
                        (source(name, "weight") if name == "master" else source(name))(view, s, lo, hi)
        for kind in (*(() if st.int8 else STATES), *("grad",) * accumulator):
            write_slots(rt, w, st, kind, st.slots, source(kind, "weight") if kind == "master" else source(kind),
                        keep=False)
        st.slot_steps = [entries[s.offset][1].get("step", 0) for s in st.slots]
        if accumulator:
            st.got_grad = {k for k, s in enumerate(st.slots) if entries[s.offset][1].get("has_grad")}
    trainable, frozen = source("master", "weight"), source("weight", "master")
    write_slots(rt, w, st, "weight", w.unit.slots,
                lambda dst, s, lo, hi: (trainable if s.trainable else frozen)(dst, s, lo, hi), keep=False)


def _check_config(cfg: Config, manifest: dict, ckpt: str) -> None:
    ours = json.loads(json.dumps(cfg.to_dict()))
    theirs = manifest["config"]
    if manifest["precision"] != cfg.precision:
        raise CheckpointError(f"precision={cfg.precision!r}: the checkpoint {ckpt} was trained in "
                              f"{manifest['precision']!r} (its weights and loss scale); resume with that precision")
    if manifest["pending_update"] is not None and not cfg.delayed_update:
        raise CheckpointError(f"delayed_update=False: the checkpoint {ckpt} holds a delayed update not applied "
                              "yet; resume with delayed_update: true")
    states = theirs.get("optimizer", {}).get("states", "fp32")
    if states != cfg.optimizer.states:
        raise CheckpointError(f"optimizer.states={cfg.optimizer.states!r}: the checkpoint {ckpt} holds {states} "
                              f"moments, and they are not converted; resume with optimizer.states {states!r} "
                              f"(--optimizer-states {states})")
    gas = theirs["gradient_accumulation_steps"]
    if manifest["micro_step"] and ours["gradient_accumulation_steps"] != gas:
        raise CheckpointError(f"gradient_accumulation_steps={ours['gradient_accumulation_steps']}: the checkpoint "
                              f"{ckpt} was saved after {manifest['micro_step']} of {gas} micro-steps; resume with {gas}")
    differ = [k for k in CONFIG_KEYS if theirs.get(k) != ours[k]]
    if differ:
        log.warning("offload: %s differ from the checkpoint %s (%s); training goes on with this config",
                    ", ".join(differ), ckpt, "; ".join(f"{k}: {theirs.get(k)} -> {ours[k]}" for k in differ))


def _match_parameters(model: nn.Module, units: list[Unit], manifest: dict, ckpt: str) -> dict:
    """{(unit index, slot offset): (name, entry)}; raises naming every parameter that does not fit."""
    tensors = manifest["tensors"]
    by_name = {n: name for name, e in tensors.items() for n in (name, *e.get("aliases", []))}
    names = param_names(model)
    plan, used, missing, errors = {}, set(), [], []
    for unit in units:
        for s in unit.slots:
            name = next((by_name[n] for n in names[s.param] if n in by_name), None)
            if name is None:
                missing.append(names[s.param][0])
                continue
            used.add(name)
            entry = tensors[name]
            if list(entry["shape"]) != list(s.shape):
                errors.append(f"{name}: shape {tuple(entry['shape'])} in the checkpoint, {tuple(s.shape)} here")
            for kind in (*STATES, *SCALES, "grad", "weight"):
                if kind in entry:
                    numel = -(-s.numel // BLOCK) if kind in SCALES else s.numel
                    errors += fmt.check_ranges(f"{name} {kind}", entry[kind], numel, manifest["files"])
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




def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def _few(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")
