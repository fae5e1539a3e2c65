"""A directory this process cannot write into, for the permission tests, also as root (CI runs as root, and
root ignores permission bits): a mode 0500 directory for any other user; as root, a sysfs directory
(/sys/kernel), where the kernel refuses new files and directories to everyone (EACCES / EPERM). Running the
check as another user instead does not work where the interpreter lives under root's private home."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import pytest

SYSFS_DIR = Path("/sys/kernel")


def _refuses_writes(path: Path) -> bool:
    try:
        with tempfile.TemporaryFile(dir=path):
            return False
    except OSError:
        pass
    try:
        (path / f"offload-probe-{os.getpid()}").mkdir()
    except OSError:
        return True
    (path / f"offload-probe-{os.getpid()}").rmdir()
    return False


@contextlib.contextmanager
def unwritable_dir(tmp_path: Path):
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        try:
            yield ro
        finally:
            ro.chmod(0o700)
        return
    if not (SYSFS_DIR.is_dir() and _refuses_writes(SYSFS_DIR)):
        pytest.skip(f"running as root without a read-only sysfs at {SYSFS_DIR}: no directory refuses root here")
    yield SYSFS_DIR
