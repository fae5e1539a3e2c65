"""bench/gpu_check.py only runs for real on a lent GPU: its --device cpu smoke run keeps the script from
rotting between loans (every mode trains, the table and the JSON come out)."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_smoke_run_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "gpu_check.py"), "--device", "cpu",
                           "--preset", "tiny", "--batch", "1", "--seq", "32", "--steps", "1", "--no-tests",
                           "--dir", str(tmp_path), "--json"], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["modes"]) == {"bf16 hbm/cpu", "bf16 cpu/cpu", "bf16 nvme/nvme", "bf16 nvme/nvme no overlap",
                                    "bf16 nvme/nvme delayed+clip", "bf16 cpu/cpu ckpt", "fp16 cpu/cpu"}
    first = {m: r["losses"][0] for m, r in result["modes"].items() if m.startswith("bf16")}
    assert len(set(first.values())) == 1, first  # the same model and batch: the same first loss in every bf16 mode
    assert "x in-mem" in proc.stdout
