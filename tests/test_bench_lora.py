"""bench/lora.py: LoRA with the frozen base on nvme and the adapters' states in hbm reports the step against
the compute and I/O bounds and the peak RSS against what is stated (tiny preset, 2 steps)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("peft")


@pytest.mark.slow  # about a minute: the bounds are timed over seconds each
def test_lora_bench_reports_bounds_rss_and_writes_the_adapters_alone(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "lora.py"), "--model", "tiny", "--lora", "4",
                           "--steps", "2", "--seq", "32", "--hbm", "64M", "--dir", str(tmp_path), "--io-size", "64M",
                           "--precision", "fp32", "--json"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["layers"] == 4 and 0 < r["trainable_params"] < r["params"] and r["error"] is None
    assert len(r["step_s"]) == len(r["forward_s"]) == len(r["rss_after_forward_bytes"]) == 2
    # fp32 adapters, each layer's written in 4 KiB blocks, no frozen chunk rewritten
    assert r["trainable_params"] * 4 <= r["nvme_write_bytes"][-1] <= r["trainable_params"] * 4 + 4 * 4096
    assert r["nvme_read_bytes"][-1] > 0
    assert r["compute_bound_s"] == pytest.approx(r["model_one_layer_s"] + 3 * r["layer_s"]) and r["compute_bound_s"] > 0
    # measured before ours, after each of its 2 steps' backward, and after it; each step against its two
    bounds = r["compute_bound_measured_s"]
    assert len(bounds) == 4 and bounds[0] == r["compute_bound_s_before"] and bounds[-1] == r["compute_bound_s_after"]
    assert r["compute_bound_s"] == pytest.approx(sum(bounds) / 4)
    assert r["compute_bound_per_step_s"] == [(bounds[0] + bounds[1]) / 2, (bounds[1] + bounds[2]) / 2]
    assert r["step_s_steady"] == r["step_s"][1]
    assert r["step_vs_bound"] == r["step_s"][1] / max(r["compute_bound_per_step_s"][1], r["io_bound_s"])
    assert len(r["stall_s"]) == 2 and all(s >= 0 for s in r["stall_s"])
    frozen = r["params"] - r["trainable_params"]
    assert r["compute_floor_s"] == (4 * frozen + 6 * r["trainable_params"]) * 32 / (r["matmul_gflops"] * 1e9)
    assert r["stated_host_bytes"] == r["baseline_rss_bytes"] + r["plan_hbm_bytes"] + r["plan_dram_bytes"]
    assert r["plan_hbm_bytes"] <= r["hbm_budget_bytes"] and r["activation_bytes_per_layer"] > 0
    assert r["peak_rss_bytes"] > r["baseline_rss_bytes"] > 100e6
    assert "each step over max(the compute bound measured beside it, io bound)" in proc.stdout
    assert "peak RSS" in proc.stdout
    assert not any(tmp_path.iterdir()), "lora.py left its swap directory behind"
