"""bench/zero.py runs each mode as a torchrun at --precision (default auto: what the engine picks on this host)
and records the compute floor beside each mode's I/O bound; each DeepSpeed row is compared with ours at the
same stage and placement."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DS_PYTHON = os.environ.get("OFFLOAD_DS_PYTHON") or "/work/dsvenv/bin/python"
TINY = ["--preset", "tiny", "--batch", "1", "--seq", "32", "--steps", "1", "--warmup", "0", "--ranks", "2"]


def _zero(tmp_path, *args):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "zero.py"), *TINY, "--dir", str(tmp_path), *args,
                           "--json"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_zero_records_precision_matmul_and_compute_floor_beside_the_io_bound(tmp_path):
    report = _zero(tmp_path, "--modes", "stage2_nvme", "--io-size", "16M")
    assert report["precision"] == ("bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32")
    mode = report["modes"]["stage2_nvme"]
    assert report["matmul_gflops"] > 0 and mode["io_bound_s"] > 0
    assert mode["compute_floor_s"] == report["compute_floor_s"] > 0
    # Stage 2 gathers nothing; no DeepSpeed row has its placement (DeepSpeed's ZeRO-2 keeps states in cpu).
    assert mode["gather_s"] is None and mode["vs"] is None and mode["vs_deepspeed"] is None
    assert not report["errors"] and not any(tmp_path.iterdir())


def test_zero_rejects_an_unknown_mode():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "zero.py"), "--modes", "stage2_nvme,stage5"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "unknown stage5" in proc.stderr


@pytest.mark.skipif(not os.path.exists(DS_PYTHON), reason=f"no DeepSpeed python at {DS_PYTHON} (bench/ds_venv.sh)")
def test_deepspeed_zero2_row_is_compared_with_ours_at_its_stage_and_placement(tmp_path):
    # About a minute: DeepSpeed's import and its CPU Adam (JIT-built on a first run: minutes more).
    report = _zero(tmp_path, "--modes", "stage2_dram,deepspeed_zero2_cpu,stage2_nvme", "--io-size", "0",
                   "--ds-python", DS_PYTHON)
    assert not report["errors"], report["errors"]
    modes = report["modes"]
    assert list(modes) == ["stage2_dram", "deepspeed_zero2_cpu", "stage2_nvme"]
    ours, theirs = modes["stage2_dram"], modes["deepspeed_zero2_cpu"]
    # DeepSpeed's ZeRO-2 can offload the optimizer to cpu only: the row says so, and is ours' none/cpu pair.
    assert theirs["engine"] == "deepspeed" and theirs["deepspeed_config"]["stage"] == 2 == theirs["zero_stage"]
    config = theirs["deepspeed_config"]
    assert (config["offload_param"], config["offload_optimizer"]) == ("none", "cpu")
    assert (ours["zero_stage"], ours["offload_param"], ours["offload_optimizer"]) == (2, "none", "cpu")
    assert ours["vs"] == "deepspeed_zero2_cpu" and ours["vs_deepspeed"] == ours["step_s"] / theirs["step_s"]
    assert modes["stage2_nvme"]["vs"] is None and theirs["vs"] is None
    for mode in modes.values():
        assert mode["step_s"] > 0 and mode["losses"] and all(math.isfinite(x) for x in mode["losses"])
    # The same weights and first batch: the same first loss within bf16 rounding.
    assert theirs["losses"][0] == pytest.approx(ours["losses"][0], rel=2e-2)
    assert not any(tmp_path.iterdir())
