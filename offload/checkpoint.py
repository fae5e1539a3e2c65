"""Checkpoints: everything a run needs to continue exactly, streamed chunk by chunk from whichever tier
holds it, written atomically, verified on load, loadable at another placement: `engine.save_checkpoint`,
`engine.load_checkpoint`; also `engine.state_dict()` / `load_state_dict()` with real values.

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

[Note: the format] (format_version 1)
    <dir>/<name>/manifest.json   describes every tensor, below
    <dir>/<name>/rank0.bin       raw little-endian bytes (one data file per rank; one rank today)
    <dir>/latest                 the name of the newest complete checkpoint
manifest.json: {"format": "offload-checkpoint", "format_version", "world_size", "zero_stage", "precision",
the counters above, "pending_update", "accumulator", "config", "rng": {rank: ...}, "files": {file: {"rank",
"nbytes"}}, "extra", "tensors": {name: {"shape", "dtype" (compute dtype), "trainable", "aliases" (the tied
names of the same parameter), "step", "has_grad", and per kind (master, exp_avg, exp_avg_sq, grad; or
weight when frozen) {"dtype", "ranges": [{"begin", "end", "file", "offset", "nbytes", "crc32"}]}}},
"buffers": {name: {"shape", "dtype", "ranges"}}}. A range holds elements [begin, end) of the flattened
tensor at bytes [offset, offset + nbytes) of `file`, with the crc32 of those bytes; it is at most one
chunk. The engine's flat buffers, their padding and (later) their shards are not part of the format, so
any placement, and any world size, reads a tensor by name and element range.

[Note: atomic saves]
Everything is written under <dir>/.tmp-<name> and fsynced; the directory is renamed to <dir>/<name> and
the parent directory fsynced; only then is `latest` replaced (a temporary file, fsynced, renamed). A save
interrupted at any point (an exception, SIGKILL, power loss) leaves the previous checkpoint and `latest`
as they were; a later save of the same name removes the leftover. `keep` prunes the oldest complete
checkpoints (by the time they were written), never the one `latest` names.
"""

from __future__ import annotations

import base64
import errno
import json
import logging
import os
import random
import shutil
import sys
import time
import zlib
from collections import OrderedDict

import torch
from torch.nn.modules.module import _IncompatibleKeys

from offload.chunks import chunk_key

log = logging.getLogger("offload")

FORMAT, FORMAT_VERSION = "offload-checkpoint", 1
MANIFEST, LATEST, DATA_FILE = "manifest.json", "latest", "rank0.bin"
STATES = ("master", "exp_avg", "exp_avg_sq")
# Compared on load: a difference is named in a warning (precision must match: it is an error)
CONFIG_KEYS = ("optimizer", "gradient_accumulation_steps", "gradient_clipping", "loss_scale", "lr_schedule",
               "delayed_update", "zero_stage")
VERIFY_BYTES = 8 << 20  # checksums are verified reading this much at a time


class CheckpointError(ValueError):
    """A checkpoint that does not load into this engine; the message names the file, tensor and range."""


# -- save ----------------------------------------------------------------------------------------------

