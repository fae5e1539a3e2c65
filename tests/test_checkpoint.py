"""Checkpoints (offload.checkpoint.saving, loading, state_dict): exact resume for every placement and step
path, into another placement and in a new process; damaged files detected; interrupted saves harmless to the
previous checkpoint; engine.state_dict() with real values; `offload train --resume`; export to Hugging Face."""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import offload
from offload.checkpoint import datafile
from offload.checkpoint import format as fmt
from offload.checkpoint.datafile import DataFile
from offload.checkpoint.format import CheckpointError
from offload.cli import main
from tests.checkpoint_util import config, train
from tests.engine_util import MLP, llama, llama_batches, mlp_batches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("none", "cpu", "nvme")  # weights and optimizer states both there
PATHS = {
    "plain": {},
    "accumulation+clipping": {"gradient_accumulation_steps": 2, "gradient_clipping": 0.05},
    # a scale that overflows at first: skipped steps, halvings, then growth every 2 good steps
    "fp16": {"precision": "fp16", "loss_scale": {"initial": 2.0**18, "growth_interval": 2}},
    "delayed+clipping": {"delayed_update": True, "gradient_clipping": 0.05},
}
COUNTERS = ("step_count", "micro_step", "loss_scale", "good_steps", "skipped_steps", "pending_update", "accumulator")


def state(path) -> dict:
    """Everything a checkpoint says about the run: every tensor's ranges with their crc32 (masters, moments,
    accumulator, frozen weights), step counts, and the counters."""
    m = fmt.read_manifest(path)
    return {"tensors": m["tensors"], **{k: m[k] for k in COUNTERS}}


def check_resume(tmp_path, model, cfg_a, cfg_b, batches, k: int):
    """N micro-batches straight == k, save, a new engine (cfg_b), load, N - k: losses and final states."""
    losses, straight = train(model, cfg_a, batches, tmp_path / "straight")
    first, mid = train(model, cfg_a, batches[:k], tmp_path / "first")
    second, resumed = train(model, cfg_b, batches[k:], tmp_path / "second", load=mid)
    assert first + second == losses
    assert state(resumed) == state(straight)
    return mid


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", MODES)
def test_exact_resume(tmp_path, mode, path):
    torch.manual_seed(0)
    extra = PATHS[path]
    gas = extra.get("gradient_accumulation_steps", 1)
    cfg = config(tmp_path, mode, **extra)
    mid = check_resume(tmp_path, MLP(), cfg, cfg, mlp_batches(6 * gas), k=3 * gas)
    m = fmt.read_manifest(mid)
    assert m["step_count"] == (1 if path == "fp16" else 3) and m["accumulator"] == (path == "delayed+clipping")
    if path == "fp16":  # saved between a good step and the growth after the next
        assert (m["skipped_steps"], m["loss_scale"], m["good_steps"]) == (2, 2.0**16, 1)


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_exact_resume_inside_an_accumulation_window(tmp_path, mode):
    """Saved after 1 of 2 micro-steps: the accumulator is saved and the window completes after the load."""
    torch.manual_seed(0)
    cfg = config(tmp_path, mode, gradient_accumulation_steps=2, gradient_clipping=0.05)
    mid = check_resume(tmp_path, MLP(frozen=True), cfg, cfg, mlp_batches(8), k=3)
    m = fmt.read_manifest(mid)
    assert m["micro_step"] == 1 and m["accumulator"] and os.path.basename(mid) == "step00000001-micro1"
    assert m["tensors"]["inp.weight"]["trainable"] is False and "weight" in m["tensors"]["inp.weight"]


@pytest.mark.parametrize("before,after,path", [("nvme", "cpu", "delayed+clipping"), ("cpu", "nvme", "fp16"),
                                               ("none", "nvme", "accumulation+clipping"), ("nvme", "none", "plain")])
def test_exact_resume_at_another_placement(tmp_path, before, after, path):
    torch.manual_seed(0)
    extra = PATHS[path]
    gas = extra.get("gradient_accumulation_steps", 1)
    k = 3 * gas - (gas > 1)  # inside a window when accumulating
    check_resume(tmp_path, MLP(frozen=True), config(tmp_path / "a", before, **extra),
                 config(tmp_path / "b", after, **extra), mlp_batches(6 * gas), k=k)


