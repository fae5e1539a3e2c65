"""bench/gpu_check.py only runs for real on a lent GPU: its --device cpu smoke run keeps the script from
rotting between loans (every mode trains, the table and the JSON come out)."""

import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_smoke_run_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "gpu_check.py"), "--device", "cpu",
                           "--preset", "tiny", "--batch", "1", "--seq", "32", "--steps", "1", "--no-tests",
                           "--parity-steps", "2",
                           "--dir", str(tmp_path / "swap"), "--out", str(tmp_path / "out.json"), "--json"],
                          capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["modes"]) == {"bf16 hbm/cpu", "bf16 cpu/cpu", "bf16 nvme/nvme", "bf16 nvme/nvme no overlap",
                                    "bf16 nvme/nvme delayed+clip", "bf16 cpu/cpu ckpt", "fp16 cpu/cpu"}
    first = {m: r["losses"][0] for m, r in result["modes"].items() if m.startswith("bf16")}
    assert len(set(first.values())) == 1, first  # the same model and batch: the same first loss in every bf16 mode
    assert "x in-mem" in proc.stdout
    assert set(result["parity"]) == {"hbm/hbm", "hbm/cpu", "cpu/cpu", "nvme/nvme"}
    for name, r in result["parity"].items():  # on the CPU both builds are the CPU's: the same numbers
        assert len(r["losses"]) == 2 and r["losses"] == r["cpu_losses"] and r["ok"], (name, r)
    assert "fp32 parity against the CPU build" in proc.stdout
    picked = "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"
    assert result["precision_auto"] == picked and set(result["matmul_gflops"]) == {"bf16", "fp16", "fp32"}
    with open(tmp_path / "out.json") as f:
        assert json.load(f) == result  # the JSON file holds what --json printed


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU this would run the whole check")
def test_gpu_check_refuses_in_one_line_without_a_gpu(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "gpu_check.py")], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("gpu_check: no CUDA device visible") and "--device cpu" in line
    assert not list(tmp_path.iterdir())  # nothing written
