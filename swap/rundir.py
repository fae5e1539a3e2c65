"""Run directories: one private subdirectory per store, so a person can see what is running.

Layout under the user's swap directory (nvme_path):
    <nvme_path>/offload-swap-<host>-<pid>-<token>/    0700, one per SwapStore
        owner.json                                   0600: pid, host, process start time, bytes, fd
The store's data file lives in the run directory but has no name there ([Note: unlinked data file]), so
`ls` and `du` do not show it; owner.json says which fd of which process holds it (/proc/<pid>/fd/<fd>, where
list_runs reads its exact bytes when allowed to) and its size as last recorded. Two runs sharing one
nvme_path never collide (the token is random, mkdir is exclusive). A directory whose owner process is gone
(or whose pid now belongs to a younger process) is stale: its bytes went with its process, and `offload
clean DIR` removes what is left (owner.json, and the named data.bin of versions before the data file was
unlinked); live runs are left alone unless forced. An open store holds its run as an `OpenRun`; the runs
still open are closed at exit and forgotten in a forked child ([Note: files at exit]).
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import secrets
import shutil
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import psutil

from .buffers import ALIGN_BYTES, aligned_empty
from .errors import SwapIOError

# [Note: unlinked data file]
# A process can end without running any cleanup: SIGKILL, the OOM killer, a crash in C code, a SIGTERM
# whose default action ends it at once. A named data file would then keep gigabytes on the drive until
# someone removes it. So the data file is created without a name: O_TMPFILE in the run directory where the
# file system supports it (ext4, xfs, btrfs, tmpfs), else opened under a name that is unlinked at once. The
# kernel frees its blocks when the last descriptor closes, however the process ends. O_DIRECT works on it as
# on any file. A forked child closes its copy of the descriptor ([Note: files at exit]), so a DataLoader worker
# outliving its parent does not hold the bytes.

log = logging.getLogger("swap")

RUN_PREFIX = "offload-swap-"
OWNER_FILE = "owner.json"
OPEN_FLAGS = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
OWNER_RECORD_S = 1.0  # owner.json's size is rewritten at a growth this long after its last record (or by 1/8)


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


# O_TMPFILE is refused with EOPNOTSUPP by a file system without it, and with EISDIR by a kernel older than
# 3.11 (which sees only its O_DIRECTORY bit). EINVAL is not among them: with O_DIRECT it means the file
# system refuses O_DIRECT, which the caller handles (supports_direct).
_NO_TMPFILE = (errno.EOPNOTSUPP, errno.EISDIR)


def open_unlinked(run: Path, flags: int = os.O_RDWR) -> tuple[int, str]:
    """A new 0600 file in `run` that has no name ([Note: unlinked data file]); returns (fd, how):
    "O_TMPFILE", or "unlinked after open" where the file system has no O_TMPFILE."""
    tmpfile = getattr(os, "O_TMPFILE", 0)
    if tmpfile:
        try:
            fd = os.open(run, flags | tmpfile | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as e:
            if e.errno not in _NO_TMPFILE:
                raise
        else:
            return fd, "O_TMPFILE"  # created with mode & ~umask, so never more than 0600
    path = run / f"data-{secrets.token_hex(4)}.bin"
    fd = create_file(path, flags)
    try:
        os.unlink(path)
    except BaseException:
        os.close(fd)
        raise
    return fd, "unlinked after open"


def write_owner(run: Path, owner: dict) -> None:
    """Replace run/owner.json with `owner`, atomically (a reader sees the old file or the new one)."""
    tmp = run / f".{OWNER_FILE}.{secrets.token_hex(4)}"
    fd = create_file(tmp, os.O_WRONLY)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(owner, f)
        os.replace(tmp, run / OWNER_FILE)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def make_run_dir(directory: str | os.PathLike) -> tuple[Path, dict]:
    """Create `directory` (0700) if missing, then a fresh run-unique 0700 subdirectory in it with its
    owner.json; returns the subdirectory and what owner.json holds."""
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
                 "started": _process_start(os.getpid()), "created": time.time(), "bytes": 0}
        write_owner(run, owner)
    except OSError as e:
        raise SwapIOError(e.errno or errno.EIO, f"cannot create a swap run directory ({e.strerror})",
                          path=str(e.filename or base), offset=0, nbytes=0) from e
    return run, owner


@dataclass(frozen=True)
class RunDir:
    path: Path
    pid: int | None
    host: str | None
    alive: bool  # owner process still running (or on another host: assumed alive)
    swap_bytes: int | None = None  # the unlinked data file's bytes on disk (/proc), else as owner.json last recorded
    named_bytes: int = 0  # files with a name besides owner.json (an earlier version's data.bin), as du counts

    @property
    def stale(self) -> bool:
        return not self.alive


def _named_bytes(path: Path) -> int:
    """Bytes on disk of the run directory's files other than owner.json (not following links)."""
    total = 0
    for f in path.iterdir():
        if f.name != OWNER_FILE:
            try:
                total += f.lstat().st_blocks * 512
            except OSError:
                pass  # removed meanwhile
    return total