def test_exact_resume_in_a_new_process_restores_the_rng(tmp_path):
    torch.manual_seed(0)
    model, batches = MLP(), mlp_batches(6)
    cfg = config(tmp_path, "nvme", **PATHS["delayed+clipping"])
    losses, straight = train(model, cfg, batches, tmp_path / "straight")
    first, mid = train(model, cfg, batches[:3], tmp_path / "first")
    expected_rand = torch.rand(3).tolist()  # what the RNG gives right after the save
    torch.save({"model": model, "batches": batches[3:], "cfg": cfg}, tmp_path / "job.pt")
    script = textwrap.dedent(f"""
        import json, torch
        from tests.checkpoint_util import train
        job = torch.load({str(tmp_path / 'job.pt')!r}, weights_only=False)
        import offload, copy
        with offload.initialize(copy.deepcopy(job["model"]), job["cfg"]) as eng:
            eng.load_checkpoint({mid!r})
            rand = torch.rand(3).tolist()
        losses, path = train(job["model"], job["cfg"], job["batches"], {str(tmp_path / 'second')!r}, load={mid!r})
        print(json.dumps({{"losses": losses, "path": path, "rand": rand}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert first + result["losses"] == losses and result["rand"] == expected_rand
    assert state(result["path"]) == state(straight)


# --- damage and mismatches are detected before anything changes -----------------------------------------

@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    cfg = config(tmp_path, "nvme")
    _, path = train(model, cfg, mlp_batches(2), tmp_path / "ckpts")
    return model, cfg, path


def _load_fails(model, cfg, path, match):
    with offload.initialize(copy.deepcopy(model), cfg) as eng:
        before = eng.full_state_dict()
        with pytest.raises(CheckpointError, match=match):
            eng.load_checkpoint(path)
        after = eng.full_state_dict()
        assert all(torch.equal(before[n], after[n]) for n in before) and eng.step_count == 0


def test_a_flipped_byte_names_file_tensor_and_range(saved, capsys):
    model, cfg, path = saved
    r = fmt.read_manifest(path)["tensors"]["blocks.1.fc2.weight"]["exp_avg_sq"]["ranges"][0]
    with open(os.path.join(path, "rank0.bin"), "r+b") as f:
        f.seek(r["offset"] + 100)
        byte = f.read(1)
        f.seek(r["offset"] + 100)
        f.write(bytes([byte[0] ^ 0x10]))
    _load_fails(model, cfg, path, r"rank0\.bin: bytes \[\d+, \d+\) \(blocks\.1\.fc2\.weight exp_avg_sq elements "
                                  r"\[0, 8192\)\): crc32 .* damaged")
    assert main(["checkpoint", "inspect", path, "--verify"]) == 2
    assert "the file is damaged" in capsys.readouterr().err


def test_a_truncated_file_is_detected(saved):
    model, cfg, path = saved
    data = os.path.join(path, "rank0.bin")
    os.truncate(data, os.path.getsize(data) - 10)
    _load_fails(model, cfg, path, r"rank0\.bin: \d+ bytes, the manifest says \d+ \(truncated")


def test_format_version_names_and_shapes_are_checked(saved, tmp_path):
    model, cfg, path = saved
    _load_fails(MLP(d=32), cfg, path, r"does not match this model: .*blocks\.0\.fc1\.weight: shape \(128, 64\) in the "
                                      r"checkpoint, \(64, 32\) here")
    _load_fails(MLP(n_blocks=2), cfg, path, r"absent from this model: blocks\.2\.fc1\.bias, blocks\.2\.fc1\.weight")
    _load_fails(model, {**cfg, "precision": "fp16"}, path, r"precision='fp16': .* trained in 'bf16'")
    manifest = os.path.join(path, "manifest.json")
    m = json.load(open(manifest))
    m["format_version"] = 2
    json.dump(m, open(manifest, "w"))
    _load_fails(model, cfg, path, r"format_version=2; this offload reads version 1; written by a newer offload")


# --- the manifest checked, names contained, this run's prune, never half-loaded ---------------------------------

def test_a_flipped_digit_in_the_manifest_is_refused_by_name(saved, capsys):
    model, cfg, path = saved
    manifest = os.path.join(path, "manifest.json")
    text = open(manifest).read()
    assert '"step_count": 2,' in text
    with open(manifest, "w") as f:  # valid JSON, a plausible step: only the digest tells
        f.write(text.replace('"step_count": 2,', '"step_count": 3,'))
    _load_fails(model, cfg, path, r"manifest\.json: its sha256 is [0-9a-f]{64}, the manifest_sha256 it holds is .*"
                                  r"damaged or edited")
    assert main(["checkpoint", "inspect", path]) == 2
    assert "manifest.json: its sha256" in capsys.readouterr().err


def test_a_checkpoint_of_an_older_offload_loads_with_one_warning(saved, caplog):
    """Written before the digest and the run id: loaded (refusing would strand earlier runs), said in one
    line, and never pruned (no run id says whose it is)."""
    model, cfg, path = saved
    manifest = os.path.join(path, "manifest.json")
    m = json.load(open(manifest))
    del m["manifest_sha256"], m["run_id"]
    json.dump(m, open(manifest, "w"))
    caplog.set_level("WARNING", logger="offload")
    with offload.initialize(copy.deepcopy(model), cfg) as eng:
        eng.load_checkpoint(path)
        assert eng.step_count == 2
        old = [r.message for r in caplog.records if "manifest_sha256" in r.message]
        assert len(old) == 1 and "older offload" in old[0] and "\n" not in old[0]
        d = os.path.dirname(path)
        eng.backward(eng(*mlp_batches(3)[2]))
        eng.step()
        eng.save_checkpoint(d, keep=1)
    assert sorted(fmt.list_checkpoints(d)) == ["step00000002", "step00000003"]


@pytest.mark.parametrize("damage,match", [
    (lambda m: m.pop("tensors"), r"manifest\.json: tensors is missing"),
    (lambda m: m["tensors"]["blocks.0.fc1.weight"]["master"]["ranges"][0].pop("crc32"),
     r"manifest\.json: tensors\.blocks\.0\.fc1\.weight\.master\.ranges\[0\]\.crc32 is missing"),
    (lambda m: m.__setitem__("step_count", "2"), r"manifest\.json: step_count is '2', not of the type"),
    (lambda m: m["files"]["rank0.bin"].__setitem__("nbytes", None), r"files\.rank0\.bin\.nbytes is None"),
])
def test_a_manifest_of_broken_structure_is_a_checkpoint_error_naming_the_file(saved, damage, match):
    """A manifest edited with its digest recomputed (or an older one without): its structure is checked, so a
    missing or mistyped field is a CheckpointError naming the file and the field, not a KeyError."""
    model, cfg, path = saved
    manifest = os.path.join(path, "manifest.json")
    m = json.load(open(manifest))
    damage(m)
    m["manifest_sha256"] = fmt.manifest_digest(m)
    json.dump(m, open(manifest, "w"))
    _load_fails(model, cfg, path, match)


def test_a_missing_data_file_is_a_checkpoint_error_naming_it(saved):
    model, cfg, path = saved
    os.remove(os.path.join(path, "rank0.bin"))
    _load_fails(model, cfg, path, r"rank0\.bin: missing \(the manifest lists it: rank 0's \d+ bytes\); the "
                                  r"checkpoint is incomplete")


def test_latest_names_one_checkpoint_of_its_own_directory(saved, tmp_path):
    model, cfg, path = saved
    d = os.path.dirname(path)
    outside = tmp_path / "outside"
    os.makedirs(outside)
    os.rename(path, outside / "ckpt")  # a real checkpoint, outside the directory `latest` is in
    os.symlink(outside / "ckpt", os.path.join(d, "linked"))
    for name in ("../outside/ckpt", str(outside / "ckpt"), "..", ".tmp-step00000002"):
        with open(os.path.join(d, "latest"), "w") as f:
            f.write(name + "\n")
        with pytest.raises(CheckpointError, match=r"latest: names .*, which is not a checkpoint of .*; write the "
                                                  r"name of one of its checkpoints"):
            fmt.resolve(d)
    with open(os.path.join(d, "latest"), "w") as f:
        f.write("linked\n")
    with pytest.raises(CheckpointError, match=r"latest: names .*linked, a symlink"):
        fmt.resolve(d)
    assert fmt.resolve(str(outside / "ckpt")) == str(outside / "ckpt")  # named itself, it loads


def test_a_symlink_planted_at_the_latest_temporary_is_not_written_through(tmp_path, monkeypatch):
    """`.latest.tmp` in a directory others can write: a symlink there is replaced, never followed; and every
    file a save creates is opened O_CREAT|O_EXCL|O_NOFOLLOW (without either flag a race between the removal
    of a planted name and the open would write through it)."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    d = tmp_path / "ckpts"
    d.mkdir()
    os.symlink(victim, d / ".latest.tmp")
    opened = []
    real_open = os.open

    def recording_open(path, flags, *args, **kwargs):
        if str(path).startswith(str(d)) and flags & (os.O_WRONLY | os.O_RDWR):
            opened.append((os.path.basename(path), flags))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording_open)
    with offload.initialize(MLP(), config(tmp_path, "cpu")) as eng:
        path = eng.save_checkpoint(str(d))
    assert victim.read_text() == "precious\n"
    assert (d / "latest").read_text() == "step00000000\n" and not os.path.lexists(d / ".latest.tmp")
    assert {name for name, _ in opened} == {"rank0.bin", "manifest.json", ".latest.tmp"}
    for name, flags in opened:
        assert flags & os.O_CREAT and flags & os.O_EXCL and flags & os.O_NOFOLLOW, name
    assert fmt.resolve(str(d)) == path and fmt.resolve(str(d / "latest")) == path  # `latest` itself names it too