def save(engine, directory: str, name: str | None = None, keep: int | None = None, extra: dict | None = None) -> str:
    """Writes a checkpoint of `engine` to <directory>/<name> atomically ([Note: atomic saves]), points
    <directory>/latest at it and keeps the newest `keep`. Returns its path."""
    counters = engine.pipeline.checkpoint_state()
    accumulator = counters["pending_update"] is not None or counters["micro_step"] > 0
    if name is None:
        name = f"step{counters['step_count']:08d}" + (f"-micro{counters['micro_step']}" if counters["micro_step"] else "")
    if not name or name.startswith(".") or os.sep in name or name == LATEST:
        raise ValueError(f"name={name!r}: a checkpoint name is one path component, not {LATEST!r}, not hidden")
    if keep is not None and keep < 1:
        raise ValueError(f"keep={keep}: must be >= 1 (or None: keep every checkpoint)")
    final, tmp = os.path.join(directory, name), os.path.join(directory, f".tmp-{name}")
    if os.path.lexists(final):
        raise FileExistsError(errno.EEXIST, "a checkpoint of this name exists; pass another name or remove it", final)
    manifest = _manifest_head(engine, counters, accumulator, extra)
    os.makedirs(directory, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save of this name
    os.mkdir(tmp)
    try:
        with _DataFile(tmp, DATA_FILE) as out:
            manifest["tensors"] = _save_parameters(engine, out, accumulator)
            manifest["buffers"] = _save_buffers(engine, out)
            out.sync()
        manifest["files"] = {DATA_FILE: {"rank": engine.rank, "nbytes": out.nbytes}}
        _write_synced(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1).encode())
        _fsync_dir(tmp)
        os.rename(tmp, final)
        _fsync_dir(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _replace(os.path.join(directory, LATEST), f"{name}\n".encode())
    if keep is not None:
        _prune(directory, keep)
    return final


def _manifest_head(engine, counters: dict, accumulator: bool, extra: dict | None) -> dict:
    cfg = engine.cfg
    extra = dict(extra or {})
    pretrained = getattr(sys.modules.get("transformers"), "PreTrainedModel", None)
    if pretrained is not None and isinstance(engine.module, pretrained) and "hf_config" not in extra:
        extra["hf_config"] = json.loads(json.dumps(engine.module.config.to_dict(), default=str))
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise ValueError(f"extra: not JSON-serializable ({e}); pass plain dicts, lists, numbers and strings") from e
    essentials = json.loads(json.dumps(cfg.to_dict()))
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "world_size": 1, "zero_stage": cfg.zero_stage,
            "precision": cfg.precision, **counters, "accumulator": accumulator, "saved_at": time.time(),
            "config": {k: essentials[k] for k in CONFIG_KEYS}, "rng": {str(engine.rank): _rng_state()},
            "extra": extra}


def _save_parameters(engine, out: "_DataFile", accumulator: bool) -> dict:
    """Every parameter's entry, unit by unit, each of its buffers chunk by chunk ([Note: the format])."""
    names = param_names(engine.module)
    tensors: dict = {}
    for unit in engine.units:
        st = engine.states[unit.index]
        steps = {s.offset: n for s, n in zip(st.slots, st.slot_steps)} if st is not None else {}
        got = {st.slots[k].offset for k in st.got_grad} if st is not None else set()
        entry = {}
        for s in unit.slots:
            name, *aliases = names[s.param]
            e = entry[s.offset] = tensors[name] = {"shape": list(s.shape), "dtype": _dtype_name(engine.dtype),
                                                   "trainable": s.trainable, "aliases": aliases}
            if s.trainable:
                e["step"] = steps[s.offset]
                if accumulator:
                    e["has_grad"] = s.offset in got
        kinds = (*STATES, *("grad",) * accumulator) if st is not None else ()
        if any(not s.trainable for s in unit.slots):
            kinds = (*kinds, "weight")
        for kind in kinds:
            slots = [s for s in unit.slots if s.trainable == (kind != "weight")]
            for b, e, t in _windows(engine, unit, kind):
                for s in slots:
                    lo, hi = max(b, s.offset), min(e, s.offset + s.numel)
                    if lo < hi:
                        piece = t[lo - b:hi - b]
                        if kind == "grad":
                            piece = piece.float()  # a one-micro-step accumulator may hold the compute dtype
                        where = entry[s.offset].setdefault(kind, {"dtype": _dtype_name(piece.dtype), "ranges": []})
                        where["ranges"].append(out.write(piece, lo - s.offset, hi - s.offset))
    return tensors


def _save_buffers(engine, out: "_DataFile") -> dict:
    buffers = {}
    for name, b, _ in state_entries(engine.module, params=False):
        t = b.detach().reshape(-1).cpu()
        buffers[name] = {"shape": list(b.shape), "dtype": _dtype_name(b.dtype),
                         "ranges": [out.write(t, 0, t.numel())] if t.numel() else []}
    return buffers


class _DataFile:
    """One rank's data file, written front to back; every range gets its crc32."""

    def __init__(self, directory: str, name: str):
        self.name, self.nbytes = name, 0
        self.f = open(os.path.join(directory, name), "wb")

    def write(self, t: torch.Tensor, begin: int, end: int) -> dict:
        data = _bytes(t)
        self.f.write(data)
        r = {"begin": begin, "end": end, "file": self.name, "offset": self.nbytes, "nbytes": len(data),
             "crc32": zlib.crc32(data)}
        self.nbytes += len(data)
        return r

    def sync(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())

    def __enter__(self) -> "_DataFile":
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


# -- the units' buffers at their homes, chunk by chunk -----------------------------------------------------

