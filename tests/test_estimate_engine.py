"""The estimate agrees with what the Engine measures on a real run.

Margin (looser than docs/commands.md's, which tests/test_memory_model.py checks): the plan is an upper
bound per tier, and what a short run measures
(accountant peaks for hbm and dram, swap-file bytes for nvme) is at least 50% of it. nvme and the
resident dram states are exact ledgers; the slack is in hbm's working set and dram's staging, which
the plan sizes for the worst moment (every prefetch in flight, two units' gradients, both pipeline
slots full).
"""

import pytest
import torch

import offload
from offload.estimate import estimate, shape_of_model
from offload.models import build_model
from offload.plan.placement import engine_plan


@pytest.mark.parametrize("param,optim", [("cpu", "cpu"), ("nvme", "nvme"), ("none", "cpu")])
def test_plan_bounds_the_measured_peaks(tmp_path, param, optim):
    cfg = {"precision": "bf16", "offload_param": {"device": param}, "offload_optimizer": {"device": optim},
           "nvme_path": str(tmp_path), "units": {"min_numel": 4096}}
    plan = engine_plan(build_model("tiny", device="meta"), cfg)
    model = build_model("tiny", seed=0)
    ids = torch.randint(0, 257, (2, 32))
    with offload.initialize(model, cfg) as eng:
        for _ in range(2):
            eng.backward(eng(ids, ids))
            eng.step()
        st = eng.stats()["tiers"]
    measured = {"hbm_bytes": st["hbm"]["peak_bytes"], "dram_bytes": st["dram"]["peak_bytes"],
                "nvme_bytes": st["nvme"]["peak_bytes"]}
    for tier, m in measured.items():
        assert m <= plan[tier], (tier, m, plan[tier])
        assert m >= 0.5 * plan[tier], (tier, m, plan[tier])


def test_ledger_and_engine_plan_agree_on_model_states(tmp_path):
    """The ZeRO ledger (16 B/param, flat) and the engine's plan (padded units) describe the same states."""
    meta = build_model("small", device="meta")
    cfg = {"precision": "bf16", "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"},
           "nvme_path": str(tmp_path), "split_step": 0.5}
    ledger = estimate(shape_of_model(meta), offload_param="nvme", offload_optimizer="nvme")["model_states"]
    plan = engine_plan(meta, cfg)
    # nvme: 2 B weights + 12 B fp32 states (master, exp_avg, exp_avg_sq) per parameter; the 4 B gradient
    # accumulator of the ledger exists on nvme only when the step does not follow each backward at once
    params = sum(p.numel() for p in meta.parameters())
    whole = engine_plan(meta, {**cfg, "split_step": 0})
    assert whole["nvme_bytes"] == pytest.approx(ledger["nvme_bytes"] - 4 * params, rel=0.02)
    # [Note: split step] with split_step 0.5 every other fetched unit's gradient waits on nvme for its step,
    # in bf16: about half the model's at 2 B (the ledger's 4 B bounds it)
    assert 0.3 * 2 * params < plan["nvme_bytes"] - whole["nvme_bytes"] < 0.7 * 2 * params
    clipped = engine_plan(meta, {**cfg, "gradient_clipping": 1.0})
    assert clipped["nvme_bytes"] == pytest.approx(ledger["nvme_bytes"], rel=0.02)
