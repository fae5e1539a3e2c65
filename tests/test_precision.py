"""Precision "auto": chosen for the compute device on the host (offload/plan/precision.py).

The CPU's native-bf16 check is monkeypatched both ways and a CUDA device is faked by its compute
capability, so every branch runs on this CPU-only host; the engine, the placement print, the memory plan
and `offload estimate` follow the choice; and an auto run trains to the same numbers as the plain loop at
the precision auto picked here.
"""

import json
import logging

import pytest
import torch

import offload
from offload.plan import precision as prec
from offload.plan.config import Config, load_config
from tests.engine_util import MLP, Reference, mlp_batches
from tests.parity_util import check, config


@pytest.fixture
def cpu_bf16(monkeypatch):
    """Sets what torch's mkldnn bf16 check answers on this host (fp16 stays not native)."""
    def set_to(native: bool) -> None:
        monkeypatch.setattr(prec, "cpu_bf16_native", lambda: native)
        monkeypatch.setattr(prec, "cpu_fp16_native", lambda: False)
    return set_to


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device of the given compute capability, as far as the resolver asks."""
    def set_to(major: int, minor: int) -> torch.device:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"Fake GPU sm_{major}{minor}")
        return torch.device("cuda", 0)
    return set_to


def test_auto_picks_fp32_on_a_cpu_without_native_bf16(cpu_bf16):
    cpu_bf16(False)
    choice = prec.resolve_precision("auto", "cpu")
    assert (choice.name, choice.requested, choice.dtype) == ("fp32", "auto", torch.float32)
    assert "no native bf16" in choice.reason and choice.slow is None
    assert choice.line().startswith("precision fp32 (auto: this CPU has no native bf16")


def test_auto_picks_bf16_on_a_cpu_with_native_bf16(cpu_bf16):
    cpu_bf16(True)
    choice = prec.resolve_precision("auto", "cpu")
    assert choice.name == "bf16" and "runs bf16 natively" in choice.reason


@pytest.mark.parametrize("capability,expected", [((9, 0), "bf16"), ((8, 0), "bf16"), ((7, 5), "fp16"), ((6, 0), "fp16")])
def test_auto_on_a_gpu_follows_its_compute_capability(fake_gpu, cpu_bf16, capability, expected):
    cpu_bf16(True)  # the host CPU does not matter when the compute device is the GPU
    choice = prec.resolve_precision("auto", fake_gpu(*capability))
    assert choice.name == expected, choice
    assert f"compute capability {capability[0]}.{capability[1]}" in choice.reason
    if expected == "fp16":
        assert "loss scaling" in choice.reason


def test_this_host_picks_what_its_own_check_says():
    """No monkeypatching: on this project's AVX2-only hosts the check is False, so auto picks fp32."""
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert prec.resolve_precision("auto", "cpu").name == ("bf16" if native else "fp32")


def test_an_explicit_slow_precision_is_honoured_with_one_warning_line(cpu_bf16, caplog):
    cpu_bf16(False)
    with caplog.at_level(logging.WARNING, logger="offload"):
        choice = prec.resolve_precision("bf16", "cpu", warn=True)
    assert choice.name == "bf16" and choice.auto == "fp32"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "precision=bf16 is slow on this host" in lines[0] and 'precision "auto" would pick fp32' in lines[0]
    assert "slow here" in choice.line() and "auto would pick fp32" in choice.line()


@pytest.mark.parametrize("explicit,native", [("fp32", False), ("fp32", True), ("bf16", True)])
def test_no_warning_where_the_explicit_precision_runs_natively(cpu_bf16, caplog, explicit, native):
    cpu_bf16(native)
    with caplog.at_level(logging.WARNING, logger="offload"):
        choice = prec.resolve_precision(explicit, "cpu", warn=True)
    assert choice.name == explicit and choice.slow is None and not caplog.records


def test_bf16_on_an_old_gpu_is_slow_fp16_is_not(fake_gpu):
    dev = fake_gpu(7, 0)
    assert prec.resolve_precision("bf16", dev).slow and prec.resolve_precision("fp16", dev).slow is None


