"""The model after engine.close() (issue 49): close(keep_weights=True) puts the trained weights back into the
model's own parameters (the compute dtype) and the model then runs in plain PyTorch, bit for bit the engine's
last forward, in every placement and over ranks; refused, with nothing freed, when they do not fit the RAM
available. After a plain close() any use of the model raises a clear error instead of torch's shape errors."""


import pytest
import torch

import offload
from offload import handback
from offload.plan.placement import PlacementError
from offload.step.pipeline import EngineClosed
from tests.engine_util import DTYPES, MLP, mlp_batches, train
from tests.ranks_util import run_ranks

PLACES = {"hbm": "none", "dram": "cpu", "nvme": "nvme"}
CLOSED = (r"this model's weights were held by an offload engine that is now closed: use close\(keep_weights=True\), "
          r"full_state_dict\(\) or a saved directory")


def cfg(tmp_path, place: str, precision: str = "fp32", **extra) -> dict:
    return {"precision": precision, "offload_param": {"device": PLACES[place]},
            "offload_optimizer": {"device": PLACES[place]}, "nvme_path": str(tmp_path / "swap"),
            "units": {"min_numel": 512}, "optimizer": {"lr": 1e-2}, **extra}



@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("place", list(PLACES))
def test_keep_weights_hands_back_the_weights_of_the_engines_last_forward(tmp_path, place, precision):
    model = MLP()
    x, y = mlp_batches(1, seed=7)[0]
    with offload.initialize(model, cfg(tmp_path, place, precision)) as eng:
        train(eng, mlp_batches(3))
        with torch.no_grad():
            last = eng(x, y)
        eng.close(keep_weights=True)
        eng.close(keep_weights=True)  # twice is fine
    dtype = DTYPES[precision]  # the engine casts floating-point inputs to the compute dtype; in plain PyTorch, you do
    with torch.no_grad():
        assert torch.equal(model(x.to(dtype), y.to(dtype)), last)
    for name, p in model.named_parameters():
        assert p.dtype == DTYPES[precision] and p.shape == p.data.shape and p.numel() > 0, name
    assert set(model.state_dict()) == {n for n, _ in model.named_parameters()}  # no longer guarded
    model.zero_grad()
    model(x.to(dtype), y.to(dtype)).backward()  # plain autograd through the handed-back parameters
    assert all(p.grad is not None for p in model.parameters())
    with offload.initialize(model, cfg(tmp_path, place, precision)) as again:  # the model may be wrapped again
        with torch.no_grad():
            assert torch.equal(again(x, y), last)


@pytest.mark.parametrize("place", list(PLACES))
def test_after_a_plain_close_every_use_of_the_model_says_how_to_keep_its_weights(tmp_path, place):
    model = MLP()
    x, y = mlp_batches(1)[0]
    eng = offload.initialize(model, cfg(tmp_path, place))
    train(eng, mlp_batches(1))
    eng.close()
    eng.close()  # twice is fine
    uses = {"forward": lambda: model(x, y), "a submodule": lambda: model.blocks[1](torch.zeros(2, 64)),
            "state_dict": model.state_dict, "load_state_dict": lambda: model.load_state_dict({})}
    for what, use in uses.items():
        with pytest.raises(EngineClosed, match=CLOSED):
            use()
    with pytest.raises(EngineClosed, match=r"closed without keep_weights and its weights are gone"):
        eng.close(keep_weights=True)


def test_keep_weights_that_do_not_fit_the_ram_are_refused_with_nothing_freed(tmp_path, monkeypatch):
    model = MLP()
    x, y = mlp_batches(1, seed=7)[0]
    with offload.initialize(model, cfg(tmp_path, "nvme", "bf16")) as eng:
        train(eng, mlp_batches(2))
        before = eng.full_state_dict()
        real = handback.hostmem.available
        monkeypatch.setattr(handback.hostmem, "available", lambda: 4096)
        with pytest.raises(PlacementError, match=r"close\(keep_weights=True\): the weights need 0\.00 GiB of RAM and "
                                                 r"0\.00 GiB is available here; nothing was freed: .*state_items\(\).*"
                                                 r"offload train --save"):
            eng.close(keep_weights=True)
        monkeypatch.setattr(handback.hostmem, "available", real)
        after = eng.full_state_dict()
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        train(eng, mlp_batches(3)[2:])  # it trains on
        with torch.no_grad():
            last = eng(x, y)
        eng.close(keep_weights=True)
    with torch.no_grad():
        assert torch.equal(model(x.bfloat16(), y.bfloat16()), last)


def test_a_failed_engine_refuses_keep_weights_and_closes(tmp_path):
    model = MLP()
    eng = offload.initialize(model, cfg(tmp_path, "dram"))
    eng.pipeline.fail("injected: the states are partly updated")
    with pytest.raises(Exception, match=r"close\(keep_weights=True\) refused: injected"):
        eng.close(keep_weights=True)
    eng.close()
    with pytest.raises(EngineClosed, match=CLOSED):
        model(*mlp_batches(1)[0])


@pytest.mark.parametrize("place", [pytest.param("dram", marks=pytest.mark.slow), "nvme"])
def test_over_ranks_with_partitioned_weights_every_rank_gets_the_whole_model(tmp_path, place):
    """zero_stage 3 over 2 ranks: each rank's close(keep_weights=True) gathers the units it does not hold; every
    rank's plain model then gives its engine's last forward bit for bit, and the same loss on every rank."""
    config = {**cfg(tmp_path, place, "bf16", zero_stage=3), "_keep": True}
    ranks = run_ranks(2, config, str(tmp_path / "out"), 2)
    assert ranks[0]["partitioned_numel"] > 0
    assert [r["kept"]["equal"] for r in ranks] == [True, True]
    assert [r["kept"]["whole"] for r in ranks] == [True, True]
    assert ranks[0]["kept"]["loss"] == ranks[1]["kept"]["loss"]
