"""optimizer.states "int8" ([Note: int8 optimizer states]): every placement trains exactly as a plain loop with
the plain-PyTorch 8-bit AdamW per parameter (fp32 moments for parameters under 4096 elements); the states
stay codes and scales in every tier and in checkpoints, which resume bit for bit."""

import json
import math

import pytest
import torch

import offload
from offload.checkpoint.format import CheckpointError
from offload.plan.config import load_config
from tests.engine_util import MLP, Reference, mlp_batches
from tests.parity_util import check, config
from tests.ranks_util import CHUNK_BYTES, run_ranks, single, single_in_rank_order

MODES = [("none", "none"), ("cpu", "cpu"), ("none", "nvme"), ("nvme", "nvme")]


def int8_config(tmp_path, param, optim, precision="fp32", **extra):
    cfg = config(tmp_path, param, optim, precision, **extra)
    cfg["optimizer"]["states"] = "int8"
    return cfg


def model():
    torch.manual_seed(0)
    return MLP(d=72)  # fc1/fc2 72 x 144: 8-bit, the last block partial; inp, biases, norm, head: fp32 moments


def train_both(mdl, cfg, batches, steps: int):
    ref = Reference(mdl, cfg["precision"], lr=cfg["optimizer"]["lr"], kernel=True, states="int8")
    losses, ref_losses = [], []
    with offload.initialize(mdl, cfg) as eng:
        for s in range(steps):
            loss = eng(*batches[s])
            eng.backward(loss)
            eng.step()
            losses.append(loss.item())
            ref_losses.append(ref.micro_step(*batches[s]))
            ref.step()
        return losses, ref_losses, eng.full_state_dict(), ref.state(), eng.stats()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("param,optim", MODES)
def test_int8_parity(tmp_path, param, optim, precision):
    out = train_both(model(), int8_config(tmp_path, param, optim, precision), mlp_batches(4), steps=4)
    check(*out[:4], precision)


def test_int8_moments_are_stored_as_codes(tmp_path):
    """nvme holds one byte a moment element: the swap's optimizer bytes are master + 2 codes + scales."""
    cfg = int8_config(tmp_path, "nvme", "nvme")
    mdl = model()
    with offload.initialize(mdl, cfg) as eng:
        loss = eng(*mlp_batches(1)[0])
        eng.backward(loss)
        eng.step()
        st = next(s for s in eng.states if s is not None and s.int8 and s.numel >= 4096)
        layout = st.layout(0)
        assert layout["exp_avg"][1] == torch.uint8 and layout["exp_avg_sq"][1] == torch.uint8
        assert layout["absmax"][0] == 2 * layout["master"][0] // 256


def test_int8_checkpoint_resumes_bit_for_bit(tmp_path):
    batches = mlp_batches(6)
    cfg = int8_config(tmp_path, "nvme", "nvme")
    with offload.initialize(model(), cfg) as eng:
        for b in batches[:3]:
            loss = eng(*b)
            eng.backward(loss)
            eng.step()
        path = eng.save_checkpoint(str(tmp_path / "ck"))
        after = []
        for b in batches[3:]:
            loss = eng(*b)
            eng.backward(loss)
            eng.step()
            after.append(loss.item())
        final = eng.full_state_dict()
    # resumed at another placement: the codes and scales go where that placement keeps them
    with offload.initialize(model(), int8_config(tmp_path / "b", "cpu", "cpu")) as eng:
        eng.load_checkpoint(path)
        resumed = []
        for b in batches[3:]:
            loss = eng(*b)
            eng.backward(loss)
            eng.step()
            resumed.append(loss.item())
        assert resumed == after
        sd = eng.full_state_dict()
        assert all(torch.equal(sd[k], final[k]) for k in final)
    with offload.initialize(model(), config(tmp_path / "c", "cpu", "cpu", "fp32")) as eng:
        with pytest.raises(CheckpointError, match="optimizer.states='fp32'.*int8 moments.*--optimizer-states int8"):
            eng.load_checkpoint(path)


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="optimizer.states='int4': unknown optimizer states; use one of"):
        load_config({"optimizer": {"states": "int4"}})
    with pytest.raises(ValueError, match="optimizer.master='split'.*precision is 'fp32'.*bf16"):
        load_config({"precision": "fp32", "optimizer": {"master": "split"}})


@pytest.mark.parametrize("stage,place", [(2, "cpu"), (3, "nvme")])
def test_int8_over_ranks_trains_like_one_process(tmp_path, stage, place):
    """ZeRO over 2 ranks: each rank quantizes the windows it owns (whole blocks), as one process does; the
    ranks' checkpoint (each its windows' codes and scales) resumes in one process as the ranks go on."""
    cfg = int8_config(tmp_path, place, place, zero_stage=stage, chunk_bytes=CHUNK_BYTES, _model={"d": 72})
    ranks = run_ranks(2, {**cfg, "_save_at": 2}, str(tmp_path / "out"), 4)
    ref_losses, ref_sd = single_in_rank_order({**cfg, "zero_stage": 0, "nvme_path": str(tmp_path / "ref")}, 4, 1, 2)
    sd = torch.load(str(tmp_path / "out.pt"))
    mean = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])]
    assert mean == pytest.approx(ref_losses, rel=1e-5)
    assert_close_int8(sd, ref_sd)
    resumed, resumed_sd = single({**cfg, "zero_stage": 0, "nvme_path": str(tmp_path / "one"),
                                  "_load": str(tmp_path / "out.ckpt")}, 4)
    assert resumed == pytest.approx(mean[2:], rel=1e-5)
    assert_close_int8(resumed_sd, sd)


