"""bench/e2e.py runs our modes (in rounds) and reports the host's matmul speed, the compute floor and the nvme
step's I/O bound (the swap bandwidth measured in the same run) beside the step times, at --precision (default
auto: what the engine picks on this host)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_e2e_reports_step_times_and_the_hosts_matmul_speed(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "e2e.py"), "--preset", "tiny", "--batch", "2",
                           "--seq", "32", "--steps", "1", "--warmup", "1", "--dir", str(tmp_path),
                           "--modes", "cpu_offload,nvme_offload", "--rounds", "2", "--io-size", "64M",
                           "--precision", "bf16", "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["cpu_offload_step_s"] > 0 and report["nvme_offload_step_s"] > 0
    assert report["in_memory_step_s"] is None and report["ratio_to_in_memory"]["nvme_offload"] is None
    before, after = report["matmul_gflops_before_after"]
    assert before > 0 and after > 0 and report["matmul_gflops"] == (before + after) / 2
    assert report["precision"] == "bf16"
    assert report["compute_floor_s"] == 6 * report["params"] * report["tokens_per_step"] / (report["matmul_gflops"] * 1e9)
    assert "bf16 matmul" in proc.stdout and "compute floor" in proc.stdout
    assert "GFLOP/s" in proc.stdout
    assert len(report["rounds"]) == 2 and all(set(r) == {"cpu_offload", "nvme_offload"} for r in report["rounds"])
    assert report["nvme_offload_step_s"] in [r["nvme_offload"] for r in report["rounds"]]  # a median round
    assert "round 2:" in proc.stdout
    losses = report["first_losses"]
    assert losses["cpu_offload"] == losses["nvme_offload"]  # the same math in both placements
    # The I/O bound: the step's own nvme bytes over the bandwidth measured in the run.
    assert report["swap_read_gbps"] > 0 and report["swap_write_gbps"] > 0
    read, written = report["nvme_step_bytes"]["nvme_to_dram"], report["nvme_step_bytes"]["dram_to_nvme"]
    assert read >= 14 * report["params"] and written >= 14 * report["params"]  # bf16 weight + fp32 master, m, v
    bound = read / (report["swap_read_gbps"] * 1e9) + written / (report["swap_write_gbps"] * 1e9)
    assert report["io_bound_s"] == bound
    assert report["nvme_vs_bound"] == report["nvme_offload_step_s"] / bound  # no in-memory mode in this run
    assert "io bound" in proc.stdout and "nvme step / max(in-memory step, io bound)" in proc.stdout
    assert not any(tmp_path.iterdir()), "the swap bench or a mode left files in --dir"


def test_e2e_without_precision_runs_at_what_auto_picks_here(tmp_path):
    import torch

    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "e2e.py"), "--preset", "tiny", "--batch", "2",
                           "--seq", "32", "--steps", "1", "--warmup", "1", "--dir", str(tmp_path),
                           "--modes", "in_memory,nvme_offload", "--io-size", "16M", "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["precision"] == ("bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32")
    assert report["matmul_gflops"] > 0 and report["compute_floor_s"] > 0 and report["io_bound_s"] > 0
    # fp32 weights on nvme: 4 B read and written per parameter at least, beside the fp32 master, m and v
    read = report["nvme_step_bytes"]["nvme_to_dram"]
    assert read >= (12 if report["precision"] == "fp32" else 14) * report["params"]
