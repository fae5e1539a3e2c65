"""Checkpoints written in the background (issue 52): engine.save_checkpoint(..., background=True) returns a handle
at once; the checkpoint holds the step boundary where it was asked while training moves on (states on nvme held at
the swap, others' updates waiting until their unit is written), resumes bit for bit, is published atomically
(`latest` moves last), and a failure in the background surfaces at the next step or wait() with the previous
checkpoint intact."""

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import offload
from offload.checkpoint import format as fmt
from offload.checkpoint import background
from offload.checkpoint.background import BackgroundSaveError
from offload.checkpoint.datafile import DataFile
from tests.engine_util import MLP, mlp_batches, train
from tests.ranks_util import REPO, run_ranks

PLACES = {"hbm": "none", "dram": "cpu", "nvme": "nvme"}


def cfg(tmp_path, place: str, **extra) -> dict:
    return {"precision": "fp32", "offload_param": {"device": PLACES[place]},
            "offload_optimizer": {"device": PLACES[place]}, "nvme_path": str(tmp_path / "swap"),
            "units": {"min_numel": 512}, "optimizer": {"lr": 1e-2}, **extra}



@pytest.fixture
def slow_writes(monkeypatch):
    """Each write of a checkpoint's data file takes 20 ms longer: a save outlasts the steps after it."""
    original = DataFile.write

    def write(self, t, begin, end):
        time.sleep(0.02)
        return original(self, t, begin, end)

    monkeypatch.setattr(DataFile, "write", write)


@pytest.mark.parametrize("place", list(PLACES))
def test_a_background_checkpoint_holds_its_step_while_training_moves_on(tmp_path, place, slow_writes):
    data = mlp_batches(6)
    torch.manual_seed(0)
    with offload.initialize(MLP(), cfg(tmp_path, place)) as eng:
        train(eng, data[:2])
        saved = eng.full_state_dict()
        handle = eng.save_checkpoint(str(tmp_path / "ck"), background=True)
        assert not handle.done()  # it returned before the checkpoint was written
        straight = train(eng, data[2:])
        path = handle.wait()
        assert handle.done() and handle.stats()["seconds"] >= handle.stats()["exposed_s"] > 0
    assert path == str(tmp_path / "ck" / "step00000002") and fmt.resolve(str(tmp_path / "ck")) == path
    torch.manual_seed(0)
    with offload.initialize(MLP(), cfg(tmp_path, place)) as eng:
        eng.load_checkpoint(path)
        loaded = eng.full_state_dict()
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)  # step 2's weights, not a later step's
        assert train(eng, data[2:]) == straight  # and its moments and step counts: bit for bit


def test_with_states_on_nvme_training_never_waits_for_the_saver(tmp_path, monkeypatch):
    """[Note: background saves]: states on nvme are held at the swap, so steps run while the saver writes nothing
    (an update that waited for it would hang here); each checkpoint is its boundary's all the same, and the
    second save's superseded states go to the extents the first let go: the swap file grows by a fraction of
    what it grew the first time (first fit over extents of several sizes)."""
    go = threading.Event()
    original = DataFile.write

    def write(self, t, begin, end):
        assert go.wait(120), "the saver was never let go"
        return original(self, t, begin, end)

    monkeypatch.setattr(DataFile, "write", write)
    data = mlp_batches(8)
    torch.manual_seed(0)
    saved, sizes, losses = [], [], []
    with offload.initialize(MLP(), cfg(tmp_path, "nvme")) as eng:
        losses += train(eng, data[:2])
        sizes.append(eng.store.disk_bytes)
        for name in ("first", "second"):
            saved.append(eng.full_state_dict())
            go.clear()
            handle = eng.save_checkpoint(str(tmp_path / "ck"), name=name, background=True)
            assert handle.stats()["gated_units"] == 0 and handle.stats()["held_bytes"] > 0
            losses += train(eng, data[len(losses):len(losses) + 2])  # two steps, the saver stopped
            assert not handle.done()
            go.set()
            handle.wait()
            sizes.append(eng.store.disk_bytes)
    assert sizes[0] < sizes[1] <= sizes[2] < sizes[1] + (sizes[1] - sizes[0]) // 4, sizes
    for k, name in enumerate(("first", "second")):
        torch.manual_seed(0)
        with offload.initialize(MLP(), cfg(tmp_path, "nvme", nvme_path=str(tmp_path / f"swap{k}"))) as eng:
            eng.load_checkpoint(str(tmp_path / "ck" / name))
            loaded = eng.full_state_dict()
            assert all(torch.equal(loaded[key], saved[k][key]) for key in saved[k]), name
            assert train(eng, data[2 + 2 * k:len(losses)]) == losses[2 + 2 * k:], name


IOPRIO_GET = {"x86_64": 252, "aarch64": 31}


