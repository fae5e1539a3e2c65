"""Run directories: one private subdirectory per store, recognisable after a crash.

Layout under the user's swap directory (nvme_path):
    <nvme_path>/offload-swap-<host>-<pid>-<token>/    0700, one per SwapStore
        owner.json                                   0600: pid, host, process start time
        data.bin                                     0600: the entries
Two runs sharing one nvme_path never collide (the token is random, mkdir is exclusive). A directory
whose owner process is gone (or whose pid now belongs to a younger process) is stale: `offload clean
DIR` lists and removes those; live runs are left alone unless forced.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from .buffers import ALIGN_BYTES, aligned_empty
from .errors import SwapIOError

log = logging.getLogger("swap")

RUN_PREFIX = "offload-swap-"
OWNER_FILE = "owner.json"
OPEN_FLAGS = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _process_start(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def create_file(path: Path, flags: int = os.O_RDWR) -> int:
    """Create a new 0600 file without following symlinks; fails if the name exists."""
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, 0o600)
    os.fchmod(fd, 0o600)  # the umask may have removed bits, never add any
    return fd


def make_run_dir(directory: str | os.PathLike) -> Path:
    """Create `directory` (0700) if missing, then a fresh run-unique 0700 subdirectory in it."""
    base = Path(directory)
    try:
        if not base.exists():
            base.mkdir(mode=0o700, parents=True)
            os.chmod(base, 0o700)
        host = socket.gethostname().replace("-", "_")[:32]
        run = base / f"{RUN_PREFIX}{host}-{os.getpid()}-{secrets.token_hex(4)}"
        run.mkdir(mode=0o700)
        os.chmod(run, 0o700)
        owner = {"pid": os.getpid(), "host": socket.gethostname(),
                 "started": _process_start(os.getpid()), "created": time.time()}
        fd = create_file(run / OWNER_FILE, os.O_WRONLY)
        with os.fdopen(fd, "w") as f:
            json.dump(owner, f)
    except OSError as e:
        raise SwapIOError(e.errno or errno.EIO, f"cannot create a swap run directory ({e.strerror})",
                          path=str(e.filename or base), offset=0, nbytes=0) from e
    return run


@dataclass(frozen=True)
class RunDir:
    path: Path
    pid: int | None
    host: str | None
    alive: bool  # owner process still running (or on another host: assumed alive)

    @property
    def stale(self) -> bool:
        return not self.alive


def _inspect(path: Path) -> RunDir:
    try:
        owner = json.loads((path / OWNER_FILE).read_text())
        pid, host, started = int(owner["pid"]), str(owner["host"]), owner.get("started")
    except (OSError, ValueError, KeyError, TypeError):
        return RunDir(path, None, None, alive=False)  # no readable owner: a crash during creation
    if host != socket.gethostname():
        return RunDir(path, pid, host, alive=True)  # cannot tell; never remove another host's run
    now_started = _process_start(pid)
    alive = now_started is not None and (started is None or abs(now_started - started) < 1.0)
    return RunDir(path, pid, host, alive)


def list_runs(directory: str | os.PathLike) -> list[RunDir]:
    """Every run directory under `directory` (not recursive), live and stale."""
    base = Path(directory)
    if not base.is_dir():
        return []
    return [_inspect(p) for p in sorted(base.iterdir())
            if p.name.startswith(RUN_PREFIX) and p.is_dir() and not p.is_symlink()]


def clean(directory: str | os.PathLike, *, force: bool = False) -> list[RunDir]:
    """Remove stale run directories (and live ones too with force=True); returns what was removed."""
    removed = []
    for run in list_runs(directory):
        if run.alive and not (force and run.pid != os.getpid()):
            continue
        shutil.rmtree(run.path, ignore_errors=True)
        removed.append(run)
    return removed


_direct_cache: dict[tuple[int, str], bool] = {}
_direct_lock = threading.Lock()


def supports_direct(run_dir: Path) -> bool:
    """Probe O_DIRECT once per file system directory (open + one aligned write); logs a fallback once."""
    base = run_dir.parent
    key = (os.stat(base).st_dev, str(base.resolve()))
    with _direct_lock:
        if key not in _direct_cache:
            _direct_cache[key] = _probe_direct(run_dir)
            if not _direct_cache[key]:
                log.warning("swap: %s refuses O_DIRECT (tmpfs?); using buffered I/O with fdatasync "
                            "there, so the page cache holds swapped bytes too", base)
        return _direct_cache[key]


def _probe_direct(run_dir: Path) -> bool:
    probe = run_dir / f"probe-{secrets.token_hex(4)}"
    try:
        fd = create_file(probe, os.O_RDWR | os.O_DIRECT)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    try:
        os.pwritev(fd, [memoryview(aligned_empty(ALIGN_BYTES).numpy())], 0)
        return True
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.close(fd)
        probe.unlink()
