"""Saving a checkpoint: everything a run needs to continue exactly, streamed chunk by chunk from whichever
tier holds it and written atomically: `engine.save_checkpoint` runs `save`. The files and the manifest are
offload.checkpoint.format's ([Note: the format], [Note: atomic saves]); offload.checkpoint.loading reads
them back at any placement and world size, offload.checkpoint.state_dict gives torch's state dicts."""

from __future__ import annotations

import base64
import json
import os
import random
import sys
import time
import uuid

import torch
from torch import nn

from offload.checkpoint import format as fmt
from offload.checkpoint.datafile import DataFile
from offload.checkpoint.format import CheckpointError
from offload.checkpoint.state_dict import param_names, state_entries
from offload.plan.config import Config
from offload.state.homes import slot_pieces, unit_buffers

# [Note: what a checkpoint holds]
# Per parameter, by name: its fp32 master, exp_avg and exp_avg_sq and its own Adam step count (trainable),
# or its weight in the compute dtype (frozen). The compute-dtype weights of trainable parameters are not
# stored: they are their masters rounded to nearest even, which is exactly what CPU Adam writes. The
# model's persistent buffers. The step pipeline's counters: step_count (also the lr schedule's position),
# micro_step, loss_scale, good_steps, skipped_steps. With delayed_update, the accepted update not applied
# yet is saved as it is (its lr, its grad scale and the gradient in the accumulator), not flushed:
# flushing would change the run that saves (its next forward would see that update one step early).
# Saved between the micro-steps of an accumulation window, the fp32 gradient accumulator is saved too
# (with micro_step), so the window completes after the load. RNG states (torch CPU, CUDA when present,
# python's random, numpy's global generator), the config's essentials (precision must match on load; other
# differences are named in a warning) and `extra`, the caller's JSON state (offload train keeps its data
# position there; `hf_config` and `hf_names` there feed `offload checkpoint export`).

# [Note: ranks]
# Over several ranks every rank calls save and load. zero_stage 0: every rank holds the same states, rank 0
# writes them all (the others' data files are empty). zero_stage 1-3: each rank writes the optimizer-state
# windows it holds to its own rank<r>.bin (stage 3: also its chunks of the frozen weights); rank 0 writes
# the other frozen weights and the buffers (every rank holds those alike) and merges the ranks' ranges into
# one manifest. Load: each rank reads the element
# ranges of the windows it holds now, whichever files hold them, so a checkpoint resumes at another world
# size or stage (2 ranks -> 1, 1 -> 4, stage 0 -> 2). The directory must be one every rank reaches (one
# machine, or a shared filesystem). RNG states are per rank; a rank the checkpoint has none for keeps its own.

STATES = ("master", "exp_avg", "exp_avg_sq")
SCALES = ("exp_avg_absmax", "exp_avg_sq_absmax")  # int8 moments' block scales ([Note: int8 optimizer states])
# Compared on load: a difference is named in a warning (precision must match: it is an error)
CONFIG_KEYS = ("optimizer", "gradient_accumulation_steps", "gradient_clipping", "loss_scale", "lr_schedule",
               "delayed_update", "zero_stage")


def save(engine, directory: str, name: str | None = None, keep: int | None = None, extra: dict | None = None) -> str:
    """Writes a checkpoint of `engine` to <directory>/<name> atomically, points <directory>/latest at it
    and keeps the newest `keep`. Returns its path. Over several ranks every rank calls it ([Note: ranks])."""
    name, manifest, accumulator = prepare(engine, name, keep, extra)
    held = snapshot(engine)
    if engine.rt.world > 1:
        final, tmp = begin_ranks(engine, directory, name)
        try:
            part = save_part(engine, tmp, accumulator, held)
        except Exception as e:
            part = f"rank {engine.rt.rank}: {type(e).__name__}: {e}"
        return finish_ranks(engine, directory, name, keep, manifest, final, tmp, part)
    with fmt.writing(directory, name) as tmp:
        part = save_part(engine, tmp, accumulator, held)
        fmt.write_manifest(tmp, {**manifest, **merge([part])})
    return published(directory, name, keep, manifest["run_id"])