def test_keep_prunes_this_runs_oldest_by_step_not_by_file_time(tmp_path):
    """Two runs share a directory: each prunes only its own checkpoints, the oldest by the step in their
    manifests (a copied or restored checkpoint's file time says nothing); a run resumed from a checkpoint
    continues that run and prunes its earlier checkpoints."""
    torch.manual_seed(0)
    d, batches = str(tmp_path / "ckpts"), mlp_batches(5)
    with offload.initialize(MLP(), config(tmp_path / "other", "cpu")) as other:
        other.save_checkpoint(d, name="other-run")
    with offload.initialize(MLP(), config(tmp_path, "cpu")) as eng:
        for x, y in batches[:2]:
            eng.backward(eng(x, y))
            eng.step()
            eng.save_checkpoint(d)
        os.utime(os.path.join(d, "step00000002", "manifest.json"), (1, 1))  # newest step, oldest file time
        eng.backward(eng(*batches[2]))
        eng.step()
        eng.save_checkpoint(d, keep=2)
        assert sorted(os.listdir(d)) == ["latest", "other-run", "step00000002", "step00000003"]
    with offload.initialize(MLP(), config(tmp_path / "resumed", "cpu")) as eng:
        eng.load_checkpoint(os.path.join(d, "step00000002"))
        eng.backward(eng(*batches[2]))
        eng.step()
        eng.save_checkpoint(d, name="step00000003-again", keep=2)  # the same run: step 2 is its oldest now
    assert sorted(os.listdir(d)) == ["latest", "other-run", "step00000003", "step00000003-again"]
    assert fmt.list_checkpoints(d) == ["other-run", "step00000003", "step00000003-again"]


