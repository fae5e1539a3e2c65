"""The checkpoints' kept inputs in a tier (config offload_activations; [Note: kept inputs in a tier] in
offload/state/activation_tier.py): in dram and on nvme the numbers are those of the inputs kept in hbm, bit for bit;
the bytes that leave hbm are those the checkpoints keep, and every byte comes back; nothing is left in dram,
hbm or the swap store after a backward, a graph dropped without one, a failed backward, or close()."""

import errno
import gc

import pytest
import torch
from torch.utils._pytree import tree_flatten

import offload
from offload.state import activation_tier
from tests.engine_util import MLP, LlamaLoss, llama, llama_batches, max_state_err

STEPS = 3
ROWS, D = 32, 64  # the MLP's kept input per block: [32, 64], 8 KiB in fp32 (above MOVE_MIN_BYTES)


def config(tmp_path, where: str, param: str = "cpu", precision: str = "fp32", **extra) -> dict:
    return {"precision": precision, "offload_param": {"device": param}, "offload_optimizer": {"device": param},
            "nvme_path": str(tmp_path / "swap"), "units": {"min_numel": 512}, "reuse_bytes": 0,
            "optimizer": {"lr": 1e-2}, "activation_checkpointing": True, "offload_activations": {"device": where},
            **extra}


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(ROWS, 16, generator=g), torch.randn(ROWS, 4, generator=g)) for _ in range(n)]


def train(eng, data, seed: int = 100) -> list[float]:
    losses = []
    for s, batch in enumerate(data):
        torch.manual_seed(seed + s)  # dropout: the same masks in every run
        loss = eng(*batch)
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    return losses


def run(tmp_path, build, data, where: str, **cfg):
    model = build()
    inputs = []  # the bytes of every checkpointed unit's tensor inputs, counted apart from the engine
    with offload.initialize(model, config(tmp_path / where, where, **cfg)) as eng:
        for u in eng._checkpointing.units:
            u.module.register_forward_pre_hook(lambda m, args, kwargs: inputs.append(sum(
                a.numel() * a.element_size() for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)
            )) if torch.is_grad_enabled() else None, with_kwargs=True)
        before = eng.stats()["tiers"]
        losses = train(eng, data)
        stats = eng.stats()
        left = [k for k in eng.store.keys() if k.startswith("activations/")] if eng.store is not None else []
        return losses, eng.full_state_dict(), stats, before, sum(inputs), left


def _mlp():
    torch.manual_seed(0)
    return MLP(dropout=0.2)


