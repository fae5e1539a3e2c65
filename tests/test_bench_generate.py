"""bench/generate.py runs (the tiny preset, one small batch) and prints the JSON the API names; every mode's
greedy tokens equal transformers' in memory, also ours and accelerate under a memory cap (bench/memcap.py); ours on nvme at under half the weights' bytes reads about the
weights once a token."""

import json
import os
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
                          "--dir", str(tmp_path), "--json", "--ds-python", "", "--memory-cap", "1G"],
                         capture_output=True, text=True, timeout=600, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    (row,) = r["rows"]
    assert {k: r[k] for k in row} == row  # the contract's keys at the top too (the last batch's)
    for key in ("batch", "prompt_tokens", "new_tokens", "in_memory_tok_s", "dram_tok_s", "nvme_tok_s",
                "accelerate_tok_s", "nvme_capped_tok_s", "accelerate_capped_tok_s", "memory_cap", "deepspeed_tok_s", "link_bound_tok_s"):
        assert key in row
    assert (row["batch"], row["prompt_tokens"], row["new_tokens"]) == (2, 8, 4) and row["deepspeed_tok_s"] is None
    assert {m: row["same_tokens"][m] for m in ("dram", "nvme", "nvme_resident", "accelerate")} == dict.fromkeys(
        ("dram", "nvme", "nvme_resident", "accelerate"), True)
    assert row["nvme_tok_s"] > 0 and row["link_bound_tok_s"] > 0 and r["swap_read_gbps"] > 0
    # under half the weights' bytes for weights: most units stream, each read about once a token
    assert r["budget_bytes"] == 1500000 < r["weight_bytes"] // 2  # fp32 weights, on any host
    assert r["weight_bytes"] == 4 * r["params"]  # the weights at the precision that runs
    assert 0.5 * r["weight_bytes"] < row["nvme_read_per_token_gb"] * 1e9 < 1.5 * r["weight_bytes"]
    # ours on nvme and accelerate again, each in a memory cgroup capped at --memory-cap
    cap = row["memory_cap"]
    assert cap["limit_bytes"] == 1 << 30
    if row["accelerate_capped_tok_s"] is None:
        assert "cgroup" in cap["error"]
    else:
        assert row["same_tokens"]["accelerate_capped"] and row["same_tokens"]["nvme_capped"]
        assert row["nvme_capped_tok_s"] > 0 and 0 < cap["accelerate_peak_bytes"] <= cap["limit_bytes"]
        assert 0 < cap["nvme_peak_bytes"] <= cap["limit_bytes"] and cap["nvme_hit_limit"] >= 0
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


def test_memcap_caps_what_a_command_is_charged(tmp_path):
    """Reading a 64 MiB file through the page cache is charged its size; capped at 24 MiB above what the bare
    interpreter is charged, the same reads finish within the cap, which they reach."""
    sys.path.insert(0, str(BENCH.parent))
    import memcap

    if memcap.cgroup_parent() is None:
        pytest.skip("no memory cgroup to make here (Linux cgroups, as root)")
    data = tmp_path / "data"
    data.write_bytes(b"x" * (64 << 20))
    os.sync()  # clean pages, which evict() drops
    reads = [sys.executable, "-c", f"import os\nfd = os.open({str(data)!r}, os.O_RDONLY)\n"
             "while os.read(fd, 1 << 20):\n    pass"]
    proc, bare = memcap.run([sys.executable, "-c", "pass"])
    assert proc.returncode == 0 and bare["limit_bytes"] is None
    memcap.evict(str(tmp_path))
    proc, free = memcap.run(reads)
    assert proc.returncode == 0 and free["peak_bytes"] >= bare["peak_bytes"] + (56 << 20)
    memcap.evict(str(tmp_path))
    limit = bare["peak_bytes"] + (24 << 20)
    proc, capped = memcap.run(reads, limit)
    assert proc.returncode == 0, proc.stderr
    assert capped["peak_bytes"] <= limit and capped["hit_limit"] > 0 and not capped["oom_killed"]
    assert not [p for p in os.listdir(memcap.cgroup_parent()[0]) if p.startswith("offload-bench-")]