class _FailingStoreWrites:
    """The swap store's writes fail from the `after`-th on (as a drive that fills up would): its `write`
    replaced on the instance, so every part holding the store sees it; restore() puts it back."""

    def __init__(self, store, after: int):
        self.store, self.left, self._write = store, after, store.write
        store.write = self.write

    def write(self, *a, **kw):
        self.left -= 1
        if self.left < 0:
            raise OSError(28, "No space left on device (injected)")
        return self._write(*a, **kw)

    def restore(self) -> None:
        del self.store.write


def test_a_load_that_fails_after_verification_fails_the_engine(saved, tmp_path):
    """Everything verified, then a swap write fails half-way through writing the states: the engine is not
    left half-loaded and usable; it is failed with the cause, as a failed step is, and close() still works."""
    from offload.step.pipeline import Phase, StepFailed

    model, cfg, path = saved
    eng = offload.initialize(copy.deepcopy(model), {**cfg, "nvme_path": str(tmp_path / "swap2")})
    try:
        failing = _FailingStoreWrites(eng.store, after=3)
        with pytest.raises(OSError, match="injected"):
            eng.load_checkpoint(path)
        failing.restore()
        assert eng.phase is Phase.FAILED
        x, y = mlp_batches(1)[0]
        for call in (lambda: eng(x, y), eng.step, eng.full_state_dict, lambda: eng.save_checkpoint(str(tmp_path))):
            with pytest.raises(StepFailed, match=r"loading the checkpoint .*step00000002 failed after it began "
                                                 r"writing the engine's states \(OSError: .*injected.*load the "
                                                 r"checkpoint into a new engine"):
                call()
    finally:
        eng.close()
    with offload.initialize(copy.deepcopy(model), cfg) as again:  # the checkpoint itself is fine
        again.load_checkpoint(path)
        assert again.step_count == 2