def test_the_saver_yields_the_cores_and_the_drive_to_the_step(tmp_path, monkeypatch):
    """The saver thread runs at SAVER_NICE below the process and, on Linux, in the idle I/O class (the drive
    serves the step first); handle.stats() counts its CPU time."""
    import ctypes
    import platform

    seen = {}
    original = DataFile.write

    def write(self, t, begin, end):
        tid = threading.get_native_id()
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, tid)
        if sys.platform == "linux" and platform.machine() in IOPRIO_GET:
            seen["io"] = ctypes.CDLL(None).syscall(IOPRIO_GET[platform.machine()], 1, tid)
        return original(self, t, begin, end)

    probe = threading.Thread(target=lambda: seen.update(allowed=background._set_io_idle(threading.get_native_id())))
    probe.start()
    probe.join()  # whether this OS lets a thread take the idle class (a container's seccomp may refuse it)

    monkeypatch.setattr(DataFile, "write", write)
    with offload.initialize(MLP(), cfg(tmp_path, "nvme")) as eng:
        train(eng, mlp_batches(1))
        handle = eng.save_checkpoint(str(tmp_path / "ck"), background=True)
        handle.wait()
    assert seen["nice"] == min(19, os.getpriority(os.PRIO_PROCESS, 0) + background.SAVER_NICE)
    assert not seen["allowed"] or seen["io"] == background.IOPRIO_IDLE
    assert handle.stats()["saver_cpu_s"] > 0


def test_without_room_to_hold_the_nvme_states_each_update_waits_for_its_unit(tmp_path, slow_writes):
    """The nvme budget leaves no room for held states beside the swap file: the save gates the updates as it
    does states in hbm or dram, and still holds its boundary."""
    data = mlp_batches(5)
    torch.manual_seed(0)
    with offload.initialize(MLP(), cfg(tmp_path, "nvme")) as eng:
        train(eng, data[:2])
        saved = eng.full_state_dict()
        eng.rt.tiers.acct["nvme"].budget_bytes = eng.store.disk_bytes
        handle = eng.save_checkpoint(str(tmp_path / "ck"), background=True)
        trained = sum(st is not None for st in eng.states)
        assert handle.stats()["held_bytes"] == 0 and handle.stats()["gated_units"] == trained > 0
        straight = train(eng, data[2:])
        path = handle.wait()
    torch.manual_seed(0)
    with offload.initialize(MLP(), cfg(tmp_path, "nvme", nvme_path=str(tmp_path / "swap2"))) as eng:
        eng.load_checkpoint(path)
        loaded = eng.full_state_dict()
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)
        assert train(eng, data[2:]) == straight


def test_a_second_save_waits_for_the_first_and_close_finishes_the_one_in_flight(tmp_path, slow_writes):
    with offload.initialize(MLP(), cfg(tmp_path, "nvme")) as eng:
        train(eng, mlp_batches(1))
        first = eng.save_checkpoint(str(tmp_path / "ck"), background=True)
        second = eng.save_checkpoint(str(tmp_path / "ck"), name="again", background=True)
        assert first.done()
    assert second.done() and fmt.resolve(str(tmp_path / "ck")) == str(tmp_path / "ck" / "again")
    for name in ("step00000001", "again"):
        fmt.verify(str(tmp_path / "ck" / name), fmt.read_manifest(str(tmp_path / "ck" / name)))
    assert sorted(os.listdir(tmp_path / "ck")) == ["again", fmt.LATEST, "step00000001"]  # no temporary left


def test_a_full_disk_in_the_background_fails_at_the_next_step_and_loses_nothing(tmp_path, monkeypatch):
    data = mlp_batches(5)
    torch.manual_seed(0)
    with offload.initialize(MLP(), cfg(tmp_path, "nvme")) as eng:
        straight = train(eng, data)
    torch.manual_seed(0)
    with offload.initialize(MLP(), cfg(tmp_path, "nvme")) as eng:
        got = train(eng, data[:2])
        good = eng.save_checkpoint(str(tmp_path / "ck"))

        def full(self, t, begin, end):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(DataFile, "write", full)
        handle = eng.save_checkpoint(str(tmp_path / "ck"), name="doomed", background=True)
        with pytest.raises(BackgroundSaveError, match=r"the background checkpoint .*doomed failed \(.*No space left on "
                                                      r"device.*\); nothing was published: the previous checkpoint and "
                                                      r"`latest` are as they were"):
            for x, y in data[2:]:  # the step that finds it failed raises it, once, after stepping
                loss = eng(x, y)
                eng.backward(loss)
                got.append(loss.item())
                eng.step()
        monkeypatch.undo()
        got += train(eng, data[len(got):])
        with pytest.raises(BackgroundSaveError):
            handle.wait()
    assert got == straight  # training was untouched
    assert fmt.resolve(str(tmp_path / "ck")) == good and sorted(os.listdir(tmp_path / "ck")) == [fmt.LATEST, "step00000002"]


