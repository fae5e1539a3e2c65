"""A real full file system, not a mock: a small ext4 on a loop device (a tmpfs where loop devices are not
available), filled by another writer while the run goes on. The preflight refuses a model whose swap
cannot fit; a swap file that cannot grow fails with SwapIOError/ENOSPC naming its path; a checkpoint save
that finds the disk full stops `offload train` naming path and step, the last good checkpoint intact, and
`--resume` from it with the swap on another file system continues the run.

Mounting needs root (or CAP_SYS_ADMIN): where it is not permitted the tests skip saying so, except under
OFFLOAD_CI=1, where they fail (CI must run them)."""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import os
import re
import shutil
import subprocess

import pytest
import torch

import offload
from offload.cli import main
from offload.plan.placement import PlacementError
from offload.swap import SwapIOError
from tests.engine_util import MLP, mlp_batches, train


def _run(*cmd) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


@contextlib.contextmanager
def small_fs(path, mib: int):
    """A file system of `mib` MiB mounted at `path`: ext4 on a loop device (no blocks reserved for root,
    who runs the tests here), else a tmpfs; skips (fails under OFFLOAD_CI=1) where neither mounts."""
    os.makedirs(path)
    image = f"{path}.img"
    with open(image, "wb") as f:
        f.truncate(mib << 20)
    tried = []
    for kind, cmd in (("ext4", ("mount", "-o", "loop", image, str(path))),
                      ("tmpfs", ("mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)))):
        if kind == "ext4":
            made = _run("mkfs.ext4", "-q", "-F", "-m", "0", image) if shutil.which("mkfs.ext4") else None
            if made is None or made.returncode:
                tried.append(f"mkfs.ext4: {made.stderr.strip() if made else 'not installed'}")
                continue
        mounted = _run(*cmd) if shutil.which("mount") else None
        if mounted is not None and mounted.returncode == 0:
            break
        tried.append(f"{' '.join(cmd[:3])}: {mounted.stderr.strip() if mounted else 'no mount command'}")
    else:
        os.remove(image)
        reason = "cannot mount a small file system here (" + "; ".join(tried) + ")"
        if os.environ.get("OFFLOAD_CI") == "1":
            pytest.fail(reason + "; OFFLOAD_CI=1 requires these tests to run (as root)")
        pytest.skip(reason)
    try:
        yield kind
    finally:
        if _run("umount", str(path)).returncode:
            _run("umount", "-l", str(path))
        os.remove(image)


def fill(directory) -> int:
    """Another writer fills the file system under `directory` to the last block; returns the bytes written."""
    written = 0
    with open(os.path.join(directory, "filler"), "wb") as f:
        for chunk in (1 << 20, 4096):
            block = b"\0" * chunk
            try:
                while True:
                    written += os.write(f.fileno(), block)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
    return written


def config(nvme_path) -> dict:
    return {"precision": "fp32", "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"},
            "nvme_path": str(nvme_path), "units": {"min_numel": 512}, "optimizer": {"lr": 1e-2}}


def test_a_full_swap_file_system_is_refused_before_and_named_when_it_fills(tmp_path):
    """16 MiB: a 4.2M-parameter model's swap (about 60 MB) is refused by the preflight, naming both sizes;
    a small model's fits, and when another writer fills the disk before its first step (the step writes the
    moments for the first time) the swap file cannot grow: SwapIOError with ENOSPC naming the swap file.
    The checkpoint saved before (on another file system) loads into a new engine that trains on as a run
    that never failed."""
    mnt = tmp_path / "mnt"
    torch.manual_seed(0)
    model, batches = MLP(), mlp_batches(3)
    with offload.initialize(copy.deepcopy(model), config(tmp_path / "ref")) as ref:
        straight = train(ref, batches)
    with small_fs(mnt, 16):
        with pytest.raises(PlacementError, match=r"nvme needs \d+ bytes .* but the free disk under nvme_path is "
                                                 r"\d+ bytes .*\(with int8 optimizer states, optimizer.states: int8 or "
                                                 r"--optimizer-states int8, it needs \d+ bytes"):
            offload.initialize(MLP(d=512, n_blocks=4), config(mnt / "swap"))
        eng = offload.initialize(copy.deepcopy(model), config(mnt / "swap"))
        try:
            ckpt = eng.save_checkpoint(str(tmp_path / "ckpts"))
            assert fill(mnt) > 0
            with pytest.raises(SwapIOError) as e:
                train(eng, batches[:1])
            assert e.value.errno == errno.ENOSPC and e.value.path.startswith(str(mnt / "swap"))
            assert "ENOSPC" in str(e.value) and str(mnt / "swap") in str(e.value)
        finally:
            eng.close()
    with offload.initialize(copy.deepcopy(model), config(tmp_path / "swap2")) as again:
        again.load_checkpoint(ckpt)
        assert train(again, batches) == straight


@pytest.mark.slow
def test_offload_train_on_a_disk_that_fills_stops_naming_the_save_and_resumes_elsewhere(tmp_path, monkeypatch,
                                                                                        capsys):
    """`offload train` with swap and checkpoints on one 64 MiB disk, saving every step; another writer fills
    the disk after the step-2 save. The step-3 save fails for real (ENOSPC): one line names the checkpoint,
    the step and the last good checkpoint (step 2, intact), the report of the 3 steps is written, exit 2.
    Resumed from step 2 with swap and checkpoints on another file system, the run continues exactly as a
    run that never failed."""
    from offload import train as training

    mnt = tmp_path / "mnt"
    flags = ["train", "--model", "tiny", "--steps", "4", "--batch-size", "2", "--seq-len", "32", "--no-progress",
             "--save-every", "1", "--keep-checkpoints", "4", "--json"]
    assert main([*flags, "--nvme-path", str(tmp_path / "s0"), "--checkpoint-dir", str(tmp_path / "c0"), "--out",
                 str(tmp_path / "r0")]) == 0
    straight = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["losses"]
    real_save = training.Checkpoints.save

    def fill_after_step_2(self, engine, step, **kw):
        path = real_save(self, engine, step, **kw)
        if step == 2:
            fill(mnt)
        return path

    with small_fs(mnt, 64):
        ckpts = mnt / "ckpts"
        monkeypatch.setattr(training.Checkpoints, "save", fill_after_step_2)
        assert main([*flags, "--nvme-path", str(mnt / "swap"), "--checkpoint-dir", str(ckpts), "--out",
                     str(tmp_path / "r1"), "--save-blocking"]) == 2  # the disk fills after step 2's save, not during
        monkeypatch.undo()
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert re.search(rf"saving the checkpoint {re.escape(str(ckpts / 'step00000003'))} after step 3 failed "
                         r"\(\[Errno 28\] No space left on device.*; training stopped there and the last good "
                         rf"checkpoint is {re.escape(str(ckpts / 'step00000002'))}", err), err
        report = json.load(open(tmp_path / "r1" / "report.json"))
        assert report["losses"] == straight[:3] and report["failed"]["step"] == 3
        assert sorted(os.listdir(ckpts)) == ["latest", "step00000001", "step00000002"]
        assert main([*flags, "--nvme-path", str(tmp_path / "s2"), "--checkpoint-dir", str(tmp_path / "c2"),
                     "--out", str(tmp_path / "r2"), "--resume", str(ckpts / "step00000002")]) == 0
    resumed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert resumed["run"]["start_step"] == 2 and resumed["losses"] == straight[2:]