# --- atomic saves --------------------------------------------------------------------------------------------

class Interrupted(Exception):
    pass


def _fail_on_call(n: int, fn):
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise Interrupted(f"interrupted at call {n}")
        return fn(*args, **kwargs)
    return wrapper


INTERRUPTIONS = {  # where a save stops: (object, attribute, failing call)
    "data write": (DataFile, "write", 5),
    "data fsync": (os, "fsync", 1),
    "manifest": (fmt, "_write_synced", 1),
    "directory rename": (os, "rename", 1),
    "latest": (os, "replace", 1),
}


@pytest.mark.parametrize("point", INTERRUPTIONS)
def test_an_interrupted_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch, point):
    torch.manual_seed(0)
    model, batches, cfg, d = MLP(), mlp_batches(4), config(tmp_path, "cpu"), tmp_path / "ckpts"
    with offload.initialize(copy.deepcopy(model), cfg) as eng:
        for x, y in batches[:2]:
            eng.backward(eng(x, y))
            eng.step()
        previous = eng.save_checkpoint(str(d))
        eng.backward(eng(*batches[2]))
        eng.step()
        obj, attr, n = INTERRUPTIONS[point]
        monkeypatch.setattr(obj, attr, _fail_on_call(n, getattr(obj, attr)))
        with pytest.raises(Interrupted):
            eng.save_checkpoint(str(d))
        monkeypatch.undo()
    assert fmt.resolve(str(d)) == previous
    assert not [n for n in os.listdir(d) if n.startswith(".tmp-")]  # the partial save removed itself
    if point == "latest":  # renamed into place, complete; only `latest` still names the previous one
        assert sorted(os.listdir(d)) == ["latest", "step00000002", "step00000003"]
    else:
        assert sorted(os.listdir(d)) == ["latest", "step00000002"]
    second, _ = train(model, cfg, batches[2:], tmp_path / "again", load=str(d))
    straight, _ = train(model, cfg, batches, tmp_path / "straight")
    assert second == straight[2:]


KILL_SCRIPT = """
import os, sys, time, torch, offload
from offload.checkpoint.datafile import DataFile
from tests.engine_util import MLP, mlp_batches
from tests.checkpoint_util import config
torch.manual_seed(0)
cfg = config(__import__("pathlib").Path(sys.argv[1]), "nvme")
with offload.initialize(MLP(), cfg) as eng:
    for x, y in mlp_batches(2):
        eng.backward(eng(x, y))
        eng.step()
    eng.save_checkpoint(sys.argv[2])
    eng.backward(eng(*mlp_batches(3)[2]))
    eng.step()
    def stall(*args, **kwargs):
        print("saving", flush=True)
        time.sleep(60)
    if sys.argv[3] == "data":
        DataFile.write = stall   # killed while writing the data file
    else:
        os.rename = stall                    # killed with data and manifest written, before the rename
    eng.save_checkpoint(sys.argv[2])
"""


@pytest.mark.parametrize("point", ["data", "rename"])
def test_sigkill_during_a_save_leaves_the_previous_checkpoint(tmp_path, point):
    d = tmp_path / "ckpts"
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(tmp_path), str(d), point], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})
    try:
        assert proc.stdout.readline().strip() == "saving"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert os.path.basename(fmt.resolve(str(d))) == "step00000002"
    assert os.path.isdir(d / ".tmp-step00000003")  # the killed save's leftover: never read
    torch.manual_seed(0)
    with offload.initialize(MLP(), config(tmp_path / "b", "cpu")) as eng:
        eng.load_checkpoint(str(d))
        assert eng.step_count == 2
        eng.backward(eng(*mlp_batches(3)[2]))
        eng.step()
        eng.save_checkpoint(str(d))  # the same name again: the leftover is replaced
    assert sorted(os.listdir(d)) == ["latest", "step00000002", "step00000003"]