def assert_close_int8(sd: dict, ref: dict, lr: float = 1e-2) -> None:
    """Over ranks the gradients are summed in another order (the last bits of fp32, tests/ranks_util.py's
    1e-5); an 8-bit moment whose value lies that close to a midpoint of the map then takes the neighbouring
    code, a step of up to 1.4% of its block's absmax, and Adam moves that element by up to that over the root
    of its own v: at most about lr. So: every element within lr, all but 0.1% of each tensor's within 1e-5
    (seen: 1 element of 10368 at 2.7e-3 lr, and after a resume in one process 2e-2 lr)."""
    for name, want in ref.items():
        diff = (sd[name] - want).abs()
        assert float(diff.max()) <= lr, (name, float(diff.max()))
        assert int((diff > 1e-5).sum()) <= max(1, want.numel() // 1000), (name, int((diff > 1e-5).sum()))


def test_nvme_moves_codes_not_an_expansion(tmp_path):
    """States on nvme, weights in dram: a step writes exactly each window's master, codes and scales."""
    with offload.initialize(model(), int8_config(tmp_path, "cpu", "nvme")) as eng:
        for b in mlp_batches(2):
            loss = eng(*b)
            eng.backward(loss)
            eng.step()
        want = sum(numel * dtype.itemsize for st in eng.states if st is not None for i in st.mine
                   for kind, (numel, dtype) in st.layout(i).items() if kind != "grad")
        assert eng.stats()["last_step"]["links"]["dram_to_nvme"]["bytes"] == want


def test_a_disk_too_small_for_fp32_states_names_what_int8_states_need(tmp_path, monkeypatch):
    """The preflight refuses fp32 states on a disk they do not fit, before anything is written, and says what
    nvme needs with int8 states: the need of that very plan."""
    from offload.plan import placement

    with offload.initialize(model(), int8_config(tmp_path, "cpu", "nvme")) as eng:
        int8_need = eng.placement.need["nvme"]
    monkeypatch.setattr(placement, "_free_disk", lambda path: int8_need)  # int8 states fit it, fp32 ones do not
    with pytest.raises(placement.PlacementError, match=rf"nvme needs \d+ bytes .* but the free disk under nvme_path is "
                       rf"{int8_need} bytes .* \(with int8 optimizer states, optimizer.states: int8 or "
                       rf"--optimizer-states int8, it needs {int8_need} bytes "):
        offload.initialize(model(), config(tmp_path / "fp32", "cpu", "nvme", "fp32"))
    assert all(p.is_dir() for p in (tmp_path / "fp32").rglob("*"))  # no file written (the swap directory made)
    with offload.initialize(model(), int8_config(tmp_path, "cpu", "nvme")) as eng:
        assert eng.placement.need["nvme"] == int8_need


def test_estimate_counts_int8_moments(capsys):
    """`offload estimate --optimizer-states int8`: K = 4 + 2 + 8/256 bytes a parameter (bf16), per tier."""
    from offload import cli

    argv = ["estimate", "--params", "7e9", "--precision", "bf16", "--offload-param", "nvme", "--offload-optimizer",
            "nvme", "--json"]
    assert cli.main(argv) == 0
    fp32 = json.loads(capsys.readouterr().out)
    assert cli.main([*argv, "--optimizer-states", "int8"]) == 0
    int8 = json.loads(capsys.readouterr().out)
    assert (fp32["K"], int8["K"]) == (12, 6.03125)
    assert fp32["model_states"]["nvme_bytes"] - int8["model_states"]["nvme_bytes"] == math.ceil(7e9 * (12 - 6.03125))
    assert cli.main(["estimate", "--params", "7e9", "--precision", "fp32", "--master", "split"]) == 2
    assert "optimizer.master='split'" in capsys.readouterr().err


def test_train_cli_takes_int8_and_resumes_only_with_it(tmp_path, capsys):
    from offload import cli

    argv = ["train", "--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--offload-optimizer", "nvme",
            "--nvme-path", str(tmp_path / "swap"), "--checkpoint-dir", str(tmp_path / "ck"), "--no-progress", "--json"]
    assert cli.main([*argv, "--steps", "2", "--save-every", "2", "--optimizer-states", "int8"]) == 0
    assert cli.main([*argv, "--steps", "3", "--resume", "latest"]) == 2
    assert "--optimizer-states int8" in capsys.readouterr().err
    assert cli.main([*argv, "--steps", "3", "--resume", "latest", "--optimizer-states", "int8"]) == 0