def _windows(engine, unit, kind: str, write: bool = False, keep: bool = True):
    """(begin, end, host tensor) over one of the unit's flat buffers (master, exp_avg, exp_avg_sq, grad, or
    weight in the compute dtype), one chunk at a time, from its home: nvme chunks through a pool chunk (a
    key never written reads as zeros: moments before the first step), accelerator-resident ones through a
    host copy, host-resident ones as views. write: the tensor goes back to its home when the caller asks
    for the next one (not after an exception). keep=False: it starts zeroed instead of read."""
    st, w = engine.states[unit.index], engine.weights[unit.index]
    if kind == "weight":
        w.wait_for_write()  # new weights written behind by the last step
        spans, home, key, dtype = w.chunks, w.home, w.key, w.dtype
        flat = w.hbm if w.home == "hbm" else w.dram
    else:
        spans, home, key, dtype = st.windows, st.home, unit.key(kind, engine.rank), torch.float32
        flat = st.t.get(kind)
    for i, (b, e) in enumerate(spans):
        if home != "nvme":
            at_home = st.grad(i) if kind == "grad" else flat[b:e]  # grad: in the accumulator's dtype
            t = at_home.cpu()
            if not keep:
                t.zero_()
            yield b, e, t
            if write and t is not at_home:
                at_home.copy_(t)
            continue
        k = chunk_key(key, i)
        buf = engine.staging.acquire(e - b, dtype, f"checkpoint {k}")
        try:
            if keep and k in engine.store:
                engine.store.read(k, into=buf).wait()
            else:
                buf.zero_()
            yield b, e, buf
            if write:
                engine.store.write(k, buf).wait()
        finally:
            engine.staging.release(buf)


def _write_unit(engine, unit, kind: str, slots, fill, keep: bool) -> None:
    """fill(dst, slot, lo, hi) writes elements [lo, hi) of `slot` into dst, for each slot in `slots`,
    into the unit's `kind` buffer at its home."""
    for b, e, buf in _windows(engine, unit, kind, write=True, keep=keep):
        for s in slots:
            lo, hi = max(b, s.offset), min(e, s.offset + s.numel)
            if lo < hi:
                fill(buf[lo - b:hi - b], s, lo - s.offset, hi - s.offset)


# -- load ------------------------------------------------------------------------------------------------