def test_keep_prunes_the_oldest(tmp_path):
    torch.manual_seed(0)
    d = str(tmp_path / "ckpts")
    with offload.initialize(MLP(), config(tmp_path, "cpu")) as eng:
        for x, y in mlp_batches(4):
            eng.backward(eng(x, y))
            eng.step()
            eng.save_checkpoint(d, keep=2)
        with pytest.raises(FileExistsError, match="exists"):
            eng.save_checkpoint(d)
        eng.save_checkpoint(d, name="final", keep=1)
    assert sorted(os.listdir(d)) == ["final", "latest"]
    assert fmt.list_checkpoints(d) == ["final"] and fmt.resolve(d).endswith("final")


def test_checkpoint_refused_mid_step(tmp_path):
    with offload.initialize(MLP(), config(tmp_path, "cpu")) as eng:
        x, y = mlp_batches(1)[0]
        eng.backward(eng(x, y))
        with pytest.raises(RuntimeError, match=r"save or load between steps \(after engine.step\(\)\)"):
            eng.save_checkpoint(str(tmp_path / "c"))
        eng.step()
        with torch.no_grad():
            eng(x, y)  # a forward without backward (evaluation) changes nothing: saving is fine
        assert os.path.isdir(eng.save_checkpoint(str(tmp_path / "c")))


class PeakRSS:
    """The process's peak resident memory above its level at entry, sampled every 2 ms."""

    def __enter__(self):
        import threading

        import psutil

        proc = psutil.Process()
        self.base = self.peak = proc.memory_info().rss
        self._stop = threading.Event()

        def sample():
            while not self._stop.is_set():
                self.peak = max(self.peak, proc.memory_info().rss)
                self._stop.wait(0.002)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.extra_bytes = self.peak - self.base


def test_saving_and_loading_nvme_states_stays_within_a_bound(tmp_path):
    """States (fp32 master, exp_avg, exp_avg_sq) of 4x the bound and more pass through a few pool chunks."""
    bound = 64 << 20
    with torch.device("meta"):
        model = MLP(d=1024, n_blocks=6)  # 25M parameters: 300 MB of fp32 states on nvme
    states_bytes = 12 * sum(p.numel() for p in model.parameters())
    assert states_bytes >= 4 * bound
    with offload.initialize(model, {**config(tmp_path, "nvme"), "chunk_bytes": 4 << 20}) as eng:
        eng.backward(eng(torch.randn(8, 16), torch.randn(8, 4)))
        eng.step()
        with PeakRSS() as save:
            path = eng.save_checkpoint(str(tmp_path / "ckpts"))
        with PeakRSS() as load:
            eng.load_checkpoint(path)
    assert os.path.getsize(os.path.join(path, "rank0.bin")) >= states_bytes
    assert save.extra_bytes < bound and load.extra_bytes < bound, (save.extra_bytes, load.extra_bytes)


# --- state_dict ----------------------------------------------------------------------------------------------

class WithBuffers(MLP):
    def __init__(self):
        super().__init__()
        self.register_buffer("running", torch.arange(4.0))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_state_dict_has_real_values_from_every_tier(tmp_path, mode):
    torch.manual_seed(0)
    model = WithBuffers()
    keys = list(copy.deepcopy(model).state_dict())
    with offload.initialize(model, config(tmp_path, mode)) as eng:
        for x, y in mlp_batches(2):
            eng.backward(eng(x, y))
            eng.step()
        assert eng.module.blocks[0].fc1.weight.numel() == 0  # released: a placeholder
        sd = eng.state_dict()
        full = eng.full_state_dict()
        assert list(sd) == keys and torch.equal(sd["running"], torch.arange(4.0))
        assert all(torch.equal(sd[n], full[n]) and sd[n].dtype == torch.float32 for n in full)
        assert eng.state_dict(prefix="engine.").keys() == {f"engine.{k}" for k in keys}
        with pytest.raises(RuntimeError, match=r"WithBuffers.state_dict\(\): .* use engine.state_dict\(\)"):
            eng.module.state_dict()
        with pytest.raises(RuntimeError, match=r"Linear.state_dict\(\): .*engine.state_dict"):
            eng.module.blocks[0].fc1.state_dict()
        with pytest.raises(RuntimeError, match=r"load_state_dict\(\): .* use engine.load_state_dict"):
            eng.module.load_state_dict({k: torch.zeros_like(v) for k, v in sd.items()})
        assert all(torch.equal(full[n], v) for n, v in eng.full_state_dict().items())  # nothing written


