"""bench/int8_states.py runs (the tiny preset, 2 steps) and reports int8 against fp32 states side by side, and
with --plain torch's AdamW (and bitsandbytes' AdamW8bit where it imports) on the same batches in memory."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "int8_states.py"


def test_int8_states_bench_json(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH), "--model", "tiny", "--steps", "2", "--every", "1", "--batch",
                          "2", "--seq", "32", "--plain", "--dir", str(tmp_path), "--plot", str(tmp_path / "c.png"),
                          "--json"], capture_output=True, text=True, timeout=600, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["stretches"] == [[0, 1], [1, 2]] and set(r["curve"]) >= {"fp32", "int8", "torch AdamW"}
    first = {m: c[0] for m, c in r["curve"].items()}
    assert len({round(v, 5) for v in first.values()}) == 1, first  # the same model and batch before any update
    assert r["final_ratio"] == r["curve"]["int8"][-1] / r["curve"]["fp32"][-1] and r["step_ratio"] > 0
    assert set(r["eval_loss"]) == set(r["curve"]) and (tmp_path / "c.png").stat().st_size > 0
    assert "int8/fp32" in out.stdout and "held-out loss after 2 steps" in out.stdout


def test_the_plain_runs_alone(tmp_path):
    """--modes torch bnb8 torch-fused: the plain runs without our engines (half the time of a fidelity check),
    their ratios to torch's AdamW; torch's fused AdamW starts from the same loss and steps the same math."""
    pytest.importorskip("bitsandbytes")
    out = subprocess.run([sys.executable, str(BENCH), "--model", "tiny", "--steps", "2", "--every", "1", "--batch",
                          "2", "--seq", "32", "--modes", "torch", "bnb8", "torch-fused", "--json"],
                         capture_output=True, text=True, timeout=600, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    c = r["curve"]
    assert set(c) == {"torch AdamW", "bnb AdamW8bit", "torch AdamW fused"} and r["final_ratio"] is None
    assert r["final_ratios"] == {"bnb8/torch": c["bnb AdamW8bit"][-1] / c["torch AdamW"][-1],
                                 "fused/torch": c["torch AdamW fused"][-1] / c["torch AdamW"][-1]}
    assert c["torch AdamW fused"][0] == c["torch AdamW"][0] and abs(r["final_ratios"]["fused/torch"] - 1) < 1e-3
    assert "bnb8/torch" in out.stdout and "fused/torch" in out.stdout and "int8/fp32" not in out.stdout
