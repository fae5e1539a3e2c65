"""bench/checkpoint.py runs (the tiny preset, one round) and prints the JSON the API names: step times with no
checkpoint, a background one, a blocking one, and beside fio moving a checkpoint's bytes (where fio is)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "checkpoint.py"


def test_checkpoint_bench_json(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH), "--model", "tiny", "--batch", "2", "--seq", "32", "--rounds", "1",
                          "--dir", str(tmp_path), "--json"], capture_output=True, text=True, timeout=600, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    step = r["step_s"]
    assert all(step[m] > 0 for m in ("none", "background", "blocking")) and r["save_s_blocking"] > 0
    assert r["background_over_none"] == step["background"] / step["none"] and r["steps_per_background"] >= 1
    assert r["checkpoint_bytes"] > r["params"] * 4  # the fp32 weights and their states at least
    assert (step["beside_io"] is None) == (shutil.which("fio") is None)
    assert "blocking   step" in out.stdout and list(tmp_path.iterdir()) == []  # its temporary directory removed