def test_state_dict_of_tied_weights_shares_one_tensor(tmp_path):
    from tests.engine_util import LlamaLoss

    with offload.initialize(LlamaLoss(llama(tied=True)), config(tmp_path, "cpu")) as eng:
        sd = eng.state_dict()
        assert sd["lm.lm_head.weight"] is sd["lm.model.embed_tokens.weight"]


@pytest.mark.parametrize("before,after", [("cpu", "nvme"), ("nvme", "none")])
def test_load_state_dict_writes_the_homes(tmp_path, before, after):
    torch.manual_seed(0)
    model, batches = WithBuffers(), mlp_batches(3)
    with offload.initialize(copy.deepcopy(model), config(tmp_path / "a", before)) as eng:
        for x, y in batches[:2]:
            eng.backward(eng(x, y))
            eng.step()
        sd = eng.state_dict()
        sd["running"] = torch.full((4,), 7.0)
        with torch.no_grad():
            loss = eng(*batches[2]).item()
    with offload.initialize(copy.deepcopy(model), config(tmp_path / "b", after)) as eng:
        assert eng.load_state_dict(sd) == ([], [])
        full = eng.full_state_dict()
        assert all(torch.equal(full[n], sd[n]) for n in full) and torch.equal(eng.module.running, sd["running"])
        with torch.no_grad():
            assert eng(*batches[2]).item() == loss  # the weights too, in the compute dtype

        bad = {**sd, "head.weight": torch.zeros(3, 3)}
        with pytest.raises(RuntimeError, match=r"size mismatch for head.weight: copying a param with shape \(3, 3\)"):
            eng.load_state_dict(bad)
        partial = {k: v for k, v in sd.items() if k != "head.bias"} | {"extra": torch.ones(1)}
        with pytest.raises(RuntimeError, match=r'(?s)Unexpected key\(s\) in state_dict: "extra"'
                                               r'.*Missing key\(s\) in state_dict: "head.bias"'):
            eng.load_state_dict(partial)
        zeros = {k: torch.zeros_like(v) for k, v in partial.items()}
        result = eng.load_state_dict(zeros, strict=False)
        assert result.missing_keys == ["head.bias"] and result.unexpected_keys == ["extra"]
        after_sd = eng.state_dict()
        assert torch.equal(after_sd["head.bias"], sd["head.bias"]) and not after_sd["head.weight"].any()


# --- offload train and the checkpoint command ------------------------------------------------------------------

