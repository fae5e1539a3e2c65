"""bench/gpu_check.py only runs for real on a lent GPU: its --device cpu smoke run keeps the script from
rotting between loans (every mode trains, the 2-rank cases run on gloo CPU ranks, the tables and the JSON
come out)."""

import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

import zero_ranks_check  # noqa: E402  (bench/zero_ranks_check.py)


def test_gpu_check_smoke_run_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "gpu_check.py"), "--device", "cpu",
                           "--preset", "tiny", "--batch", "1", "--seq", "32", "--steps", "1", "--no-tests",
                           "--parity-steps", "2", "--ranks-steps", "2", "--long-preset", "tiny", "--long-seq", "128",
                           "--long-steps", "1", "--decode-batch", "2", "--decode-tokens", "4",
                           "--dir", str(tmp_path / "swap"), "--out", str(tmp_path / "out.json"), "--json"],
                          capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["modes"]) == {"bf16 hbm/cpu", "bf16 cpu/cpu", "bf16 nvme/nvme", "bf16 nvme/nvme no overlap",
                                    "bf16 nvme/nvme delayed+clip", "bf16 cpu/cpu ckpt", "fp16 cpu/cpu",
                                    "bf16 nvme/nvme int8 states", "bf16 cpu/nvme int8 split master"}
    first = {m: r["losses"][0] for m, r in result["modes"].items() if m.startswith("bf16")}
    assert len(set(first.values())) == 1, first  # the same model and batch: the same first loss in every bf16 mode
    assert "x in-mem" in proc.stdout
    assert set(result["parity"]) == {"hbm/hbm", "hbm/cpu", "cpu/cpu", "nvme/nvme"}
    for name, r in result["parity"].items():  # on the CPU both builds are the CPU's: the same numbers
        assert len(r["losses"]) == 2 and r["losses"] == r["cpu_losses"] and r["ok"], (name, r)
    assert "fp32 parity against the CPU build" in proc.stdout
    assert set(result["qlora"]) == {"none", "cpu", "nvme"}  # the nf4 QLoRA case, its base in every tier
    for place, r in result["qlora"].items():
        assert r["ok"] and r["max_rel_diff"] <= 1e-6 and len(r["losses"]) == 2, (place, r)
    assert "nf4 QLoRA, fp32, the engine against the plain loop on the device: base none" in proc.stdout
    long = result["long"]  # the long-sequence case: the four ways train to the same losses on the CPU
    assert list(long) == ["no ckpt", "ckpt, inputs hbm", "ckpt, inputs dram", "ckpt, inputs nvme"], long
    assert all(r["ok"] and r["max_rel_diff"] == 0.0 and len(r["losses"]) == 2 for r in long.values()), long
    assert long["no ckpt"]["inputs_hbm_peak_gb"] == 0 < long["ckpt, inputs hbm"]["inputs_hbm_peak_gb"]
    assert long["ckpt, inputs nvme"]["inputs_hbm_peak_gb"] < long["ckpt, inputs hbm"]["inputs_hbm_peak_gb"]
    assert long["ckpt, inputs hbm"]["vs_ckpt_hbm"] == 1.0 and long["no ckpt"]["allocated_peak_gb"] is None
    assert "long sequence: tiny at 128 tokens" in proc.stdout
    picked = "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"
    assert result["precision_auto"] == picked and set(result["matmul_gflops"]) == {"bf16", "fp16", "fp32"}
    assert set(result["ranks"]) == set(zero_ranks_check.CASES)
    for case, r in result["ranks"].items():  # 2 gloo CPU ranks against one process in rank order
        assert r["ok"] and r["weights_close"] and r["max_rel_loss_diff"] <= 1e-5, (case, r)
        assert len(r["losses"]) == 2 * zero_ranks_check.GAS and len(r["step_s"]) == 2 and r["device"] == "cpu"
        grads = [sum(c.get(k, {}).get("bytes", 0) for k in ("reduce", "reduce_scatter")) for c in r["collectives"]]
        assert grads[0] == grads[1] > 0  # every rank reduces every gradient
        gathered = r["zero_stage"] == 3  # stage 3 gathers the weights; only then is there an exposed_s
        assert all((x is not None) == gathered for x in r["all_gather_exposed_s"]), (case, r)
    assert "2 gloo ranks on cpu against one process in rank order" in proc.stdout
    assert "stage3 none/nvme" in proc.stdout and "FAILED" not in proc.stdout
    decode = result["decode"]  # generate() at a quarter of the weights in hbm: the tokens of the model in memory
    assert decode["same_tokens"] and decode["ok"] and decode["bound_tok_s"] is None
    assert decode["moved_per_step_gb"] == 0  # on the CPU backend dram is read in place
    assert "decode, tiny batch 2, weights in dram" in proc.stdout
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


def test_ranks_compare_catches_a_wrong_weight_or_loss():
    """The comparison's bounds: 1e-6 of drift passes; a weight 1e-4 off, a loss 1e-4 off, or a NaN fails."""
    ref_sd = {"w": torch.ones(4, 4), "b": torch.zeros(4)}
    ref = {"losses": [1.0, 0.5], "step_s": [0.1, 0.1]}
    rank = {"losses": [1.0, 0.5], "step_s": [0.2, 0.2], "collectives": {}, "device": "cpu"}

    def check(sd, losses=(1.0, 0.5)):
        return zero_ranks_check.compare([rank, {**rank, "losses": list(losses)}], ref, sd, ref_sd)

    close = check({"w": torch.ones(4, 4) + 1e-6, "b": torch.zeros(4)})
    assert close["ok"] and close["max_weight_diff"] == pytest.approx(1e-6, rel=0.1)
    wrong = {"w": torch.ones(4, 4), "b": torch.zeros(4)}
    wrong["b"][2] = 1e-4
    assert not check(wrong)["ok"] and check(wrong)["worst_weight"] == "b"
    assert not check(ref_sd, losses=(1.0, 0.5 + 2e-4))["ok"]  # the ranks' mean 1e-4 off (rel 2e-4)
    assert not check(ref_sd, losses=(1.0, float("nan")))["ok"]
    assert not check({"w": torch.full((4, 4), float("nan")), "b": torch.zeros(4)})["ok"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where cuda:0 is not there")
def test_a_case_that_cannot_run_is_recorded_as_its_error(tmp_path):
    """As a refusal of the engine on CUDA would be: the ranks' error in the result, nothing raised."""
    r = zero_ranks_check.run_case("stage1 nvme/nvme", "cuda:0", 1, str(tmp_path))
    assert not r["ok"] and r["zero_stage"] == 1, r
    assert r["error"].split(":")[0].endswith("Error") and "losses" not in r, r  # this torch: no CUDA to set