def _no_trace_of_them(stats: dict, before: dict, left: list) -> None:
    act = stats["activations"]
    assert act["dram_bytes"] == act["nvme_bytes"] == act["inputs_bytes"] == 0 and left == []
    assert stats["tiers"]["dram"]["used_bytes"] == before["dram"]["used_bytes"] + act["dram_spare_bytes"]
    assert act["dram_spare_bytes"] <= act["dram_peak_bytes"]  # buffers kept for the next inputs (module note)
    assert stats["tiers"]["hbm"]["used_bytes"] == before["hbm"]["used_bytes"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("param", ["none", "cpu", "nvme"])
def test_kept_inputs_in_dram_and_on_nvme_train_bit_for_bit_as_in_hbm(tmp_path, param, precision):
    """An MLP with dropout whose 3 blocks' inputs have the same shape: with the kept inputs in dram or on nvme,
    losses and weights equal those with them in hbm, bit for bit; every byte the checkpoints keep left hbm
    (counted by hooks on the blocks) and came back; the tiers hold what they held before the first step."""
    ref_losses, ref_sd, ref_stats, _, kept, _ = run(tmp_path, _mlp, batches(STEPS), "none", param=param,
                                                    precision=precision)
    assert ref_stats["activations"]["where"] == "hbm"
    assert kept == STEPS * 3 * ROWS * D * (4 if precision == "fp32" else 2)
    for where, tier in (("cpu", "dram"), ("nvme", "nvme")):
        losses, sd, stats, before, counted, left = run(tmp_path, _mlp, batches(STEPS), where, param=param,
                                                       precision=precision)
        assert losses == ref_losses, where
        assert max_state_err(sd, ref_sd) == 0.0, where
        act = stats["activations"]
        assert act["where"] == tier and counted == kept
        assert act["moved_out_bytes"] == act["moved_in_bytes"] == kept and act["stayed_bytes"] == 0
        if tier == "dram":
            assert act["dram_peak_bytes"] == kept // STEPS  # one step's 3 inputs waited there at once
        else:  # the first ones may come back before the last one's write completed
            assert kept // STEPS // 3 <= act["nvme_peak_bytes"] <= kept // STEPS
        assert stats["links"]["hbm_to_dram"]["bytes"] >= kept and stats["links"]["dram_to_hbm"]["bytes"] >= kept
        _no_trace_of_them(stats, before, left)


def _llama():
    return LlamaLoss(llama())


def test_a_hugging_face_llama_trains_bit_for_bit_with_its_kept_inputs_on_nvme(tmp_path):
    """A tiny Llama (2 decoder layers): its hidden states go to dram and nvme and back; its rotary tables
    (1 KiB, under a page) stay; losses and weights as with everything in hbm."""
    ref_losses, ref_sd, *_ = run(tmp_path, _llama, llama_batches(STEPS), "none")
    for where in ("cpu", "nvme"):
        losses, sd, stats, before, counted, left = run(tmp_path, _llama, llama_batches(STEPS), where)
        assert losses == ref_losses and max_state_err(sd, ref_sd) == 0.0, where
        act = stats["activations"]
        hidden = STEPS * 2 * (2 * 16 * 64 * 4)  # a [2, 16, 64] fp32 hidden state per layer and step
        assert act["moved_out_bytes"] == act["moved_in_bytes"] == hidden and act["stayed_bytes"] > 0
        assert act["moved_out_bytes"] + act["stayed_bytes"] == counted
        _no_trace_of_them(stats, before, left)


def test_unpack_returns_each_input_its_own_bytes_with_slow_copies(tmp_path, monkeypatch):
    """Copies delayed at random (a missing wait reads a buffer not yet written): each unpacked input equals,
    bit for bit, the tensor packed for it, though the three blocks' inputs have the same shape."""
    monkeypatch.setenv("OFFLOAD_TEST_COPY_DELAY_S", "0.003")
    packed, checked = {}, []
    pack, unpack = activation_tier.InputTier.pack, activation_tier.InputTier.unpack

    def spy_pack(self, unit, t):
        rec = pack(self, unit, t)
        if rec is not None:
            packed[rec.seq] = t.detach().clone()
        return rec

    def spy_unpack(self, rec):
        t = unpack(self, rec)
        checked.append(torch.equal(t, packed[rec.seq]))
        return t

    monkeypatch.setattr(activation_tier.InputTier, "pack", spy_pack)
    monkeypatch.setattr(activation_tier.InputTier, "unpack", spy_unpack)
    for where in ("cpu", "nvme"):
        checked.clear()
        with offload.initialize(_mlp(), config(tmp_path / where, where)) as eng:
            train(eng, batches(2))
        assert checked == [True] * 6, where


@pytest.mark.parametrize("where", ["cpu", "nvme"])
def test_nothing_is_left_after_a_dropped_graph_a_failed_backward_or_close(tmp_path, where):
    model = _mlp()
    with offload.initialize(model, config(tmp_path, where)) as eng:
        tier = eng.unit_inputs.tier
        before = eng.stats()["tiers"]
        x, y = batches(1)[0]

        loss = eng(x, y)  # a forward whose graph is dropped without a backward (an evaluation with grad on)
        assert len(tier.live) == 3  # each block's input on its way out, or out
        del loss
        gc.collect()
        _no_trace_of_them(eng.stats(), before, [k for k in eng.store.keys()] if eng.store else [])
        assert not tier.live

        assert len(train(eng, batches(1))) == 1  # and the engine trains on

        loss = eng(x, y)  # a backward that fails halfway: the middle block's weight gradient raises
        handle = model.blocks[1].fc1.weight.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):
            eng.backward(loss)
        handle.remove()
        assert tier.live == {} and eng.stats()["activations"]["moved_in_bytes"] > 0  # the last block's came back
        _no_trace_of_them(eng.stats(), before, [k for k in eng.store.keys()] if eng.store else [])

    eng = offload.initialize(_mlp(), config(tmp_path / "b", where))
    loss = eng(x, y)  # close() with a graph alive
    tier = eng.unit_inputs.tier
    eng.close()
    assert tier.live == {} and tier.held == {"hbm": 0, "dram": 0, "nvme": 0}
    assert eng.tiers.acct["dram"].used_bytes == 0 and eng.tiers.acct["hbm"].used_bytes == 0
    del loss