def test_offload_train_resume_continues_the_loss_curve(tmp_path, capsys):
    from offload import train as training

    d = str(tmp_path / "ckpts")
    settings = {"model": "tiny", "steps": 4, "batch_size": 2, "seq_len": 32, "nvme_path": str(tmp_path / "swap"),
                "no_progress": True, "save_every": 2, "checkpoint_dir": d, "keep_checkpoints": 3, "clip": 0.5}
    straight = training.train({**settings, "out": str(tmp_path / "run1"), "resume": "latest"})  # none yet: step 0
    assert "no checkpoint in" in capsys.readouterr().err
    assert fmt.list_checkpoints(d) == ["step00000002", "step00000004"]
    resumed = training.train({**settings, "out": str(tmp_path / "run2"), "resume": os.path.join(d, "step00000002")})
    assert resumed["losses"] == straight["losses"][2:] and resumed["run"]["start_step"] == 2
    with pytest.raises(ValueError, match=r"trained with batch_size=2 \(here batch_size=4\)"):
        training.train({**settings, "batch_size": 4, "resume": "latest"})
    with pytest.raises(ValueError, match="nothing is left to train"):
        training.train({**settings, "resume": "latest"})

    assert main(["checkpoint", "inspect", d, "--verify", "--json"]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["step_count"] == 4 and info["verified"] and info["precision"] == straight["precision"]  # auto: the host's
    assert info["extra"] == ["hf_config", "hf_names", "train"]
    transformers = pytest.importorskip("transformers")
    assert main(["checkpoint", "export", d, str(tmp_path / "hf"), "--dtype", "bf16"]) == 0
    hf, loading = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"]
    assert hf.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("blocking", [True, False])
def test_offload_train_names_a_failed_save_keeps_the_last_good_checkpoint_and_reports(tmp_path, monkeypatch, capsys,
                                                                                      blocking):
    """ENOSPC on --checkpoint-dir at step 4: one line naming the checkpoint's path, the step, the cause and the
    last good checkpoint; the report of the steps done is written (4; in the background the failure is found
    at the end of a later step); exit 2; resuming continues from step 2."""
    d, out = tmp_path / "ckpts", tmp_path / "run"
    real_write = os.write

    def full_at_step_4(fd, data):  # every write to the step-4 checkpoint's data file: a full disk
        if f"{os.sep}.tmp-step00000004{os.sep}" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(datafile.os, "write", full_at_step_4)
    flags = ["train", "--model", "tiny", "--steps", "6", "--batch-size", "2", "--seq-len", "32", "--nvme-path",
             str(tmp_path / "swap"), "--no-progress", "--save-every", "2", "--checkpoint-dir", str(d),
             *(["--save-blocking"] if blocking else [])]
    assert main([*flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(rf"offload train: error: saving the checkpoint {re.escape(str(d / 'step00000004'))} after step 4 "
                        r"failed \(\[Errno 28\] No space left on device \(writing \d+ bytes at byte 0\): '.*rank0\.bin'\); "
                        rf"training stopped there and the last good checkpoint is {re.escape(str(d / 'step00000002'))} "
                        rf"\(continue from it with --resume\); report in {re.escape(str(out))}; free space on "
                        r"--checkpoint-dir or point it elsewhere", err), err
    report = json.load(open(out / "report.json"))
    # in the background, found at the first step boundary after the saver failed: step 5's end, or step 6's where
    # the saver (at a lower priority) had not reached its first write by then
    assert len(report["losses"]) in ((4,) if blocking else (5, 6)) and report["failed"]["step"] == 4
    assert report["failed"]["last_good_checkpoint"] == str(d / "step00000002")
    assert sorted(os.listdir(d)) == ["latest", "step00000002"]  # the failed save removed itself
    monkeypatch.undo()
    assert main([*flags, "--out", str(tmp_path / "run2"), "--resume", "--json"]) == 0
    resumed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert resumed["run"]["start_step"] == 2 and resumed["losses"][:2] == report["losses"][2:4]


def test_export_loads_with_from_pretrained_and_gives_the_engines_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    batches = llama_batches(3)
    with offload.initialize(llama(tied=True), config(tmp_path, "nvme", precision="fp32")) as eng:
        for ids, labels in batches[:2]:
            eng.backward(eng(ids, labels=labels).loss)
            eng.step()
        path = eng.save_checkpoint(str(tmp_path / "ckpts"))
        eng.eval()
        with torch.no_grad():
            logits = eng(batches[2][0]).logits
    assert main(["checkpoint", "export", path, str(tmp_path / "hf")]) == 0
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(batches[2][0]).logits, logits)


def test_offload_train_saves_on_sigterm_and_stops(tmp_path, monkeypatch):
    from offload import train as training

    calls = []

    def preempted(output):  # SIGTERM arrives during the first step's forward
        if not calls:
            os.kill(os.getpid(), signal.SIGTERM)
        calls.append(1)
        return real_loss_of(output)

    real_loss_of = training.loss_of
    monkeypatch.setattr(training, "loss_of", preempted)
    d = str(tmp_path / "ckpts")
    settings = {"model": "tiny", "steps": 3, "batch_size": 2, "seq_len": 32, "nvme_path": str(tmp_path / "swap"),
                "no_progress": True, "save_every": 100, "checkpoint_dir": d, "offload_param": "cpu"}
    from offload.signals import Stopped

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped) as stop:  # after the save, the run stops as for any signal (exit 143)
        training.train({**settings, "out": str(tmp_path / "run1")})
    report = stop.value.report
    assert stop.value.exit_code == 143 and report["stopped"]["signal"] == "SIGTERM"
    assert len(report["losses"]) == 1 and fmt.list_checkpoints(d) == ["step00000001"]
    assert signal.getsignal(signal.SIGTERM) is before  # restored
    resumed = training.train({**settings, "out": str(tmp_path / "run2"), "resume": "latest"})
    assert resumed["run"]["start_step"] == 1 and len(resumed["losses"]) == 2
