"""The checkpoint format on disk: a manifest and data files, written atomically and read back verified.
It knows manifests, files and tensors, not the engine: offload.checkpoint.saving fills them from the units'
homes and offload.checkpoint.loading writes them back; `offload checkpoint inspect|export` read them alone."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil

import torch

try:  # ISA-L's crc32: zlib's polynomial and values, 5x faster on x86 and aarch64 (bench/RESULTS.md)
    from isal.isal_zlib import crc32
except ImportError:
    from zlib import crc32

# [Note: the format]
# format_version 1:
#     <dir>/<name>/manifest.json   describes every tensor, below
#     <dir>/<name>/rank<r>.bin     raw little-endian bytes, one data file per rank that saved
#     <dir>/latest                 the name of the newest complete checkpoint
# manifest.json: {"format": "offload-checkpoint", "format_version", "world_size", "zero_stage", "precision",
# the step pipeline's counters (offload.checkpoint.saving, [Note: what a checkpoint holds]), "pending_update",
# "accumulator", "config", "rng": {rank: ...}, "files": {file: {"rank", "nbytes"}}, "extra", "tensors": {name:
# {"shape", "dtype" (compute dtype), "trainable", "aliases" (the tied names of the same parameter), "step",
# "has_grad", and per kind (master, exp_avg, exp_avg_sq, grad; or weight when frozen) {"dtype", "ranges":
# [{"begin", "end", "file", "offset", "nbytes", "crc32"}]}}}, "buffers": {name: {"shape", "dtype", "ranges"}},
# "run_id", "manifest_sha256"}. A range holds elements [begin, end) of the flattened tensor at bytes [offset,
# offset + nbytes) of `file`, with the crc32 of those bytes; it is at most one chunk. The engine's flat
# buffers, their padding and their windows over ranks are not part of the format, so any placement, and any
# world size, reads a tensor by name and element range (over ranks, a tensor's ranges of one kind may lie in
# several ranks' files).

# [Note: a manifest that is checked]
# "manifest_sha256" is the sha256 of the manifest's canonical JSON (sorted keys, no spaces) without that key,
# so a flipped digit in `step_count`, `loss_scale` or a shape is refused by name, as a flipped data byte is by
# its range's crc32; its structure (every key a load reads, of its type) is checked before anything is used.
# "run_id" names the run that wrote it (a run that loads a checkpoint continues its run): `keep` prunes only
# that run's checkpoints. Checkpoints written before these two fields existed still load, with a one-line
# warning that their manifest is not verified (refusing them would strand a user's earlier runs), and are
# never pruned (no run id says whose they are).

# [Note: atomic saves]
# Everything is written under <dir>/.tmp-<name> and fsynced; the directory is renamed to <dir>/<name> and
# the parent directory fsynced; only then is `latest` replaced (a temporary file, fsynced, renamed). A save
# interrupted at any point (an exception, SIGKILL, power loss) leaves the previous checkpoint and `latest`
# as they were; a later save of the same name removes the leftover. Files are created with O_CREAT|O_EXCL|
# O_NOFOLLOW, so a name planted in the directory (a symlink at `.latest.tmp`) is never written through.
# `latest` holds one path component naming a checkpoint of its own directory; anything else (`../x`, an
# absolute path, a symlink) is refused. `keep` prunes the oldest complete checkpoints of the saving run (by
# the step in their manifests), never the one `latest` names.

FORMAT, FORMAT_VERSION = "offload-checkpoint", 1
MANIFEST, LATEST = "manifest.json", "latest"
VERIFY_BYTES = 8 << 20  # checksums are verified reading this much at a time
DIGEST = "manifest_sha256"
# New files: never through a symlink or over an existing name ([Note: atomic saves])
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)

log = logging.getLogger("offload")


class CheckpointError(ValueError):
    """A checkpoint that does not load; the message names the file, the tensor and the range."""


# -- writing ---------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def writing(directory: str, name: str):
    """The temporary directory to write checkpoint `name` into ([Note: atomic saves]): when the block ends
    it is fsynced and renamed to <directory>/<name>; if the block raises, it is removed."""
    final, tmp = begin(directory, name)
    try:
        yield tmp
        commit(tmp, final)
    except BaseException:
        abort(tmp)
        raise


def begin(directory: str, name: str) -> tuple[str, str]:
    """(final path, temporary directory) of a new checkpoint `name`; the temporary directory is created
    empty. Then commit() or abort() it (writing() does both for one process)."""
    if not name or name.startswith(".") or os.sep in name or name == LATEST:
        raise ValueError(f"name={name!r}: a checkpoint name is one path component, not {LATEST!r}, not hidden")
    final, tmp = os.path.join(directory, name), os.path.join(directory, f".tmp-{name}")
    if os.path.lexists(final):
        raise FileExistsError(errno.EEXIST, "a checkpoint of this name exists; pass another name or remove it", final)
    os.makedirs(directory, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save of this name
    os.mkdir(tmp)
    return final, tmp


def commit(tmp: str, final: str) -> None:
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(os.path.dirname(final) or ".")


def abort(tmp: str) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def data_file_name(rank: int) -> str:
    return f"rank{rank}.bin"


def write_manifest(directory: str, manifest: dict) -> None:
    """manifest.json with its digest ([Note: a manifest that is checked])."""
    manifest = {**manifest, DIGEST: manifest_digest(manifest)}
    _write_synced(os.path.join(directory, MANIFEST), _readable_json(manifest).encode())


def _readable_json(value, depth: int = 3, pad: str = "") -> str:
    """JSON with the first `depth` levels of dicts indented a key a line (a tensor's kind a line) and the rest
    compact: as readable as json.dumps(indent=1) where it matters, but from json's C encoder (indent= takes
    its pure-Python one: 0.15 s of a checkpoint's CPU at 200M parameters)."""
    if not depth or not isinstance(value, dict) or not value:
        return json.dumps(value)
    inner = pad + " "
    return "{\n" + ",\n".join(f"{inner}{json.dumps(k)}: {_readable_json(v, depth - 1, inner)}"
                               for k, v in value.items()) + f"\n{pad}}}"


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON, its own digest left out."""
    body = {k: v for k, v in manifest.items() if k != DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def point_latest(directory: str, name: str) -> None:
    """<directory>/latest names `name`, replaced atomically: readers see the old or the new name."""
    path, tmp = os.path.join(directory, LATEST), os.path.join(directory, f".{LATEST}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # left by an interrupted save, or planted: unlink removes a symlink, not its target
    try:
        _write_synced(tmp, f"{name}\n".encode())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def list_checkpoints(directory: str, run_id: str | None = None) -> list[str]:
    """Names of the complete checkpoints in `directory`, oldest first by the step in their manifests (then by
    when they were saved); with `run_id`, only that run's. A manifest that does not read is left out."""
    found = []
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.startswith(".") or os.path.islink(path) or not os.path.isfile(os.path.join(path, MANIFEST)):
            continue
        try:
            m = read_manifest(path, quiet=True)
        except (CheckpointError, OSError):
            continue
        if run_id is None or m.get("run_id") == run_id:
            found.append(((m["step_count"], m["micro_step"], m["saved_at"]), name))
    return [name for _, name in sorted(found)]


def prune(directory: str, keep: int, run_id: str) -> None:
    """Removes all but the newest `keep` checkpoints of run `run_id`, never the one `latest` names, never
    another run's (nor one without a run id: written by an older offload)."""
    with open(os.path.join(directory, LATEST)) as f:
        latest = f.read().strip()
    for name in os.listdir(directory):
        if name.startswith(".del-"):  # a prune interrupted earlier
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    for name in list_checkpoints(directory, run_id)[:-keep]:
        if name != latest:
            trash = os.path.join(directory, f".del-{name}")  # renamed first: never a half-removed checkpoint
            os.rename(os.path.join(directory, name), trash)
            shutil.rmtree(trash, ignore_errors=True)


def create(path: str):
    """A new file at `path`, open for binary writing: never an existing name, never through a symlink."""
    return os.fdopen(os.open(path, CREATE_FLAGS, 0o644), "wb")


def _write_synced(path: str, data: bytes) -> None:
    try:
        with create(path) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror or e} (writing {len(data)} bytes)", path) from e