def test_background_is_refused_inside_an_accumulation_window(tmp_path):
    with offload.initialize(MLP(), cfg(tmp_path, "dram", gradient_accumulation_steps=2)) as eng:
        x, y = mlp_batches(1)[0]
        eng.backward(eng(x, y))
        with pytest.raises(ValueError, match=r"background=True\): at this boundary the gradient accumulator must be "
                                             r"saved.*save blocking"):
            eng.save_checkpoint(str(tmp_path / "ck"), background=True)
        assert not os.path.exists(tmp_path / "ck" / fmt.LATEST)


KILLED = r"""
import os, signal, sys, time, torch
sys.path.insert(0, {repo!r})
import offload
from offload.checkpoint.datafile import DataFile
from tests.engine_util import MLP, mlp_batches, train
original = DataFile.write
def write(self, t, begin, end):
    time.sleep(0.05)
    return original(self, t, begin, end)
torch.manual_seed(0)
eng = offload.initialize(MLP(), {cfg!r})
data = mlp_batches(3)
for x, y in data[:2]:
    eng.backward(eng(x, y)); eng.step()
eng.save_checkpoint({ck!r})
DataFile.write = write
x, y = data[2]
eng.backward(eng(x, y)); eng.step()
eng.save_checkpoint({ck!r}, background=True)
time.sleep(0.3)  # some of its units written, not all
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_kill_9_during_a_background_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    ck = str(tmp_path / "ck")
    script = KILLED.format(repo=REPO, cfg=cfg(tmp_path, "nvme"), ck=ck)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert fmt.resolve(ck) == os.path.join(ck, "step00000002")
    assert any(n.startswith(".") or "tmp" in n for n in os.listdir(ck) if n not in (fmt.LATEST, "step00000002"))
    torch.manual_seed(0)
    with offload.initialize(MLP(), cfg(tmp_path, "nvme", nvme_path=str(tmp_path / "swap2"))) as eng:
        eng.load_checkpoint(ck)
        assert eng.step_count == 2


@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow), 2])
def test_over_ranks_each_rank_writes_its_part_and_a_later_step_publishes(tmp_path, stage):
    base = {**cfg(tmp_path, "nvme"), "zero_stage": stage, "chunk_bytes": 8192}
    a = run_ranks(2, {**base, "nvme_path": str(tmp_path / "sa"), "_save_at": 2, "_save_background": True},
                  str(tmp_path / "a"), 4)
    ckpt = str(tmp_path / "a.ckpt")
    manifest = fmt.read_manifest(fmt.resolve(ckpt))
    assert manifest["step_count"] == 2 and manifest["world_size"] == 2
    # Published at a later step boundary, the same one on both ranks: the first at which both had written
    # their part (3 or 4: a rank's writes may outlast a step of this tiny model).
    published = [r["background"]["published_at"] for r in a]
    assert published[0] == published[1] and published[0] in (3, 4), published
    b = run_ranks(2, {**base, "nvme_path": str(tmp_path / "sb"), "_load": ckpt}, str(tmp_path / "b"), 4)
    assert b[0]["losses"] == a[0]["losses"][2:]
    assert json.dumps(b[1]["losses"]) == json.dumps(a[1]["losses"][2:])


@pytest.mark.parametrize("blocking", [False, True])
def test_offload_train_saves_in_the_background_unless_told_and_resumes_exactly(tmp_path, blocking, capsys):
    """--save-every writes in the background by default (--save-blocking: not); the summary says how long the
    checkpoints took and how much of it training waited; a run resumed from the background checkpoint of step
    2 gives the straight run's losses from step 3 on, bit for bit (the data order and the RNG states with it)."""
    from offload import recipe
    from offload import train as training

    def args(*extra):
        return recipe.train_parser().parse_args(["--model", "tiny", "--steps", "4", "--batch-size", "2", "--seq-len",
                                                 "32", "--nvme-path", str(tmp_path / "nvme"), "--no-progress",
                                                 "--checkpoint-dir", str(tmp_path / "ck"), "--keep-checkpoints", "5",
                                                 *extra])

    straight = training.train(args("--save-every", "2", "--out", str(tmp_path / "a"),
                                   *(["--save-blocking"] if blocking else [])))
    ck = straight["checkpoints"]
    assert ck["saved"] == 2 and ck["background"] == (0 if blocking else 2)
    assert [r["step"] for r in ck["rows"]] == [2, 4] and all(r["seconds"] is not None for r in ck["rows"])
    if blocking:
        assert ck["exposed_s"] == ck["seconds"] and ck["hidden_s"] == 0
    assert "checkpoints 2 saved (" + ("blocking" if blocking else "2 in the background") in capsys.readouterr().out
    resumed = training.train(args("--resume", str(tmp_path / "ck" / "step00000002"), "--out", str(tmp_path / "b")))
    assert resumed["losses"] == straight["losses"][2:]
