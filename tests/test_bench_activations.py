"""bench/activations.py runs each (sequence length, mode) in its own process and reports the step against the
compute bound (with the recompute where the engine checkpoints), the memory, and the nvme step against the hbm
one; the modes train to the same losses (the same math, wherever the kept inputs wait)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_activations_bench_reports_every_mode_beside_its_compute_bound(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "activations.py"), "--preset", "tiny", "--seqs", "128",
                           "--modes", "none,hbm,nvme", "--steps", "1", "--warmup", "1", "--dir", str(tmp_path),
                           "--precision", "fp32", "--json"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    runs = report["runs"]
    assert sorted(runs) == ["128/hbm", "128/none", "128/nvme"]
    assert runs["128/none"]["losses"] == runs["128/hbm"]["losses"] == runs["128/nvme"]["losses"]
    params = runs["128/none"]["params"]
    assert params > 500_000  # the tiny preset's count, read before the engine holds the parameters
    gflops = report["matmul_gflops"]
    attention = 2 * 128 * 128 * 128 * 4  # causal QK^T and PV of one forward: 2 x seq^2 x d_model x layers (tiny)
    assert runs["128/none"]["compute_bound_s"] == (6 * params * 128 + 3 * attention) / (gflops * 1e9)
    assert runs["128/nvme"]["compute_bound_s"] == (8 * params * 128 + 4 * attention) / (gflops * 1e9)  # recompute
    assert runs["128/nvme"]["vs_hbm"] == runs["128/nvme"]["step_s"] / runs["128/hbm"]["step_s"]
    assert runs["128/nvme"]["moved_out_bytes"] > 0 and runs["128/hbm"]["moved_out_bytes"] == 0
    assert runs["128/hbm"]["inputs_hbm_peak_bytes"] > 0 and runs["128/none"]["inputs_hbm_peak_bytes"] == 0
    assert "| 128 | nvme |" in proc.stdout