def fsync_dir(path: str) -> None:
    """fsync a directory: the names it holds (a rename, a new file) survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- reading ---------------------------------------------------------------------------------------------------

def resolve(path: str) -> str:
    """The checkpoint at `path`: a checkpoint directory itself, or the one `path/latest` names (one path
    component: a checkpoint of `path` itself, [Note: atomic saves]); `path` may be that `latest` file."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    if os.path.basename(os.path.normpath(path)) == LATEST and os.path.isfile(path):
        return resolve(os.path.dirname(os.path.normpath(path)) or ".")
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        with open(latest) as f:
            name = f.read().strip()
        if not name or name in (".", "..") or name.startswith(".") or "/" in name or os.sep in name or "\0" in name:
            raise CheckpointError(f"{latest}: names {name!r}, which is not a checkpoint of {path} (one name, no "
                                  "'/', not hidden); write the name of one of its checkpoints into it, or pass "
                                  "the checkpoint's directory itself")
        ckpt = os.path.join(path, name)
        if os.path.islink(ckpt):
            raise CheckpointError(f"{latest}: names {ckpt}, a symlink; a checkpoint of {path} is a directory "
                                  "in it: pass the checkpoint's own path")
        if not os.path.isfile(os.path.join(ckpt, MANIFEST)):
            raise CheckpointError(f"{latest}: names {ckpt}, which holds no {MANIFEST}")
        return ckpt
    raise FileNotFoundError(errno.ENOENT, f"neither a checkpoint (no {MANIFEST}) nor a directory of checkpoints "
                            f"(no {LATEST})", path)