def prepare(engine, name: str | None, keep: int | None, extra: dict | None) -> tuple[str, dict, bool]:
    """(the checkpoint's name, its manifest but the parts', whether the gradient accumulator is saved) at this
    step boundary; refuses a bad `keep` or `extra` before anything is written."""
    counters = engine.pipeline.checkpoint_state()
    accumulator = counters["pending_update"] is not None or counters["micro_step"] > 0
    if name is None:
        name = f"step{counters['step_count']:08d}" + (f"-micro{counters['micro_step']}" if counters["micro_step"] else "")
    if keep is not None and keep < 1:
        raise ValueError(f"keep={keep}: must be >= 1 (or None: keep every checkpoint)")
    manifest = {**_manifest_head(engine.cfg, engine.rt.world, engine.module, counters, accumulator, extra), "run_id": run_id(engine)}
    return name, manifest, accumulator


def snapshot(engine) -> dict:
    """What the checkpoint takes as it is now besides the units' homes: the RNG states, and on rank 0 the
    model's persistent buffers (a forward may change them: batch norm's running statistics)."""
    buffers = {}
    if engine.rt.rank == 0:
        buffers = {name: b.detach().cpu().clone() for name, b, _ in state_entries(engine.module, params=False)}
    return {"rng": _rng_state(), "buffers": buffers}


def published(directory: str, name: str, keep: int | None, run: str) -> str:
    """Points <directory>/latest at the saved checkpoint and keeps the newest `keep` of run `run`."""
    fmt.point_latest(directory, name)
    if keep is not None:
        fmt.prune(directory, keep, run)
    return os.path.join(directory, name)


def run_id(engine) -> str:
    """The run `engine` continues: the one of the last checkpoint it loaded, else its own, made at its first
    save ([Note: a manifest that is checked]: `keep` prunes only this run's checkpoints)."""
    if engine.checkpoint_run_id is None:
        engine.checkpoint_run_id = uuid.uuid4().hex
    return engine.checkpoint_run_id


def save_part(engine, tmp: str, accumulator: bool, held: dict, staging=None, saved=None, hold=None) -> dict:
    """This rank's data file in `tmp` and what the manifest says of it ([Note: ranks]): the optimizer states
    of the windows it holds (zero_stage 0: rank 0 holds all, the others write none), and on rank 0 the frozen
    weights and the buffers, which every rank holds alike; `held`: snapshot()'s. staging: the chunk pool nvme
    homes are read through (the runtime's by default); saved(unit index): called as each unit is written,
    in the order the next step updates them (the last unit first). hold: {unit index: the swap hold
    (SwapStore.hold) its nvme states are read from} ([Note: background saves])."""
    first = engine.rt.rank == 0
    with DataFile(tmp, fmt.data_file_name(engine.rt.rank)) as out:
        tensors = _save_parameters(engine, out, accumulator, states=first or engine.rt.sharded, weights=first,
                                   staging=staging, saved=saved, hold=hold)
        buffers = _save_buffers(held["buffers"], out)
        out.sync()
    return {"tensors": tensors, "buffers": buffers, "files": {out.name: {"rank": engine.rt.rank, "nbytes": out.nbytes}},
            "rng": {str(engine.rt.rank): held["rng"]}}


def merge(parts: list[dict]) -> dict:
    """The manifest's tensors, buffers, files and rng from every rank's part (rank 0's first): each tensor's
    ranges of a kind are the union of the ranks' ranges, in element order."""
    tensors = json.loads(json.dumps(parts[0]["tensors"]))
    for part in parts[1:]:
        for name, entry in part["tensors"].items():
            for kind in (*STATES, *SCALES, "grad", "weight"):  # weight: stage 3's frozen chunks
                if kind in entry:
                    where = tensors[name].setdefault(kind, {"dtype": entry[kind]["dtype"], "ranges": []})
                    where["ranges"] += entry[kind]["ranges"]
    for entry in tensors.values():
        for kind in (*STATES, *SCALES, "grad", "weight"):
            if kind in entry:
                entry[kind]["ranges"].sort(key=lambda r: r["begin"])
    return {"tensors": tensors, "buffers": parts[0]["buffers"],
            "files": {k: v for p in parts for k, v in p["files"].items()},
            "rng": {k: v for p in parts for k, v in p["rng"].items()}}


def begin_ranks(engine, directory: str, name: str) -> tuple[str, str]:
    """[Note: ranks] Over several ranks (a directory every rank can reach), a collective: rank 0 makes the
    temporary directory; (final path, temporary directory) on every rank, where each writes its part
    (save_part), then finish_ranks."""
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
    return box[0]