def _held_bytes(path: Path, pid: int, fd) -> int | None:
    """Bytes on disk of the unlinked file that `pid` holds as `fd` in `path`, read through /proc (same user
    or root); None where that cannot be read or the fd is not that file."""
    try:
        target = os.readlink(f"/proc/{pid}/fd/{int(fd)}")  # "<run dir>/#<inode> (deleted)" for O_TMPFILE
        if not target.startswith(os.path.realpath(path) + "/"):
            return None
        return os.stat(f"/proc/{pid}/fd/{int(fd)}").st_blocks * 512
    except (OSError, ValueError, TypeError):
        return None


def _inspect(path: Path) -> RunDir:
    named = _named_bytes(path)
    try:
        owner = json.loads((path / OWNER_FILE).read_text())
        pid, host, started = int(owner["pid"]), str(owner["host"]), owner.get("started")
        swap_bytes = int(owner["bytes"]) if "bytes" in owner else None  # None: written by an earlier version
    except (OSError, ValueError, KeyError, TypeError):
        return RunDir(path, None, None, alive=False, named_bytes=named)  # no readable owner: a crash during creation
    if host != socket.gethostname():
        return RunDir(path, pid, host, True, swap_bytes, named)  # cannot tell; never remove another host's run
    now_started = _process_start(pid)
    alive = now_started is not None and (started is None or abs(now_started - started) < 1.0)
    if not alive:
        return RunDir(path, pid, host, False, 0, named)  # its unlinked file went with the process
    held = _held_bytes(path, pid, owner.get("fd"))  # exact; owner.json's figure may lag a growing file
    return RunDir(path, pid, host, True, swap_bytes if held is None else held, named)


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
    """Whether an unlinked file in `run_dir` takes O_DIRECT (open + one aligned write)."""
    try:
        fd, _ = open_unlinked(run_dir, os.O_RDWR | os.O_DIRECT)
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


def _choose_direct(run_dir: Path, direct: bool | None) -> bool:
    ok = supports_direct(run_dir)
    if direct and not ok:
        raise ValueError(f"direct=True: {run_dir.parent} refuses O_DIRECT (a tmpfs?); "
                         f"use direct=None to fall back to buffered I/O, or a directory on a disk")
    return ok if direct is None else bool(direct)


