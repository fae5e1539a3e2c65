"""bench/cpu_adam.py runs and prints the JSON the API promises (small size, no DeepSpeed)."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "cpu_adam.py"


def test_cpu_adam_bench_json():
    out = subprocess.run([sys.executable, str(BENCH), "--numel", str(1 << 18), "--steps", "2", "--rounds", "2",
                          "--no-deepspeed", "--json"], capture_output=True, text=True, timeout=600, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("numel", "ours_gparams_s", "torch_fused_casts_gparams_s", "deepspeed_casts_gparams_s",
                "deepspeed_fp32_gparams_s", "roofline_gparams_s", "max_rel_err"):
        assert key in r
    assert r["deepspeed_casts_gparams_s"] is None and r["deepspeed_fp32_gparams_s"] is None
    assert r["ours_gparams_s"] > 0 and r["roofline_gparams_s"] > 0 and r["ours_vs_roofline"] > 0
    assert r["steps_timed"]["ours"] == 4 and r["max_rel_err"] < 1e-5
    assert "roofline (paired copy / 28 B)" in out.stdout
    assert r["ours_digests_gparams_s"] > 0 and r["separate_hashes_s"] > 0 and r["digests_in_step_vs_ours"] > 0
    assert "swap digests of p/m/v in the step" in out.stdout
    assert r["int8_gparams_s"] > 0 and r["int8_roofline_gparams_s"] > r["roofline_gparams_s"]  # fewer bytes
    assert r["int8_vs_fp32"] == r["int8_gparams_s"] / r["ours_gparams_s"] and "int8 states (16.06 B/param)" in out.stdout
    assert "bnb_adamw8bit_casts_gparams_s" in r