def finish_ranks(engine, directory: str, name: str, keep: int | None, manifest: dict, final: str, tmp: str,
                 part) -> str:
    """A collective: rank 0 merges the ranks' parts (save_part's, or a rank's error as a string) into the
    manifest and publishes the checkpoint. An error on any rank is raised on every rank, nothing published."""
    import torch.distributed as dist

    parts = [None] * engine.rt.world if engine.rt.rank == 0 else None
    dist.gather_object(part, parts, dst=0)
    outcome = [None]
    if engine.rt.rank == 0:
        try:
            failed = [p for p in parts if isinstance(p, str)]
            if failed:
                raise CheckpointError(f"saving {final}: " + "; ".join(failed) + "; nothing was published")
            fmt.write_manifest(tmp, {**manifest, "world_size": engine.rt.world, **merge(parts)})
            fmt.commit(tmp, final)
            outcome = [published(directory, name, keep, manifest["run_id"])]
        except BaseException as e:
            fmt.abort(tmp)
            outcome = [f"{type(e).__name__}: {e}"]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0].startswith(final):
        return outcome[0]
    raise CheckpointError(outcome[0])


def _manifest_head(cfg: Config, world: int, model: nn.Module, counters: dict, accumulator: bool,
                   extra: dict | None) -> dict:
    """The manifest but its tensors, buffers, files, rng and run_id: the format, the run's config essentials,
    the step pipeline's `counters` and `extra` (a transformers model's config added as hf_config)."""
    extra = dict(extra or {})
    pretrained = getattr(sys.modules.get("transformers"), "PreTrainedModel", None)
    if pretrained is not None and isinstance(model, pretrained) and "hf_config" not in extra:
        extra["hf_config"] = json.loads(json.dumps(model.config.to_dict(), default=str))
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise ValueError(f"extra: not JSON-serializable ({e}); pass plain dicts, lists, numbers and strings") from e
    essentials = json.loads(json.dumps(cfg.to_dict()))
    return {"format": fmt.FORMAT, "format_version": fmt.FORMAT_VERSION, "world_size": world,
            "zero_stage": cfg.zero_stage, "precision": cfg.precision, **counters, "accumulator": accumulator,
            "saved_at": time.time(), "config": {k: essentials[k] for k in CONFIG_KEYS}, "extra": extra}


def _save_parameters(engine, out: DataFile, accumulator: bool, states: bool = True, weights: bool = True,
                     staging=None, saved=None, hold=None) -> dict:
    """Every parameter's entry, unit by unit (the last first), each of its buffers chunk by chunk ([Note: the
    format]): `states` the optimizer's (the windows this rank holds), `weights` the frozen parameters'."""
    names = param_names(engine.module)
    tensors: dict = {}
    entries = {}  # unit index -> {slot offset: its entry}, made in the units' order
    for unit in engine.units:
        st = engine.states[unit.index]
        steps = {s.offset: n for s, n in zip(st.slots, st.slot_steps)} if st is not None else {}
        got = {st.slots[k].offset for k in st.got_grad} if st is not None else set()
        entry = entries[unit.index] = {}
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
    for unit in reversed(engine.units):
        st, entry = engine.states[unit.index], entries[unit.index]
        kinds = (*st.state_kinds, *("grad",) * accumulator) if st is not None and states else ()
        if (weights or engine.weights[unit.index].partitioned) and any(not s.trainable for s in unit.slots):
            kinds = (*kinds, "weight")
        for kind in kinds:
            slots = [s for s in unit.slots if s.trainable == (kind != "weight")]
            kept = (hold or {}).get(unit.index) if kind != "weight" else None  # frozen weights: never rewritten
            for b, e, t in unit_buffers(engine.rt, engine.weights[unit.index], st, kind, staging=staging, hold=kept):
                for s in slots:
                    for name, piece, lo, hi in slot_pieces(st, kind, b, e, t, s):
                        if kind == "grad":
                            piece = piece.float()  # a one-micro-step accumulator may hold the compute dtype
                        where = entry[s.offset].setdefault(name, {"dtype": fmt.dtype_name(piece.dtype), "ranges": []})
                        where["ranges"].append(out.write(piece, lo, hi))
        if saved is not None:
            saved(unit.index)
    return tensors


def _save_buffers(held: dict, out: DataFile) -> dict:
    """The model's persistent buffers as snapshot() held them, into `out`: their manifest entries by name."""
    buffers = {}
    for name, b in held.items():
        t = b.reshape(-1)
        buffers[name] = {"shape": list(b.shape), "dtype": fmt.dtype_name(b.dtype),
                         "ranges": [out.write(t, 0, t.numel())] if t.numel() else []}
    return buffers


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


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()