class OpenRun:
    """An open store's run directory and the unlinked data file in it (`fd`, with O_DIRECT when `direct`);
    owner.json records the file's size as it grows. `closed` is set when the store's close begins, or in a
    forked child that forgot it ([Note: files at exit])."""

    def __init__(self, directory: str | os.PathLike, direct: bool | None):
        self.closed = True  # until made
        self.run_dir, self._owner = make_run_dir(directory)
        self.fd = None
        try:
            self.direct = _choose_direct(self.run_dir, direct)
            self.fd, self.file_kind = open_unlinked(self.run_dir, os.O_RDWR | (os.O_DIRECT if self.direct else 0))
            # What errors name: the directory the bytes are in and where the process holds them.
            self.path = f"{self.run_dir}/(unlinked data file, /proc/{os.getpid()}/fd/{self.fd})"
            self._owner_lock, self._owner_time = threading.Lock(), time.monotonic()
            with self._owner_lock:
                self._update_owner(fd=self.fd, data=self.file_kind)
        except BaseException:
            if self.fd is not None:
                os.close(self.fd)
            self.remove()
            raise
        self.closed = False

    def record_size_if_needed(self, end_bytes: Callable[[], int]) -> None:
        """After the file grew to end_bytes(): its new size into owner.json, for `offload clean --list` where
        it cannot read the size from /proc. Rewriting owner.json costs about 1 ms (create, write, rename), and
        a model's first writes grow the file thousands of times, so it is rewritten only when the size grew by
        an eighth since the last record or that record is older than OWNER_RECORD_S. A failure to write it is
        logged (the swap itself is fine)."""
        end, recorded = end_bytes(), self._owner["bytes"]
        if end == recorded:  # the common case: rewritten in place
            return
        if end < recorded + recorded // 8 and time.monotonic() - self._owner_time < OWNER_RECORD_S:
            return
        try:
            with self._owner_lock:  # the size read under the lock: a later writer never records an older one
                self._update_owner(bytes=end_bytes())
                self._owner_time = time.monotonic()
        except OSError as e:
            log.warning("swap: cannot record the data file's size in %s/owner.json: %s", self.run_dir, e)

    def release(self, *, keep_fd: bool = False) -> None:
        """Closes the data file (its bytes go) unless keep_fd, and removes the run directory."""
        self.closed = True
        if not keep_fd:
            os.close(self.fd)
        self.remove()

    def remove(self) -> None:
        """Removes the run directory (owner.json); the data file, held open, keeps its bytes until closed."""
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def forget_after_fork(self) -> None:
        """In a forked child: close the inherited data file and never touch the run directory."""
        self.closed = True
        try:
            os.close(self.fd)
        except OSError:
            pass

    def _update_owner(self, **changes) -> None:
        """Rewrite owner.json with `changes`; the caller holds _owner_lock."""
        if any(self._owner.get(k) != v for k, v in changes.items()):
            self._owner = {**self._owner, **changes}
            write_owner(self.run_dir, self._owner)


class Closes(Protocol):
    """What holds an OpenRun: a SwapStore."""

    def close(self) -> None: ...


# [Note: files at exit]
# The data file's bytes need no cleanup: they go with the process ([Note: unlinked data file] in
# swap/rundir.py). What close() removes is the run directory with its owner.json; stores still open are
# closed at interpreter exit (atexit: also after an uncaught exception or Ctrl-C's KeyboardInterrupt). The
# store installs no signal handler: a SIGTERM keeps its default action and ends the process at once, even
# inside a long C call, leaving a stale run directory (owner.json only) that `offload clean` removes; a
# process that ends itself with os._exit (offload.watchdog) removes its run directories first (remove_run_dirs).
# A forked child (a DataLoader worker) closes its copy of the parent's data files and forgets the stores,
# so it neither holds their bytes after the parent ended nor removes the parent's run directories.
_open_runs: "weakref.WeakKeyDictionary[Closes, OpenRun]" = weakref.WeakKeyDictionary()


def hold_open(store: Closes, run: OpenRun) -> None:
    """`store` holds `run` open until it closes: closed at interpreter exit, forgotten in a forked child."""
    _open_runs[store] = run


def let_go(store: Closes) -> None:
    """`store` is closing: nothing more to do for it at exit."""
    _open_runs.pop(store, None)


def _forget_runs_in_child() -> None:
    for run in list(_open_runs.values()):
        run.forget_after_fork()
    _open_runs.clear()


os.register_at_fork(after_in_child=_forget_runs_in_child)


@atexit.register
def _close_all_at_exit() -> None:
    for store in list(_open_runs.keys()):
        store.close()


def remove_run_dirs() -> None:
    """Removes the run directory of every store this process holds open, leaving the stores as they are: for
    a process about to end with os._exit (which runs no atexit), whose data files' bytes go with it."""
    for run in list(_open_runs.values()):
        run.remove()