def test_config_defaults_to_auto_and_takes_every_precision():
    assert Config().precision == "auto"
    for p in ("auto", "bf16", "fp16", "fp32"):
        assert load_config({"precision": p}).precision == p
    with pytest.raises(ValueError, match=r'precision=.bf32.: unknown precision; use "bf16", "fp16", "fp32" or "auto"'):
        load_config({"precision": "bf32"})


def test_the_flag_defaults_to_the_config_default():
    import argparse

    parser = offload.add_arguments(argparse.ArgumentParser())
    assert offload.config_from_args(parser.parse_args([])).precision == "auto"
    assert offload.config_from_args(parser.parse_args(["--precision", "auto"])).precision == "auto"
    assert offload.config_from_args(parser.parse_args(["--precision", "fp16"])).precision == "fp16"


@pytest.mark.parametrize("native,expected", [(False, "fp32"), (True, "bf16")])
def test_the_engine_runs_the_resolved_precision_and_says_why(tmp_path, cpu_bf16, capsys, native, expected):
    cpu_bf16(native)
    with offload.initialize(MLP(), config(tmp_path, "cpu", "cpu", "auto")) as eng:
        assert eng.cfg.precision == expected and eng.dtype == prec.DTYPES[expected]
        assert all(w.dtype == eng.dtype for w in eng.weights)
        assert eng.placement.precision.requested == "auto"
    err = capsys.readouterr().err
    [line] = [l for l in err.splitlines() if "precision" in l]
    assert line.strip().startswith(f"precision {expected} (auto: this CPU ")


@pytest.mark.parametrize("native,same_as", [(False, "fp32"), (True, "bf16")])
def test_the_memory_plan_follows_the_resolved_precision(tmp_path, cpu_bf16, native, same_as):
    from offload.plan.placement import engine_plan

    cpu_bf16(native)
    cfg = {"offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}, "nvme_path": str(tmp_path),
           "reuse_bytes": 0, "units": {"min_numel": 512}}
    auto = engine_plan(MLP(), {**cfg, "precision": "auto"})
    assert auto == engine_plan(MLP(), {**cfg, "precision": same_as})
    assert auto != engine_plan(MLP(), {**cfg, "precision": "bf16" if same_as == "fp32" else "fp32"})


@pytest.mark.parametrize("native,expected", [(False, "fp32"), (True, "bf16")])
def test_offload_estimate_follows_the_resolved_precision(cpu_bf16, capsys, native, expected):
    from offload.cli import main

    cpu_bf16(native)
    assert main(["estimate", "--params", "1e9", "--offload-optimizer", "cpu", "--json"]) == 0
    auto = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["estimate", "--params", "1e9", "--offload-optimizer", "cpu", "--precision", expected, "--json"]) == 0
    explicit = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert auto["precision"] == expected and auto["per_rank"] == explicit["per_rank"]
    assert auto["precision_reason"].startswith(f"precision {expected} (auto:")
    assert main(["estimate", "--params", "1e9", "--offload-optimizer", "cpu"]) == 0
    assert f"precision {expected} (auto:" in capsys.readouterr().out


@pytest.mark.parametrize("param,optim", [("none", "none"), ("cpu", "cpu"), ("nvme", "nvme")])
def test_auto_parity_on_this_host(tmp_path, param, optim):
    """Auto trains to exactly the numbers of the plain loop at the precision auto picks on this host."""
    picked = prec.resolve_precision("auto").name
    torch.manual_seed(0)
    cfg = config(tmp_path, param, optim, "auto")
    model = MLP()
    ref = Reference(model, picked, lr=cfg["optimizer"]["lr"], kernel=True)
    losses, ref_losses = [], []
    with offload.initialize(model, cfg) as eng:
        assert eng.cfg.precision == picked
        for batch in mlp_batches(5):
            loss = eng(*batch)
            eng.backward(loss)
            eng.step()
            losses.append(loss.item())
            ref_losses.append(ref.micro_step(*batch))
            ref.step()
        sd = eng.full_state_dict()
    check(losses, ref_losses, sd, ref.state())