_warned_unverified: set[str] = set()  # manifests without a digest already named in a warning (once each)


def read_manifest(ckpt: str, quiet: bool = False) -> dict:
    """The manifest of checkpoint `ckpt`, its digest and structure checked ([Note: a manifest that is
    checked]); one without a digest (an older offload's) is read with a warning, unless `quiet`."""
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
    if DIGEST not in m:
        if not quiet and path not in _warned_unverified:
            _warned_unverified.add(path)
            log.warning("offload: %s has no %s (written by an older offload): its manifest is not verified, and "
                        "`keep` never prunes it", path, DIGEST)
    elif m[DIGEST] != manifest_digest(m):
        raise CheckpointError(f"{path}: its sha256 is {manifest_digest(m)}, the {DIGEST} it holds is {m[DIGEST]!r}; "
                              "the manifest was damaged or edited (a step, a shape, a checksum): load another checkpoint")
    problem = _structure_problem(m)
    if problem:
        raise CheckpointError(f"{path}: {problem}; the manifest is damaged: load another checkpoint")
    return m


# What a load reads from a manifest, and its type ([Note: the format]); checked before any of it is used
_TOP = {"world_size": int, "zero_stage": int, "precision": str, "step_count": int, "micro_step": int,
        "loss_scale": (int, float), "good_steps": int, "skipped_steps": int, "accumulator": bool,
        "last_grad_norm": (int, float, type(None)), "pending_update": (dict, type(None)), "saved_at": (int, float),
        "config": dict, "extra": dict, "rng": dict, "files": dict, "tensors": dict, "buffers": dict}
_RANGE = {"begin": int, "end": int, "file": str, "offset": int, "nbytes": int, "crc32": int}
_KINDS = ("master", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax", "grad", "weight")


def _structure_problem(m: dict) -> str | None:
    """What is missing or of the wrong type in manifest `m`, or None."""
    problem = _fields(m, _TOP, "") or _fields(m["config"], {"gradient_accumulation_steps": int}, "config")
    if problem:
        return problem
    for rank, state in m["rng"].items():
        problem = problem or _fields(state, {"python": list, "torch": str}, f"rng.{rank}")
    for name, info in m["files"].items():
        problem = problem or _fields(info, {"rank": int, "nbytes": int}, f"files.{name}")
    for name, entry in m["tensors"].items():
        where = f"tensors.{name}"
        problem = problem or _fields(entry, {"shape": list, "dtype": str, "trainable": bool, "aliases": list}, where)
        for kind in _KINDS:
            if problem is None and kind in entry:
                problem = _stored(entry[kind], f"{where}.{kind}")
        if problem is None and not all(type(d) is int and d >= 0 for d in entry["shape"]):
            problem = f"{where}.shape is {entry['shape']!r}, not a list of sizes"
    for name, entry in m["buffers"].items():
        where = f"buffers.{name}"
        problem = problem or _fields(entry, {"shape": list}, where) or _stored(entry, where)
    return problem


def _stored(where: dict, what: str) -> str | None:
    """A tensor's bytes of one kind: {"dtype", "ranges": [{begin, end, file, offset, nbytes, crc32}]}."""
    problem = _fields(where, {"dtype": str, "ranges": list}, what)
    for i, r in enumerate(where["ranges"] if problem is None else ()):
        problem = problem or _fields(r, _RANGE, f"{what}.ranges[{i}]")
    return problem


def _fields(d, types: dict, what: str) -> str | None:
    if not isinstance(d, dict):
        return f"{what or 'the manifest'} is {type(d).__name__}, not an object"
    for key, typ in types.items():
        if key not in d:
            return f"{what + '.' if what else ''}{key} is missing"
        value, allowed = d[key], typ if isinstance(typ, tuple) else (typ,)
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):  # True is an int
            return f"{what + '.' if what else ''}{key} is {value!r}, not of the type a checkpoint holds"
    return None


def check_ranges(what: str, where: dict, numel: int, files: dict) -> list[str]:
    """The ranges must cover elements [0, numel) once, each its bytes in a known file."""
    try:
        itemsize = dtype_of(where["dtype"]).itemsize
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
             for name, e in manifest["tensors"].items() for kind, where in e.items() if kind in _KINDS
             for r in where["ranges"]]
    found += [(f"buffer {name}", r) for name, e in manifest["buffers"].items() for r in e["ranges"]]
    return sorted(found, key=lambda wr: (wr[1]["file"], wr[1]["offset"]))


