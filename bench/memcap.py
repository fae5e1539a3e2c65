"""A command run in a memory cgroup of its own: what the kernel charges it (anonymous memory and page cache)
measured, or capped.

bench/generate.py --memory-cap SIZE runs ours on nvme and accelerate's disk offload each capped at SIZE: on a
host whose RAM holds the whole model, accelerate's offload folder sits in the page cache and its "disk" reads
are memory copies, which is not the case offload is for (a model larger than the RAM). Under a cap the kernel
keeps only what fits, as it would on a machine with that much memory.

Linux only, cgroup v1 (the memory controller's hierarchy) or v2, where this process may create a child of its
own cgroup (root, or a delegated subtree); cgroup_parent() is None elsewhere and the callers leave the column
out. Every cgroup made here is removed when its command ends.
"""

from __future__ import annotations

import itertools
import os
import subprocess

_names = itertools.count()


def cgroup_parent() -> tuple[str, int] | None:
    """(directory, version) of a memory cgroup this process may create children in, or None."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            candidate, version = "/sys/fs/cgroup/memory" + path, 1
        elif hid == "0" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            candidate, version = "/sys/fs/cgroup" + path, 2
        else:
            continue
        limit = "memory.limit_in_bytes" if version == 1 else "cgroup.subtree_control"
        if os.access(candidate, os.W_OK) and os.path.exists(os.path.join(candidate, limit)):
            if version == 2 and "memory" not in open(os.path.join(candidate, "cgroup.subtree_control")).read():
                continue
            return candidate, version
    return None


def run(cmd: list[str], limit_bytes: int | None = None, **popen) -> tuple[subprocess.CompletedProcess, dict]:
    """Runs `cmd` (stdout and stderr captured as text) in a new memory cgroup, capped at `limit_bytes`
    (None: not capped). Returns the process and {"limit_bytes", "peak_bytes" (what the kernel charged it at
    most, page cache included), "hit_limit" (times the cap was reached), "oom_killed"}. RuntimeError where
    cgroup_parent() is None."""
    where = cgroup_parent()
    if where is None:
        raise RuntimeError("memcap: no memory cgroup this process may create children in (needs Linux cgroups "
                           "and root or a delegated subtree)")
    parent, version = where
    path = os.path.join(parent, f"offload-bench-{os.getpid()}-{next(_names)}")
    os.mkdir(path)
    try:
        if limit_bytes is not None:
            _write(path, "memory.limit_in_bytes" if version == 1 else "memory.max", limit_bytes)
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              preexec_fn=lambda: _write(path, "cgroup.procs", os.getpid()), **popen)
        return proc, {"limit_bytes": limit_bytes, **_charged(path, version), "oom_killed": proc.returncode == -9}
    finally:
        os.rmdir(path)  # empty once its process ended


def _write(path: str, name: str, value: int) -> None:
    with open(os.path.join(path, name), "w") as f:
        f.write(str(value))


def _charged(path: str, version: int) -> dict:
    def read(name: str) -> str:
        with open(os.path.join(path, name)) as f:
            return f.read()

    if version == 1:
        return {"peak_bytes": int(read("memory.max_usage_in_bytes")), "hit_limit": int(read("memory.failcnt"))}
    events = dict(line.split() for line in read("memory.events").splitlines())
    peak = int(read("memory.peak")) if os.path.exists(os.path.join(path, "memory.peak")) else None
    return {"peak_bytes": peak, "hit_limit": int(events.get("max", 0))}


def evict(directory: str) -> None:
    """Drops the clean page-cache pages of every file under `directory` (posix_fadvise DONTNEED): read next,
    they come from the drive, charged to whoever reads them."""
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
