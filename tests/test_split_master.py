"""optimizer.master "split" ([Note: split master] in offload/kernels/split.py): the record is exact for every
fp32 pattern (ties included), and training with it is the fp32-master run bit for bit in every placement,
with fp32 or int8 moments, over ranks, and across checkpoints of either master."""

import json
import types

import pytest
import torch

import offload
from offload.kernels import cpu_adam, split
from tests.engine_util import MLP, mlp_batches
from tests.parity_util import config
from tests.ranks_util import CHUNK_BYTES, run_ranks, single

MODES = [("none", "none"), ("cpu", "cpu"), ("none", "nvme"), ("nvme", "nvme"), ("nvme", "cpu")]
BACKENDS = ["torch"] + (["compiled"] if cpu_adam.kernel_backend() == "compiled" else [])
TIES = [1 + 2 ** -8, -(1 + 2 ** -8), 1 + 3 * 2 ** -8, -(1 + 3 * 2 ** -8)]  # low half 0x8000: high half even, odd


def patterns() -> torch.Tensor:
    """Every high half with the low halves around the rounding boundary, and 2^20 random patterns."""
    high = torch.arange(1 << 16, dtype=torch.int64).repeat_interleave(8) << 16
    low = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFE, 0xFFFF, 0x4000]).repeat(1 << 16)
    rand = torch.randint(0, 1 << 32, (1 << 20,), generator=torch.Generator().manual_seed(0))
    bits = torch.cat([high | low, rand])
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_record_gives_back_every_master(backend):
    master = patterns()
    record = torch.empty(split.record_bytes(master.numel()), dtype=torch.uint8)
    split.split_(master, record, backend=backend)
    out = split.join(master.to(torch.bfloat16), record, torch.empty_like(master), backend=backend)
    same = out.view(torch.int32) == master.view(torch.int32)
    assert bool((same | master.isnan()).all())
    assert int((record[2 * master.numel():] != 0).sum()) > 0  # the tie bits were needed
    if len(BACKENDS) == 2:  # the compiled kernel writes the reference's bytes
        ref = torch.empty_like(record)
        split.split_(master, ref, backend="torch")
        assert torch.equal(record, ref)


