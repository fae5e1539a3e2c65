"""bench/e2e.py runs our modes (in rounds) and reports the host's matmul speed beside the step times."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_e2e_reports_step_times_and_the_hosts_matmul_speed(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "e2e.py"), "--preset", "tiny", "--batch", "2",
                           "--seq", "32", "--steps", "1", "--warmup", "1", "--dir", str(tmp_path),
                           "--modes", "cpu_offload,nvme_offload", "--rounds", "2", "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["cpu_offload_step_s"] > 0 and report["nvme_offload_step_s"] > 0
    assert report["in_memory_step_s"] is None and report["ratio_to_in_memory"]["nvme_offload"] is None
    before, after = report["bf16_matmul_gflops"]
    assert before > 0 and after > 0
    assert "GFLOP/s" in proc.stdout
    assert len(report["rounds"]) == 2 and all(set(r) == {"cpu_offload", "nvme_offload"} for r in report["rounds"])
    assert report["nvme_offload_step_s"] in [r["nvme_offload"] for r in report["rounds"]]  # a median round
    assert "round 2:" in proc.stdout
    losses = report["first_losses"]
    assert losses["cpu_offload"] == losses["nvme_offload"]  # the same math in both placements