@pytest.mark.parametrize("where", ["cpu", "nvme"])
def test_dram_buffers_are_reused_from_the_second_step_and_returned_on_close(tmp_path, where):
    """A moved input's dram buffer, once free, is kept for the next input of its size: after the first step no
    kept input allocates dram (on CUDA each would be a page-locked registration); the spares stay charged to
    dram, at most the most the inputs held there at once, and close() returns them."""
    with offload.initialize(_mlp(), config(tmp_path, where)) as eng:
        made, empty = [], eng.tiers.empty
        eng.tiers.empty = lambda tier, numel, dtype, what: (made.append(what) if what.startswith("kept input")
                                                            else None, empty(tier, numel, dtype, what))[1]
        train(eng, batches(1))
        first = len(made)
        assert train(eng, batches(STEPS)) and first >= (3 if where == "cpu" else 1) and len(made) == first, made
        act = eng.stats()["activations"]
        assert 0 < act["dram_spare_bytes"] <= act["dram_peak_bytes"] and act["dram_bytes"] == 0
        tier = eng.unit_inputs.tier
    assert tier.spares.total_bytes == 0 and eng.tiers.acct["dram"].used_bytes == 0


def test_a_dram_budget_too_small_for_the_inputs_waits_for_the_writes_to_nvme(tmp_path, monkeypatch):
    """nvme: dram holds only the inputs on their way to the store; with room for one input more than the
    engine's own need, pack waits for the oldest write instead of failing, and the numbers do not change."""
    ref_losses, *_ = run(tmp_path / "ref", _mlp, batches(2), "nvme")
    waited = []
    advance = activation_tier.InputTier._advance
    monkeypatch.setattr(activation_tier.InputTier, "_advance",
                        lambda self, rec, wait=False: (waited.append(rec.seq) if wait else None, advance(self, rec, wait))[1])
    with offload.initialize(_mlp(), config(tmp_path, "nvme")) as eng:
        acct = eng.tiers.acct["dram"]
        acct.budget_bytes = acct.used_bytes + ROWS * D * 4 + 4096  # one input (and no second) fits beside the rest
        assert train(eng, batches(2)) == ref_losses
        assert eng.stats()["activations"]["dram_peak_bytes"] == ROWS * D * 4 and waited


def test_the_config_refuses_a_tier_without_checkpointing_and_nvme_without_a_path():
    with pytest.raises(ValueError, match=r"offload_activations.device='cpu'.*activation_checkpointing is off"):
        offload.load_config({"offload_activations": {"device": "cpu"}})
    with pytest.raises(ValueError, match=r"nvme_path=None: required when a device is \"nvme\""):
        offload.load_config({"activation_checkpointing": True, "offload_activations": {"device": "nvme"}})
    assert offload.load_config({"activation_checkpointing": True,
                                     "offload_activations": {"device": "cpu"}}).offload_activations.device == "cpu"


