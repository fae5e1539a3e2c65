"""bench/scale.py trains a meta-device model with weights and states on nvme and reports the API's JSON
(tiny preset, 2 steps, DeepSpeed left out: tests/test_bench_ds.py covers it where installed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_scale_reports_steps_memory_links_and_the_io_bound(tmp_path, tmp_path_factory):
    trace = tmp_path_factory.mktemp("trace") / "last_step.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "scale.py"), "--model", "tiny", "--steps", "2",
                           "--batch", "2", "--seq", "32", "--dir", str(tmp_path), "--io-size", "64M",
                           "--no-deepspeed", "--precision", "bf16", "--trace", str(trace), "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["params"] == 820480 and r["init_s"] > 0 and r["error"] is None and r["deepspeed"] is None
    assert len(r["step_s"]) == len(r["losses"]) == r["steps_completed"] == 2 and min(r["step_s"]) > 0
    assert r["losses"][1] < r["losses"][0]
    assert r["peak_rss_bytes"] > 100e6 and r["ru_maxrss_bytes"] > 100e6  # sampled, and the worker's own
    links = r["links"]
    assert set(links) >= {"nvme_to_dram", "dram_to_nvme"} and all(len(v) == 2 for v in links.values())
    read, written = links["nvme_to_dram"][-1], links["dram_to_nvme"][-1]
    assert read >= 14 * r["params"] and written >= 14 * r["params"]  # bf16 weight + fp32 master, m, v
    bound = read / (r["swap_read_gbps"] * 1e9) + written / (r["swap_write_gbps"] * 1e9)
    assert r["io_bound_per_step_s"][-1] == bound and r["io_bound_s"] == bound  # 2 steps: the second one
    assert r["step_vs_io_bound"] == r["step_s"][1] / bound
    assert "io bound" in proc.stdout and "ours step / io bound" in proc.stdout
    # the compute floor measured beside it: in-memory forward+backward plus CPU Adam's share
    assert r["fwd_bwd_s"] > 0 and r["adam_s"] > 0 and r["compute_bound_s"] == r["fwd_bwd_s"] + r["adam_s"]
    assert r["step_vs_bound"] == r["step_s"][1] / max(bound, r["compute_bound_s"])
    assert "compute floor" in proc.stdout
    # the last step's swap requests sent again with nothing else running: the bytes the step moved
    replayed = r["io_replay"]
    assert replayed["read_bytes"] == read and replayed["written_bytes"] == written and replayed["requests"] > 0
    assert r["io_replay_s"] == replayed["replay_s"] > 0 and r["last_step_vs_io_replay"] == r["step_s"][1] / r["io_replay_s"]
    assert "ours last step / io replay" in proc.stdout
    # and the matmul floor at the precision it ran (bench/limits.py)
    assert r["precision"] == "bf16" and r["matmul_gflops"] > 0
    assert r["compute_floor_s"] == 6 * r["params"] * 2 * 32 / (r["matmul_gflops"] * 1e9)
    assert "bf16: matmul" in proc.stdout
    assert not any(tmp_path.iterdir()), "scale.py left its swap directory behind"
    # each step's profile from its timeline, and the last step's timeline saved
    for p, step_s in zip(r["profile"], r["step_s"]):
        assert abs(p["forward_s"] + p["backward_s"] + p["after_backward_s"] - step_s) < 1e-3
        assert min(p["forward_s"], p["backward_s"]) > 0 and p["cpu_adam_s"] > 0
        assert 0 <= p["drive_idle_s"] < step_s and p["compute_stall_s"] >= 0
        assert 0 < p["cpu_s"] <= step_s * os.cpu_count() * 1.05
    assert "ours step 2 profile: forward" in proc.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e.get("cat") for e in events} >= {"compute", "nvme", "cpu_adam"}


def test_profile_counts_overlapping_transfers_once():
    sys.path.insert(0, str(ROOT / "bench"))
    from scale import profile

    spans = [("compute", "forward a", 0.0, 1.0), ("compute", "backward", 1.0, 3.0),
             ("compute", "stall: fetch b", 1.2, 1.5), ("nvme", "r", -1.0, 0.5), ("nvme", "r", 0.2, 0.8),
             ("nvme", "w", 2.0, 2.5), ("cpu_adam", "adam", 2.6, 2.9), ("cpu_adam", "adam", 2.7, 3.5)]
    p = profile(spans, 0.0, 3.2)
    assert p == pytest.approx({"forward_s": 1.0, "backward_s": 2.0, "after_backward_s": 0.2, "compute_stall_s": 0.3,
                               "cpu_adam_s": 0.6, "drive_idle_s": 3.2 - 0.8 - 0.5})


def test_scale_rejects_a_missing_dir(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "scale.py"), "--dir", str(tmp_path / "nope")],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "not a directory" in proc.stderr


def test_replay_sends_the_recorded_requests_again(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import torch
    from iobound import SwapRecorder, replay

    from offload.swap.store import SwapStore

    with SwapStore(tmp_path, checksum=True) as store:
        a, b = torch.arange(3 << 18, dtype=torch.int32), torch.ones(5000, dtype=torch.float32)
        with SwapRecorder(store) as rec:
            store.write("a", a).wait()
            store.write("b", b).wait()
            store.read("a", torch.empty_like(a)).wait()
        assert "read" not in vars(store) and "write" not in vars(store)  # the store's own methods again
        assert rec.ops == [("w", "a", a.numel() * 4), ("w", "b", 20000), ("r", "a", a.numel() * 4)]
        r = replay(store, rec.ops, window=2)
        assert (r["requests"], r["read_bytes"], r["written_bytes"]) == (3, a.numel() * 4, a.numel() * 4 + 20000)
        back = torch.empty_like(a)
        store.read("a", back, verify=False).wait()
        assert not torch.equal(back, a)  # the replay wrote its ring's bytes over it
