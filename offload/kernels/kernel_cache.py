"""Where a compiled kernel is cached, and when a cached one may be loaded (offload/kernels/cpu_adam.py builds it)."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import grp
import hashlib
import os
import pwd
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Iterator

# [Note: trusting a cached kernel]
# Importing a shared library runs its code, and the CPU Adam kernel is imported from its cache directory by
# every process after the one that built it. So a cached library is loaded only when
# - every directory from the build directory up to / is owned by this user or root and is not writable by
#   others, nor by a group other than the user's private group (Debian's user private groups with umask
#   002 make ~/.cache 0775, writable by that group of one), unless it is sticky (/tmp: then only a file's
#   owner may rename or remove it); so nobody else can have replaced the build directory or its files;
# - the build directory and the library are owned by this user and not writable by group or others, and
#   the library is a regular file, not a link (the library is made so right after the build: a linker
#   under umask 002 leaves it group-writable);
# - the library's sha256 equals the digest recorded beside it (`<library>.sha256`) right after it was built:
#   a file changed since (a half-written or truncated library, one copied in from another build, an edit)
#   is not loaded.
# Otherwise the kernel is built again, and one line says why. A build directory that fails these checks is
# removed first: ninja would otherwise reuse object files found in it. Where a directory above the build
# directory fails them, the cache cannot be made safe from here: the kernel is built in a private temporary
# directory for this process instead, and the line says which directory to fix.

DIGEST_SUFFIX = ".sha256"
_GROUP_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH


def file_digest(path: Path) -> str:
    """sha256 of the file at `path` (not following a link: a link raises OSError ELOOP)."""
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
        return _digest(f)


def _digest(f) -> str:
    h = hashlib.sha256()
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
    return h.hexdigest()


def digest_path(library: Path) -> Path:
    return library.with_name(library.name + DIGEST_SUFFIX)


def seal(library: Path) -> None:
    """After a build: take away group and others' write bits from `library`, then record its sha256 beside
    it, atomically (a reader sees no digest or the whole one)."""
    with os.fdopen(os.open(library, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
        os.fchmod(f.fileno(), stat.S_IMODE(os.fstat(f.fileno()).st_mode) & ~_GROUP_OTHER_WRITE)
        digest = _digest(f)
    final = digest_path(library)
    tmp = final.with_name(f".{final.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(digest + "\n")
    os.replace(tmp, final)


def _mode(st: os.stat_result) -> str:
    return f"mode {stat.S_IMODE(st.st_mode):04o}"


def _private_group(gid: int) -> bool:
    """Whether `gid` is this user's private group: named as the user, with no other member listed."""
    try:
        user, group = pwd.getpwuid(os.geteuid()).pw_name, grp.getgrgid(gid)
    except KeyError:
        return False
    return group.gr_name == user and set(group.gr_mem) <= {user}


def unsafe_ancestry(path: Path) -> str | None:
    """Why `path` or a directory above it lets another user replace what is below, or None. Directories
    not created yet are skipped (they will be created private)."""
    uid = os.geteuid()
    path = path.resolve()  # the directories the path goes through, links followed
    for d in [path, *path.parents]:
        try:
            st = os.stat(d)
        except FileNotFoundError:
            continue
        except OSError as e:
            return f"{d} cannot be checked ({e.strerror})"
        if st.st_uid not in (uid, 0):
            return f"{d} is owned by uid {st.st_uid}, neither this user ({uid}) nor root"
        if st.st_mode & stat.S_ISVTX:
            continue
        if st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and not _private_group(st.st_gid)):
            return f"{d} is writable by group or others ({_mode(st)}, group {st.st_gid})"
    return None


def _unsafe_entry(path: Path, kind: str) -> str | None:
    """Why `path` (a directory or a regular file, not a link) is not this user's alone, or None."""
    st = os.lstat(path)
    is_kind = stat.S_ISDIR(st.st_mode) if kind == "directory" else stat.S_ISREG(st.st_mode)
    if not is_kind:
        return f"{path} is not a {kind}" + (" (a symlink)" if stat.S_ISLNK(st.st_mode) else "")
    if st.st_uid != os.geteuid():
        return f"{path} is owned by uid {st.st_uid}, not by this user ({os.geteuid()})"
    if st.st_mode & _GROUP_OTHER_WRITE:
        return f"{path} is writable by group or others ({_mode(st)})"
    return None


def why_untrusted(build_dir: Path, library: Path) -> str | None:
    """Why the existing `library` in `build_dir` must not be loaded, or None ([Note: trusting a cached
    kernel]; the directories above build_dir are unsafe_ancestry's)."""
    for path, kind in ((build_dir, "directory"), (library, "file")):
        why = _unsafe_entry(path, kind)
        if why is not None:
            return why
    recorded = digest_path(library)
    if not recorded.exists():
        return f"no digest recorded beside {library.name} (a build of an earlier version, or one cut short)"
    why = _unsafe_entry(recorded, "file")
    if why is not None:
        return why
    if recorded.read_text().strip() != file_digest(library):
        return f"{library} does not match the digest recorded when it was built"
    return None


def private_dirs(path: Path) -> None:
    """Create `path` and its missing parents, each 0700 (only this user may read or write them)."""
    for d in reversed([path, *path.parents]):
        if not d.exists():
            d.mkdir(mode=0o700)
            os.chmod(d, 0o700)  # the umask may have removed bits, never add any


def fresh_dir(path: Path) -> None:
    """An empty 0700 directory at `path`, whatever was there removed (see private_dirs)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)
    private_dirs(path)


def private_dir(prefix: str) -> Path:
    """A new 0700 temporary directory, removed when the process exits."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on the file `path` (created 0600): processes starting together (the ranks of one
    torchrun) check, build and record one at a time, so none removes a build another is making."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
