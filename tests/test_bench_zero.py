"""bench/zero.py runs each mode as a torchrun at --precision (default auto: what the engine picks on this host)
and records the compute floor beside each mode's I/O bound."""

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_zero_records_precision_matmul_and_compute_floor_beside_the_io_bound(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "zero.py"), "--preset", "tiny", "--batch", "1",
                           "--seq", "32", "--steps", "1", "--warmup", "0", "--ranks", "2", "--modes", "stage2_nvme",
                           "--dir", str(tmp_path), "--io-size", "16M", "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["precision"] == ("bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32")
    mode = report["modes"]["stage2_nvme"]
    assert report["matmul_gflops"] > 0 and mode["io_bound_s"] > 0
    assert mode["compute_floor_s"] == report["compute_floor_s"] > 0
    assert not report["errors"] and not any(tmp_path.iterdir())