def resolve(path: str) -> str:
    """The checkpoint at `path`: a checkpoint directory itself, or the one `path/latest` names."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        with open(latest) as f:
            ckpt = os.path.join(path, f.read().strip())
        if not os.path.isfile(os.path.join(ckpt, MANIFEST)):
            raise CheckpointError(f"{latest}: names {ckpt}, which holds no {MANIFEST}")
        return ckpt
    raise FileNotFoundError(errno.ENOENT, f"neither a checkpoint (no {MANIFEST}) nor a directory of checkpoints "
                            f"(no {LATEST})", path)


def read_manifest(ckpt: str) -> dict:
    path = os.path.join(ckpt, MANIFEST)
    with open(path) as f:
        try:
            m = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); the manifest is damaged") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an offload checkpoint manifest (format is not {FORMAT!r})")
    version = m.get("format_version")
    if version != FORMAT_VERSION:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        raise CheckpointError(f"{path}: format_version={version!r}; this offload reads version {FORMAT_VERSION}"
                              + ("; written by a newer offload: upgrade offload to load it" if newer else ""))
    return m


def load(engine, path: str) -> dict:
    """Loads the checkpoint at `path` (or the one `path/latest` names) into `engine`, whatever its
    placement; returns the checkpoint's `extra`. Everything is checked (format, names, shapes, ranges,
    every checksum) before anything in the engine changes."""
    ckpt = resolve(path)
    manifest = read_manifest(ckpt)
    engine.pipeline.checkpoint_state()  # between steps, engine usable
    _check_config(engine.cfg, manifest, ckpt)
    plan = _match_parameters(engine, manifest, ckpt)
    buffers = _match_buffers(engine.module, manifest, ckpt)
    with _Files(ckpt, manifest) as files:
        files.verify_all(manifest)
        engine.pipeline.release_all()  # no fetched copy may outlive the update of its home
        for unit in engine.units:
            _load_unit(engine, unit, {s.offset: plan[(unit.index, s.offset)] for s in unit.slots}, files,
                       manifest["accumulator"])
        for name, (b, entry) in buffers.items():
            value = torch.empty(b.numel(), dtype=_dtype(entry["dtype"]))
            files.read_elements(entry, 0, b.numel(), value, f"buffer {name}")
            b.copy_(value.view(b.shape))
    engine.pipeline.restore(manifest)
    _set_rng_state(manifest["rng"].get(str(engine.rank)))
    return manifest["extra"]


def _load_unit(engine, unit, entries: dict, files: "_Files", accumulator: bool) -> None:
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
            st.grad_dtype = torch.float32  # the accumulator's own dtype (see OptimState.accumulate)
        for kind in (*STATES, *("grad",) * accumulator):
            _write_unit(engine, unit, kind, st.slots, source(kind, "weight") if kind == "master" else source(kind),
                        keep=False)
        st.slot_steps = [entries[s.offset][1].get("step", 0) for s in st.slots]
        if accumulator:
            st.got_grad = {k for k, s in enumerate(st.slots) if entries[s.offset][1].get("has_grad")}
    trainable, frozen = source("master", "weight"), source("weight", "master")
    _write_unit(engine, unit, "weight", unit.slots,
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
                    errors += _check_ranges(f"{name} {kind}", entry[kind], s.numel, manifest["files"])
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
        errors += _check_ranges(f"buffer {name}", theirs[name], ours[name].numel(), manifest["files"])
    if errors:
        raise CheckpointError(f"{ckpt}: does not match this model: " + "; ".join(errors))
    return {name: (ours[name], theirs[name]) for name in ours}


def _check_ranges(what: str, where: dict, numel: int, files: dict) -> list[str]:
    """The ranges must cover elements [0, numel) once, each its bytes in a known file."""
    try:
        itemsize = _dtype(where["dtype"]).itemsize
    except ValueError as e:
        return [f"{what}: {e}"]
    pos = 0
    for r in sorted(where["ranges"], key=lambda r: r["begin"]):
        if r["begin"] != pos or r["end"] <= pos or r["nbytes"] != (r["end"] - pos) * itemsize or r["file"] not in files:
            return [f"{what}: range {r} does not continue at element {pos} in a file of the manifest"]
        pos = r["end"]
    return [] if pos == numel else [f"{what}: ranges cover {pos} of {numel} elements"]


def all_ranges(manifest: dict):
    """(what, range) for every range of the manifest, in file order."""
    found = [(f"{name} {kind} elements [{r['begin']}, {r['end']})", r)
             for name, e in manifest["tensors"].items() for kind, where in e.items() if isinstance(where, dict)
             for r in where["ranges"]]
    found += [(f"buffer {name}", r) for name, e in manifest["buffers"].items() for r in e["ranges"]]
    return sorted(found, key=lambda wr: (wr[1]["file"], wr[1]["offset"]))


class _Files:
    """A checkpoint's data files, open for reading; each one's size checked against the manifest."""

    def __init__(self, ckpt: str, manifest: dict):
        self.fds: dict[str, tuple[int, str]] = {}
        try:
            for name, info in manifest["files"].items():
                path = os.path.join(ckpt, name)
                fd = os.open(path, os.O_RDONLY)
                self.fds[name] = (fd, path)
                size = os.fstat(fd).st_size
                if size != info["nbytes"]:
                    raise CheckpointError(f"{path}: {size} bytes, the manifest says {info['nbytes']} ("
                                          + ("truncated: an interrupted copy or a full disk" if size < info["nbytes"]
                                             else "longer than written") + "); load another checkpoint")
        except BaseException:
            self.close()
            raise

    def verify(self, r: dict, what: str) -> None:
        fd, path = self.fds[r["file"]]
        crc, pos = 0, 0
        while pos < r["nbytes"]:
            data = os.pread(fd, min(VERIFY_BYTES, r["nbytes"] - pos), r["offset"] + pos)
            if not data:
                raise CheckpointError(f"{path}: ends at byte {r['offset'] + pos}, inside {what} (truncated)")
            crc, pos = zlib.crc32(data, crc), pos + len(data)
        if crc != r["crc32"]:
            raise CheckpointError(f"{path}: bytes [{r['offset']}, {r['offset'] + r['nbytes']}) ({what}): crc32 "
                                  f"{crc:#010x}, the manifest says {r['crc32']:#010x}; the file is damaged, load "
                                  "another checkpoint")

    def verify_all(self, manifest: dict) -> None:
        for what, r in all_ranges(manifest):
            self.verify(r, what)

    def read_elements(self, where: dict, lo: int, hi: int, dst: torch.Tensor, what: str) -> None:
        """Elements [lo, hi) of a tensor's `where` ({"dtype", "ranges"}) into dst (any dtype: cast)."""
        dtype = _dtype(where["dtype"])
        for r in where["ranges"]:
            a, z = max(lo, r["begin"]), min(hi, r["end"])
            if a >= z:
                continue
            out = dst[a - lo:z - lo]
            into = out if out.dtype == dtype else torch.empty(z - a, dtype=dtype)
            fd, path = self.fds[r["file"]]
            offset = r["offset"] + (a - r["begin"]) * dtype.itemsize
            view = _bytes(into)
            if os.preadv(fd, [view], offset) != len(view):
                raise CheckpointError(f"{path}: short read at byte {offset} ({what} elements [{a}, {z})); truncated")
            if into is not out:
                out.copy_(into)

    def close(self) -> None:
        for fd, _ in self.fds.values():
            os.close(fd)
        self.fds = {}

    def __enter__(self) -> "_Files":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def verify(ckpt: str, manifest: dict) -> None:
    """Reads every range of the checkpoint and checks its crc32 (and every file's size)."""
    with _Files(ckpt, manifest) as files:
        files.verify_all(manifest)