@pytest.mark.skipif(len(BACKENDS) < 2, reason="the compiled kernel is not built here")
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_every_instruction_set_writes_the_references_bytes(isa):
    """The record alone, and the Adam step joining and splitting it in its pass, at each instruction set this
    CPU has: the torch reference's bytes (join, Adam, split one after the other)."""
    from offload.kernels.adam8 import adam8_step
    from offload.kernels.cpu_adam import _ISAS, adam_step, kernel_isa, set_isa

    if _ISAS.index(isa) > _ISAS.index(kernel_isa()):
        pytest.skip(f"CPU lacks {isa}")
    master = patterns()[:1 << 20]
    master = torch.where(master.isfinite() & (master.abs() < 1e30), master, torch.tensor(0.5))
    n, g = master.numel(), torch.Generator().manual_seed(1)
    grad = torch.randn(n, generator=g).to(torch.bfloat16)
    record = torch.empty(split.record_bytes(n), dtype=torch.uint8)
    split.split_(master, record, backend="torch")
    weight = master.to(torch.bfloat16)
    kw = dict(step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    outs = {}
    set_isa(isa)
    try:
        for how in ("fused", "around"):
            rec, out, scratch = record.clone(), weight.clone(), torch.empty(n)
            m, v = torch.full((n,), 0.01), torch.full((n,), 1e-4)
            if how == "fused":
                adam_step(scratch, grad, m, v, out=out, split=(out, *split.parts(rec, n)), **kw)
            else:
                split.join(weight, rec, scratch, backend="torch")
                adam_step(scratch, grad, m, v, out=out, **kw)
                split.split_(scratch, rec, backend="torch")
            outs[how] = rec, out, m, v
        compiled = record.clone()
        split.split_(master, compiled)
        assert torch.equal(compiled, record)
        assert torch.equal(split.join(weight, record, torch.empty(n)).view(torch.int32), master.view(torch.int32))
        codes = torch.zeros(n, dtype=torch.uint8), torch.zeros(n // 256), torch.zeros(n, dtype=torch.uint8)
        with pytest.raises(ValueError, match="split=: a split master steps fused in the compiled kernel only"):
            adam8_step(torch.empty(n), grad, codes[0], codes[1], codes[2], codes[1].clone(), backend="torch",
                       split=(weight, *split.parts(record, n)), **kw)
    finally:
        set_isa(None)
    for a, b in zip(outs["fused"], outs["around"]):
        assert torch.equal(a, b)


def test_a_tie_on_an_even_high_half_needs_its_bit():
    """1 + 2^-8 (a tie above 1.0, which stays) and 1 - 2^-9 (a tie above 1 - 2^-8, which rounds up) share the
    working weight 1.0 and the low half 0x8000: only the bit differs."""
    master = torch.tensor([1 + 2 ** -8, 1 - 2 ** -9] + [0.0] * 6)
    record = torch.empty(split.record_bytes(8), dtype=torch.uint8)
    split.split_(master, record)
    w = master.to(torch.bfloat16)
    assert w[0] == w[1] == 1.0 and record[0:2].tolist() == record[2:4].tolist() == [0, 0x80]
    assert record[16] == 1
    assert torch.equal(split.join(w, record, torch.empty(8)), master)


def test_bad_records_are_refused():
    with pytest.raises(ValueError, match="multiple of 8"):
        split.record_bytes(12)
    with pytest.raises(ValueError, match="record of 8 masters is 17 uint8 bytes"):
        split.split_(torch.zeros(8), torch.empty(16, dtype=torch.uint8))


def model(ties: bool = True):
    torch.manual_seed(0)
    mdl = MLP(d=72)
    if ties:  # masters on exact ties from the start: both roundings, both signs
        with torch.no_grad():
            mdl.blocks[0].fc1.weight.view(-1)[:64] = torch.tensor(TIES).repeat(16)
    return mdl


def train(mdl, cfg, batches, save=None):
    losses = []
    with offload.initialize(mdl, cfg) as eng:
        first = eng.full_state_dict()
        for k, b in enumerate(batches):
            loss = eng(*b)
            eng.backward(loss)
            eng.step()
            losses.append(loss.item())
            if save is not None and k == save[0]:
                eng.save_checkpoint(save[1])
        return first, losses, eng.full_state_dict()


def split_config(tmp_path, param, optim, states="fp32", **extra):
    cfg = config(tmp_path, param, optim, "bf16", **extra)
    cfg["optimizer"].update(master="split", states=states)
    return cfg


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


@pytest.mark.parametrize("states", ["fp32", "int8"])
@pytest.mark.parametrize("param,optim", MODES)
def test_split_trains_as_the_fp32_master_bit_for_bit(tmp_path, param, optim, states):
    batches = mlp_batches(4)
    ref = config(tmp_path / "ref", param, optim, "bf16")
    ref["optimizer"]["states"] = states
    first, losses, sd = train(model(), split_config(tmp_path, param, optim, states), batches)
    ref_first, ref_losses, ref_sd = train(model(), ref, batches)
    assert losses == ref_losses
    assert_equal(first, ref_first)  # the ties read back as they were given
    assert first["blocks.0.fc1.weight"].view(-1)[:4].tolist() == TIES
    assert_equal(sd, ref_sd)


@pytest.mark.parametrize("states", ["fp32", "int8"])
@pytest.mark.parametrize("param,optim", [("cpu", "cpu"), ("nvme", "nvme")])
def test_joined_around_the_step_trains_alike(tmp_path, monkeypatch, param, optim, states):
    """Where the kernel does not join in its pass (the torch backend; a window whose slots did not all get a
    gradient), the step joins the window before it and splits it after: the same bits."""
    from offload.step import windows

    monkeypatch.setattr(windows, "kernel_backend", lambda: "torch")
    joins = []
    monkeypatch.setattr(windows, "split", types.SimpleNamespace(
        join=lambda *a: joins.append(1) or split.join(*a), split_=split.split_, parts=split.parts))
    batches = mlp_batches(3)
    ref = config(tmp_path / "ref", param, optim, "bf16")
    ref["optimizer"]["states"] = states
    _, losses, sd = train(model(), split_config(tmp_path, param, optim, states), batches)
    _, ref_losses, ref_sd = train(model(), ref, batches)
    assert joins and losses == ref_losses
    assert_equal(sd, ref_sd)


def test_nvme_moves_the_record_not_the_master(tmp_path):
    """States on nvme, weights in dram: a step reads and writes each window's record (2 + 1/8 bytes an element)
    and its moments, nothing else."""
    with offload.initialize(model(), split_config(tmp_path, "cpu", "nvme")) as eng:
        for b in mlp_batches(2):
            loss = eng(*b)
            eng.backward(loss)
            eng.step()
        n = sum(e - b for st in eng.states if st is not None for b, e in st.chunks)
        links = eng.stats()["last_step"]["links"]
        assert links["dram_to_nvme"]["bytes"] == links["nvme_to_dram"]["bytes"] == n * (2 + 1 / 8) + 8 * n


@pytest.mark.parametrize("optim", ["nvme", "cpu"])
@pytest.mark.parametrize("overlap", [True, False])
def test_nvme_weights_are_read_ahead_with_the_windows(tmp_path, monkeypatch, overlap, optim):
    """Weights on nvme, states on nvme or in dram: the weights a split master joins with are read ahead with
    the window (none read when the step reaches the window), within the planned pool, every chunk back after."""
    from offload.state.weight_writer import WeightWriter

    reads = []
    real = WeightWriter._read
    monkeypatch.setattr(WeightWriter, "_read", lambda self, i, what: reads.append(what) or real(self, i, what))
    cfg = split_config(tmp_path, "nvme", optim, chunk_bytes=8192, overlap_step=overlap, split_step=0)
    with offload.initialize(model(), cfg) as eng:
        nvme = [st for st in eng.states if st is not None and eng.weights[st.unit.index].home == "nvme"]
        windows = sum(len(st.mine) for st in nvme)
        assert windows > len(nvme)  # units of several windows
        for b in mlp_batches(2):
            eng.backward(eng(*b))
            eng.step()
        assert reads == ["weights read ahead"] * 2 * windows and eng.staging.lent == 0
        assert eng.staging._pool.peak_bytes <= eng.placement.pool_chunks * eng.placement.chunk_bytes


def test_a_failed_window_returns_the_weights_read_ahead(tmp_path, monkeypatch):
    from offload.step import windows as step_mod

    calls, real = [], step_mod.step_window

    def second_window_fails(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return real(*a, **kw)

    cfg = split_config(tmp_path, "nvme", "nvme", chunk_bytes=8192, overlap_step=False)
    with offload.initialize(model(), cfg) as eng:
        eng.backward(eng(*mlp_batches(1)[0]))
        monkeypatch.setattr(step_mod, "step_window", second_window_fails)
        with pytest.raises(RuntimeError, match="injected"):
            eng.step()
        assert eng.staging.lent == 0 and not any(w.writer._ahead for w in eng.weights)


def test_checkpoints_hold_the_fp32_master_and_resume_under_either(tmp_path):
    """A split run's checkpoint holds fp32 masters: it resumes bit for bit as split or as fp32 master, and an
    fp32-master checkpoint resumes as split."""
    batches = mlp_batches(5)
    ck = str(tmp_path / "ck")
    _, losses, sd = train(model(), split_config(tmp_path / "a", "nvme", "nvme"), batches, save=(1, ck))
    for cfg in (split_config(tmp_path / "b", "cpu", "cpu"), config(tmp_path / "c", "nvme", "cpu", "bf16")):
        with offload.initialize(model(), cfg) as eng:
            eng.load_checkpoint(ck)
            resumed = []
            for b in batches[2:]:
                loss = eng(*b)
                eng.backward(loss)
                eng.step()
                resumed.append(loss.item())
            assert resumed == losses[2:]
            assert_equal(eng.full_state_dict(), sd)
    ck32 = str(tmp_path / "ck32")
    train(model(), config(tmp_path / "d", "cpu", "nvme", "bf16"), batches[:2], save=(1, ck32))
    with offload.initialize(model(), split_config(tmp_path / "e", "nvme", "nvme")) as eng:
        eng.load_checkpoint(ck32)
        for b in batches[2:]:
            eng.backward(eng(*b))
            eng.step()
        assert_equal(eng.full_state_dict(), sd)


def test_background_checkpoint_of_a_split_master(tmp_path):
    batches = mlp_batches(4)
    ck = str(tmp_path / "ck")
    cfg = split_config(tmp_path / "a", "nvme", "nvme")
    with offload.initialize(model(), cfg) as eng:
        for b in batches[:2]:
            eng.backward(eng(*b))
            eng.step()
        at = eng.full_state_dict()
        handle = eng.save_checkpoint(ck, background=True)
        for b in batches[2:]:
            eng.backward(eng(*b))
            eng.step()
        path = handle.wait()
    with offload.initialize(model(), split_config(tmp_path / "b", "cpu", "cpu")) as eng:
        eng.load_checkpoint(path)
        assert_equal(eng.full_state_dict(), at)


@pytest.mark.parametrize("stage,place", [(2, "cpu"), (3, "nvme")])
def test_split_over_ranks_trains_as_the_fp32_master_over_ranks(tmp_path, stage, place):
    """ZeRO over 2 ranks: each rank splits and joins the windows it owns, with the weights of the same chunks
    (stage 3 partitions both alike): the ranks train as fp32-master ranks do, bit for bit, and their checkpoint
    resumes in one process as theirs does."""
    out = {}
    for master in ("split", "fp32"):
        cfg = split_config(tmp_path / master, place, place, zero_stage=stage, chunk_bytes=CHUNK_BYTES, _model={"d": 72})
        cfg["optimizer"]["master"] = master
        ranks = run_ranks(2, {**cfg, "_save_at": 2}, str(tmp_path / master / "out"), 4)
        resumed = single({**cfg, "zero_stage": 0, "nvme_path": str(tmp_path / master / "one"),
                          "_load": str(tmp_path / master / "out.ckpt")}, 4)
        out[master] = ranks[0]["losses"], ranks[1]["losses"], torch.load(str(tmp_path / master / "out.pt")), resumed
    (a0, a1, a_sd, (a_res, a_res_sd)), (b0, b1, b_sd, (b_res, b_res_sd)) = out["split"], out["fp32"]
    assert (a0, a1, a_res) == (b0, b1, b_res)
    assert_equal(a_sd, b_sd)
    assert_equal(a_res_sd, b_res_sd)


def test_split_needs_bf16(tmp_path):
    from offload.plan.precision import resolve_precision

    with pytest.raises(ValueError, match=r"optimizer.master='split'.*precision is 'fp16'.*use precision \"bf16\""):
        offload.initialize(model(False), {**split_config(tmp_path, "cpu", "cpu"), "precision": "fp16"})
    auto = resolve_precision("auto", torch.device("cpu")).name
    if auto != "bf16":  # a host without native bf16: auto's choice is named, and why
        with pytest.raises(ValueError, match=rf"precision 'auto' runs as {auto} here \(.*\); set precision \"bf16\""):
            offload.initialize(model(False), {**split_config(tmp_path, "cpu", "cpu"), "precision": "auto"})


def test_the_plan_counts_the_record(tmp_path):
    """The placement's nvme bytes: the master's 4 B become 2 + 1/8, nothing else changes."""
    plans = {}
    for master in ("fp32", "split"):
        cfg = config(tmp_path / master, "cpu", "nvme", "bf16")
        cfg["optimizer"]["master"] = master
        with offload.initialize(model(False), cfg) as eng:
            plans[master] = eng.placement.need["nvme"]
            n = sum(st.numel for st in eng.states if st is not None)
    assert plans["fp32"] - plans["split"] == 4 * n - (2 * n + n // 8)


def test_estimate_and_cli(tmp_path, capsys):
    from offload import cli

    argv = ["estimate", "--params", "7e9", "--precision", "bf16", "--offload-param", "nvme", "--offload-optimizer",
            "nvme", "--optimizer-states", "int8", "--json"]
    assert cli.main(argv) == 0
    fp32 = json.loads(capsys.readouterr().out)
    assert cli.main([*argv, "--master", "split"]) == 0
    split_ = json.loads(capsys.readouterr().out)
    assert (fp32["K"], split_["K"], split_["master"]) == (6.03125, 4.15625, "split")
    assert fp32["model_states"]["nvme_bytes"] - split_["model_states"]["nvme_bytes"] == int(7e9 * 1.875)
    train = ["train", "--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--steps", "2", "--precision", "bf16",
             "--offload-optimizer", "nvme", "--nvme-path", str(tmp_path / "swap"), "--no-progress", "--json"]
    assert cli.main([*train, "--master", "split", "--optimizer-states", "int8"]) == 0
    assert cli.main([*train, "--optimizer-master", "split"]) == 0  # the spelling torchrun lets through
    assert cli.main([*train[:-6], "--master", "split", "--precision", "fp32", "--no-progress"]) == 2
    assert "optimizer.master='split'" in capsys.readouterr().err
