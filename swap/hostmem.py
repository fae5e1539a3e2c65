"""Host memory this process may still use: what the kernel reports available, or less where a memory cgroup
(a container's limit, a systemd slice, a batch job's allocation) leaves it less.

Every memory check in the plan reads available() rather than psutil's figure, which is the whole machine's:
in a container limited to 8 GiB on a 256 GiB host psutil says 250 GiB are free, a plan built on that is
accepted, and the kernel's OOM killer ends the run (SIGKILL, no message) instead of the plan refusing it
with the sizes. The cgroup's room is its limit less what it is charged, page cache that can be dropped
(inactive file pages) excepted, as `docker stats` counts it; every cgroup from this process's up to the
hierarchy's root counts (a parent's limit binds its children). cgroup v1 (the memory controller) and v2.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class CgroupRoom:
    bytes: int   # what the tightest cgroup leaves: limit - (charged - inactive file pages)
    limit: int   # that cgroup's limit
    path: str    # its directory


def available(proc: str = "/proc") -> int:
    """Bytes of host memory this process may still use: the smaller of the kernel's available memory and
    the room its memory cgroups leave."""
    avail = psutil.virtual_memory().available
    room = cgroup_room(proc)
    return avail if room is None else max(0, min(avail, room.bytes))


def describe(proc: str = "/proc") -> str:
    """'N GiB available' and, under a cgroup limit that binds, which: for messages and `offload doctor`."""
    avail, room = psutil.virtual_memory().available, cgroup_room(proc)
    if room is None or room.bytes >= avail:
        return f"{avail / 2**30:.2f} GiB available"
    return (f"{max(room.bytes, 0) / 2**30:.2f} GiB available under the memory cgroup limit of "
            f"{room.limit / 2**30:.2f} GiB ({room.path}; the host has {avail / 2**30:.2f} GiB free)")


def cgroup_room(proc: str = "/proc") -> CgroupRoom | None:
    """The tightest memory cgroup limit over this process's cgroups and their parents, or None where none
    applies (no cgroups, unreadable, or every limit above the host's RAM)."""
    total = psutil.virtual_memory().total
    best = None
    for directory, top, version in _memory_cgroups(proc):
        while True:
            room = _room(directory, version, total)
            if room is not None and (best is None or room.bytes < best.bytes):
                best = room
            if os.path.normpath(directory) == os.path.normpath(top):
                break
            directory = os.path.dirname(directory)
    return best


def _memory_cgroups(proc: str) -> list[tuple[str, str, int]]:
    """(this process's cgroup directory, its hierarchy's mount point, version) of each memory hierarchy."""
    try:
        with open(os.path.join(proc, "self", "cgroup")) as f:
            groups = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
        with open(os.path.join(proc, "self", "mountinfo")) as f:
            mounts = [line.split() for line in f]
    except OSError:
        return []
    found = []
    for fields in mounts:
        sep = fields.index("-") if "-" in fields else -1
        if sep < 0 or len(fields) < sep + 3:
            continue
        root, point, fstype, options = fields[3], fields[4], fields[sep + 1], fields[sep + 3].split(",")
        if fstype == "cgroup" and "memory" in options:
            version = 1
            path = next((p for hid, ctl, p in groups if "memory" in ctl.split(",")), None)
        elif fstype == "cgroup2":
            version = 2
            path = next((p for hid, ctl, p in groups if hid == "0"), None)
        else:
            continue
        if path is None:
            continue
        inside = os.path.relpath(path, root) if path.startswith(root) else ""  # a container sees its own root
        directory = os.path.normpath(os.path.join(point, "" if inside == "." else inside))
        found.append((directory if os.path.isdir(directory) else point, point, version))
    return found


def _room(directory: str, version: int, total: int) -> CgroupRoom | None:
    limit_file, usage_file, inactive = (("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
                                        if version == 1 else ("memory.max", "memory.current", "inactive_file"))
    try:
        limit = _read(directory, limit_file)
        if limit == "max" or int(limit) >= total:
            return None
        usage = int(_read(directory, usage_file))
        stat = dict(line.split()[:2] for line in _read(directory, "memory.stat").splitlines() if line.strip())
    except (OSError, ValueError):
        return None
    cache = int(stat.get(inactive, 0))
    return CgroupRoom(int(limit) - max(usage - cache, 0), int(limit), directory)


def _read(directory: str, name: str) -> str:
    with open(os.path.join(directory, name)) as f:
        return f.read().strip()