def test_the_flag_sets_the_key_and_implies_nothing_else():
    import argparse

    parser = offload.add_arguments(argparse.ArgumentParser())
    cfg = offload.config_from_args(parser.parse_args(["--activation-checkpointing", "--offload-activations", "cpu"]))
    assert cfg.offload_activations.device == "cpu" and cfg.offload_param.device == "none"
    with pytest.raises(ValueError, match="activation_checkpointing is off"):
        offload.config_from_args(parser.parse_args(["--offload-activations", "cpu"]))


@pytest.mark.parametrize("stage,place", [pytest.param(0, "cpu", marks=pytest.mark.slow), (3, "nvme")])
def test_over_ranks_the_kept_inputs_in_a_tier_train_bit_for_bit_as_in_hbm(tmp_path, stage, place):
    """2 ranks, dropout, stage 0 with weights and inputs in dram, stage 3 with weights and inputs on nvme: each
    rank's losses and the final weights equal those with the inputs in hbm; each rank's [4, 256] fp32 block
    inputs (4 KiB) left hbm and came back."""
    from tests.ranks_util import run_ranks

    cfg = {**config(tmp_path, "none", param=place), "zero_stage": stage, "chunk_bytes": 8192,
           "_model": {"d": 256, "dropout": 0.2}}
    theirs = run_ranks(2, {**cfg, "nvme_path": str(tmp_path / "b")}, str(tmp_path / "b"), STEPS)
    ours = run_ranks(2, {**cfg, "offload_activations": {"device": place}, "nvme_path": str(tmp_path / "a")},
                     str(tmp_path / "a"), STEPS)
    assert [r["losses"] for r in ours] == [r["losses"] for r in theirs]
    sd_a, sd_b = torch.load(str(tmp_path / "a.pt")), torch.load(str(tmp_path / "b.pt"))
    assert sd_a.keys() == sd_b.keys() and all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    for r in ours:
        act = r["activations"]
        assert act["moved_out_bytes"] == act["moved_in_bytes"] == STEPS * 3 * 4 * 256 * 4
        assert act["dram_bytes"] == act["nvme_bytes"] == 0


def test_a_failed_write_to_nvme_fails_the_forward_and_leaves_nothing(tmp_path):
    """The swap store refuses the inputs' writes (a full drive): the forward or the backward that first sees it
    raises that error, the micro-step rolled back (no unit stepped in the backward: overlap_step off; with it,
    as any I/O error after a unit was stepped, the engine would refuse to go on), every byte is returned, and
    once writes work again the engine trains on."""
    from offload.swap.errors import SwapIOError
    from offload.swap.transfer import failed_ticket

    with offload.initialize(_mlp(), config(tmp_path, "nvme", overlap_step=False)) as eng:
        before = eng.stats()["tiers"]
        write = eng.store.write
        eng.store.write = lambda key, t, **kw: (failed_ticket(SwapIOError(errno.ENOSPC, "write", path="swap", offset=0,
                                                                                nbytes=t.numel() * t.element_size()))
                                                if key.startswith("activations/") else write(key, t, **kw))
        x, y = batches(1)[0]
        with pytest.raises(SwapIOError, match="ENOSPC"):
            for _ in range(2):  # the first failed write is seen at the next pack, or at the latest in the backward
                eng.backward(eng(x, y))
        gc.collect()
        _no_trace_of_them(eng.stats(), before, list(eng.store.keys()))
        assert eng.unit_inputs.tier.live == {}
        eng.store.write = write
        assert len(train(eng, batches(1))) == 1


def test_inputs_on_nvme_beside_weights_in_dram_check_the_swap_directory_first(tmp_path):
    """Only the inputs on nvme: nvme_path is checked as for weights on nvme, with the same one-line error."""
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OSError, match=r"nvme_path=.*file/swap: .*pass a writable directory"):
        offload.initialize(_mlp(), config(tmp_path, "nvme", nvme_path=str(f / "swap")))
    with offload.initialize(_mlp(), config(tmp_path, "nvme")) as eng:
        assert eng.placement.uses_nvme is False and eng.store is not None