class Reader:
    """A checkpoint's data files, open for reading; each one's size checked against the manifest."""

    def __init__(self, ckpt: str, manifest: dict):
        self.fds: dict[str, tuple[int, str]] = {}
        try:
            for name, info in manifest["files"].items():
                path = os.path.join(ckpt, name)
                self.fds[name] = (_open_data(path, name, info), path)
                fd = self.fds[name][0]
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
            crc, pos = crc32(data, crc), pos + len(data)
        if crc != r["crc32"]:
            raise CheckpointError(f"{path}: bytes [{r['offset']}, {r['offset'] + r['nbytes']}) ({what}): crc32 "
                                  f"{crc:#010x}, the manifest says {r['crc32']:#010x}; the file is damaged, load "
                                  "another checkpoint")

    def verify_all(self, manifest: dict) -> None:
        for what, r in all_ranges(manifest):
            self.verify(r, what)

    def read_elements(self, where: dict, lo: int, hi: int, dst: torch.Tensor, what: str) -> None:
        """Elements [lo, hi) of a tensor's `where` ({"dtype", "ranges"}) into dst (any dtype: cast)."""
        dtype = dtype_of(where["dtype"])
        for r in where["ranges"]:
            a, z = max(lo, r["begin"]), min(hi, r["end"])
            if a >= z:
                continue
            out = dst[a - lo:z - lo]
            into = out if out.dtype == dtype else torch.empty(z - a, dtype=dtype)
            fd, path = self.fds[r["file"]]
            offset = r["offset"] + (a - r["begin"]) * dtype.itemsize
            view = as_bytes(into)
            if os.preadv(fd, [view], offset) != len(view):
                raise CheckpointError(f"{path}: short read at byte {offset} ({what} elements [{a}, {z})); truncated")
            if into is not out:
                out.copy_(into)

    def close(self) -> None:
        for fd, _ in self.fds.values():
            os.close(fd)
        self.fds = {}

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _open_data(path: str, name: str, info: dict) -> int:
    if name != os.path.basename(name) or name.startswith("."):
        raise CheckpointError(f"{path}: the manifest names data file {name!r}, not a file of the checkpoint itself")
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: missing (the manifest lists it: rank {info['rank']}'s {info['nbytes']} "
                              "bytes); the checkpoint is incomplete: copy it whole, or load another") from e


def verify(ckpt: str, manifest: dict) -> None:
    """Reads every range of the checkpoint and checks its crc32 (and every file's size)."""
    with Reader(ckpt, manifest) as files:
        files.verify_all(manifest)


def iter_weights(ckpt: str, manifest: dict, dtype: torch.dtype, dequantize=None):
    """(name, tensor) for every parameter name (tied names too) and persistent buffer of a checkpoint,
    one at a time, checksums verified: masters of trainable parameters, weights of frozen ones, floating
    values as `dtype` (what `offload checkpoint export` writes). A quantized weight (a QLoRA run's base, kept
    as its record's bytes) comes as dequantize(its spec, its bytes as uint8), then as `dtype`."""
    with Reader(ckpt, manifest) as files:
        entries = [(n, e, e.get("master") or e.get("weight"), [n, *e["aliases"]]) for n, e in manifest["tensors"].items()]
        entries += [(n, e, e, [n]) for n, e in manifest["buffers"].items()]
        for name, entry, where, names in entries:
            if "quantized" in entry and (dequantize is None or "quantization" not in entry):
                raise CheckpointError(f"{ckpt}: {name} is a {entry['quantized']} weight stored as its quantized "
                                      "bytes (a QLoRA run) without what dequantizes them (a checkpoint saved before "
                                      "export read them): write the merged model from the run itself with "
                                      "`offload train ... --save-merged DIR`")
            numel = 1
            for d in entry["shape"]:
                numel *= d
            for r in where["ranges"] if where else []:
                files.verify(r, name)
            value = torch.empty(numel, dtype=dtype_of(where["dtype"]) if where else dtype)
            if where:
                files.read_elements(where, 0, numel, value, name)
            if "quantized" in entry:
                value = dequantize(entry["quantization"], value.view(torch.uint8)).to(dtype)
            else:
                value = value.view(entry["shape"])
            if value.is_floating_point():
                value = value.to(dtype)
            for n in names:
                yield n, value


# -- bytes and dtypes ----------------------------------------------------------------------------------------

def as_bytes(t: torch.Tensor):
    """The bytes of a contiguous tensor, without a copy (numpy shares its memory; writable)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype")
    return dtype