def iter_weights(ckpt: str, manifest: dict, dtype: torch.dtype):
    """(name, tensor) for every parameter name (tied names too) and persistent buffer of a checkpoint,
    one at a time, checksums verified: masters of trainable parameters, weights of frozen ones, floating
    values as `dtype` (what `offload checkpoint export` writes)."""
    with _Files(ckpt, manifest) as files:
        entries = [(n, e, e.get("master") or e.get("weight"), [n, *e["aliases"]]) for n, e in manifest["tensors"].items()]
        entries += [(n, e, e, [n]) for n, e in manifest["buffers"].items()]
        for name, entry, where, names in entries:
            numel = 1
            for d in entry["shape"]:
                numel *= d
            for r in where["ranges"] if where else []:
                files.verify(r, name)
            value = torch.empty(numel, dtype=_dtype(where["dtype"]) if where else dtype)
            if where:
                files.read_elements(where, 0, numel, value, name)
            value = value.view(entry["shape"])
            if value.is_floating_point():
                value = value.to(dtype)
            for n in names:
                yield n, value


# -- keeping the last K, and `latest` ------------------------------------------------------------------------

def list_checkpoints(directory: str) -> list[str]:
    """Names of the complete checkpoints in `directory`, oldest first (by when their manifest was written)."""
    found = []
    for name in os.listdir(directory):
        manifest = os.path.join(directory, name, MANIFEST)
        if not name.startswith(".") and os.path.isfile(manifest):
            found.append((os.stat(manifest).st_mtime_ns, name))
    return [name for _, name in sorted(found)]


def _prune(directory: str, keep: int) -> None:
    with open(os.path.join(directory, LATEST)) as f:
        latest = f.read().strip()
    for name in os.listdir(directory):
        if name.startswith(".del-"):  # a prune interrupted earlier
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    for name in list_checkpoints(directory)[:-keep]:
        if name != latest:
            trash = os.path.join(directory, f".del-{name}")  # renamed first: never a half-removed checkpoint
            os.rename(os.path.join(directory, name), trash)
            shutil.rmtree(trash, ignore_errors=True)


def _write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _replace(path: str, data: bytes) -> None:
    """Replaces the file at `path` atomically: readers see the old or the new content, never a part."""
    tmp = path + ".tmp"
    try:
        _write_synced(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(os.path.dirname(path) or ".")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def state_dict(engine, prefix: str = "") -> dict:
    """The wrapped module's state_dict() keys with real values on the CPU, from every tier: fp32 masters of
    trainable parameters, frozen ones upcast to fp32 (as FSDP's full state dict gives the original fp32
    parameters), tied names sharing one tensor, persistent buffers as they are."""
    values = dict(engine.state_items())
    return OrderedDict((prefix + name, values[name] if is_param else t.detach().cpu())
                       for name, t, is_param in state_entries(engine.module))


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
    value = {p: sd[next(n for n in ns if n in sd)].detach().reshape(-1) for p, ns in names.items()
             if any(n in sd for n in ns)}

    def fill(dst, slot, lo, hi):
        dst.copy_(value[slot.param][lo:hi])

    engine.pipeline.release_all()
    for unit in engine.units:
        st, given = engine.states[unit.index], [s for s in unit.slots if s.param in value]
        if st is not None:
            _write_unit(engine, unit, "master", [s for s in given if s.trainable], fill, keep=True)
        _write_unit(engine, unit, "weight", given, fill, keep=True)
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


def _bytes(t: torch.Tensor):
    """The bytes of a contiguous tensor, without a copy (numpy shares its memory; writable)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype")
    return dtype


def _few(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")
