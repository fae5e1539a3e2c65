"""bench/checkpoint.py runs (the tiny preset, one round) and prints the JSON the API names: step times with no
checkpoint, a background one, a blocking one, and beside fio moving a checkpoint's bytes (where fio is)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "checkpoint.py"


def _run(tmp_path, *flags) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, str(BENCH), "--model", "tiny", "--batch", "2", "--seq", "32", "--rounds", "1",
                          "--dir", str(tmp_path), "--json", *flags], capture_output=True, text=True, timeout=600,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stdout


def test_checkpoint_bench_json(tmp_path):
    r, stdout = _run(tmp_path)
    step = r["step_s"]
    assert all(step[m] > 0 for m in ("none", "background", "blocking")) and r["save_s_blocking"] > 0
    assert r["background_over_none"] == step["background"] / step["none"] and r["steps_per_background"] >= 1
    assert r["step_nvme_bytes"]["read"] > 0 and r["step_nvme_bytes"]["written"] > 0 and r["save_gbps_blocking"] > 0
    assert r["checkpoint_bytes"] > r["params"] * 4 * 2  # the fp32 master and its moments
    assert (step["beside_io"] is None) == (shutil.which("fio") is None)
    assert all(m["write"] > 0 and m["read"] > 0 for m in r["beside_io_bytes"]) and len(r["beside_io_bytes"]) == (step["beside_io"] is not None)
    assert "blocking   step" in stdout and list(tmp_path.iterdir()) == []  # its temporary directory removed
    # the states on nvme held at the swap: every unit's, none gated; the swap file grew by at most those bytes
    assert [h["gated_units"] for h in r["held"]] == [0] and r["held"][0]["held_bytes"] > r["params"] * 4 * 2
    assert 0 <= r["swap_growth_bytes"][0] <= r["held"][0]["held_bytes"] and "held at the swap" in stdout
    assert r["saver_cpu_s"] > 0 and step["gated"] is None  # the gated rows only with --gated
    int8, stdout = _run(tmp_path, "--optimizer-states", "int8", "--gated")
    assert int8["optimizer_states"] == "int8" and "int8 optimizer states" in stdout
    held, gated = int8["held"]  # the gated save holds nothing and gates every unit with states
    assert (held["mode"], gated["mode"]) == ("background", "gated") and held["held_bytes"] > 0 == held["gated_units"]
    assert gated["held_bytes"] == 0 < gated["gated_units"] and int8["step_s"]["gated"] > 0
    assert "gated      step" in stdout
    assert int8["checkpoint_bytes"] < r["checkpoint_bytes"]  # one byte a moment where a tensor is large enough
