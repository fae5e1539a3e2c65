"""Permission tests that also run as root (CI runs as root, and root ignores permission bits): the check
runs in this process, or as root in a new Python as the user nobody, in a directory nobody can reach
(pytest's tmp_path lies under a directory private to root)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534


@contextlib.contextmanager
def reachable_tmp(tmp_path: Path):
    """tmp_path, or as root a fresh directory that every user can traverse (removed after)."""
    if os.geteuid() != 0:
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="offload-test-"))
    try:
        path.chmod(0o755)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_unprivileged(check, *args) -> None:
    """check(*args) by a user that permission bits bind: here, or as root as nobody in a new Python.
    `check`: a module-level function of a test module; args: plain values (repr round-trips)."""
    if os.geteuid() != 0:
        check(*args)
        return
    code = f"import {check.__module__} as m; m.{check.__name__}(*{args!r})"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "HOME": "/tmp"}
    proc = subprocess.run([sys.executable, "-c", code], user=NOBODY, group=NOBODY, extra_groups=[], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"as nobody: {proc.stderr[-3000:]}"
