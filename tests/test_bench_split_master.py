"""bench/split_master.py runs (the tiny preset, 2 steps): each split-master run equals its fp32-master run bit
for bit, writes 1.875 bytes a trained parameter less a step, and the kernel comparison is reported."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "split_master.py"


def test_split_master_bench_json(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH), "--model", "tiny", "--steps", "2", "--batch", "2", "--seq", "32",
                          "--dir", str(tmp_path), "--numel", "65536", "--json"],
                         capture_output=True, text=True, timeout=600, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    runs = {(x["states"], x["master"]): x for x in r["runs"]}
    assert set(runs) == {(s, m) for s in ("fp32", "int8") for m in ("fp32", "split")}
    for s in ("fp32", "int8"):
        a, b = runs[s, "split"], runs[s, "fp32"]
        assert a["equal"] and a["losses"] == b["losses"] and b["step_ratio"] == 1.0
        assert abs((b["written_b"] - a["written_b"]) / a["params"] - 1.875) < 0.01  # every tiny parameter trains
    assert r["kernel"]["numel"] == 65536 and r["kernel"]["record_s"] > 0 and r["kernel"]["fused_s"] > 0
    assert "bit for bit: True" in out.stdout and list(tmp_path.iterdir()) == []
