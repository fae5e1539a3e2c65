"""bench/generate.py runs (the tiny preset, one small batch) and prints the JSON the API names; every mode's
greedy tokens equal transformers' in memory; ours on nvme at under half the weights' bytes reads about the
weights once a token."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "generate.py"


def test_generate_bench_json(tmp_path):
    pytest.importorskip("accelerate")
    out = subprocess.run([sys.executable, str(BENCH), "--model", "tiny", "--batch", "2", "--prompt-tokens", "8",
                          "--new-tokens", "4", "--io-size", "64M", "--budget", "1500000", "--precision", "fp32",
                          "--dir", str(tmp_path), "--json", "--ds-python", ""],
                         capture_output=True, text=True, timeout=600, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    (row,) = r["rows"]
    assert {k: r[k] for k in row} == row  # the contract's keys at the top too (the last batch's)
    for key in ("batch", "prompt_tokens", "new_tokens", "in_memory_tok_s", "dram_tok_s", "nvme_tok_s",
                "accelerate_tok_s", "deepspeed_tok_s", "link_bound_tok_s"):
        assert key in row
    assert (row["batch"], row["prompt_tokens"], row["new_tokens"]) == (2, 8, 4) and row["deepspeed_tok_s"] is None
    assert row["same_tokens"] == {"dram": True, "nvme": True, "nvme_resident": True, "accelerate": True}
    assert row["nvme_tok_s"] > 0 and row["link_bound_tok_s"] > 0 and r["swap_read_gbps"] > 0
    # under half the weights' bytes for weights: most units stream, each read about once a token
    assert r["budget_bytes"] == 1500000 < r["weight_bytes"] // 2  # fp32 weights, on any host
    assert r["weight_bytes"] == 4 * r["params"]  # the weights at the precision that runs
    assert 0.5 * r["weight_bytes"] < row["nvme_read_per_token_gb"] * 1e9 < 1.5 * r["weight_bytes"]
    beside = row["in_memory_beside_reads_tok_s"]  # in memory again while fio reads at our nvme mode's rate
    assert beside is None if shutil.which("fio") is None else beside > 0


@pytest.mark.slow
def test_generate_bench_beside_deepspeed_zero_inference(tmp_path):
    """Where a DeepSpeed venv is (bench/ds_venv.sh): its ZeRO-Inference column gives the in-memory tokens in fp32."""
    sys.path.insert(0, str(BENCH.parent))
    from e2e import default_ds_python

    if default_ds_python() is None:
        pytest.skip("no DeepSpeed venv (bash bench/ds_venv.sh)")
    out = subprocess.run([sys.executable, str(BENCH), "--model", "bench-200m", "--batch", "2", "--prompt-tokens", "8",
                          "--new-tokens", "3", "--io-size", "64M", "--dir", str(tmp_path), "--json"],
                         capture_output=True, text=True, timeout=900, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["deepspeed_error"] is None and r["deepspeed_version"] and r["deepspeed_tok_s"] > 0
    assert r["same_tokens"]["deepspeed"]
