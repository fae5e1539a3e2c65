import json
import subprocess
import sys

import pytest

from offload import cli
from offload.estimate import (format_bytes, ledger_terms, llama_param_count, model_shape,
                              model_state_bytes, runtime_bytes, shape_of_model)


def run_json(capsys, *argv):
    assert cli.main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("stage,exact,shown", [(0, 120_000_000_000, "120 GB"), (1, 31_406_250_000, "31.4 GB"),
                                               (2, 16_640_625_000, "16.6 GB"), (3, 1_875_000_000, "1.88 GB")])
def test_zero_paper_example_7_5b_params_64_ranks(capsys, stage, exact, shown):
    # ZeRO (Rajbhandari et al. 2020), Figure 1: Psi = 7.5B, N_d = 64, K = 12 (mixed precision: bf16 given,
    # since the default, "auto", is fp32 on a CPU without native bf16).
    out = run_json(capsys, "--params", "7.5e9", "--dp", "64", "--stage", str(stage), "--precision", "bf16")
    assert out["model_states"] == {"hbm_bytes": exact, "dram_bytes": 0, "nvme_bytes": 0}
    assert format_bytes(out["model_states"]["hbm_bytes"]) == shown
    assert out["K"] == 12 and isinstance(out["formula"], str)
    assert out["per_rank"] == {k: out["model_states"][k] + out["runtime"][k] for k in out["per_rank"]}
    assert cli.main(["estimate", "--params", "7.5B", "--dp", "64", "--stage", str(stage), "--precision", "bf16"]) == 0
    assert shown in capsys.readouterr().out


def test_offload_moves_whole_terms_between_tiers():
    P = 1_000_000
    assert model_state_bytes(P, 1, ledger_terms(3, "nvme", "nvme")) == \
        {"hbm_bytes": 0, "dram_bytes": 0, "nvme_bytes": 18 * P}     # fp32 grad accumulators beside the states
    assert model_state_bytes(P, 1, ledger_terms(0, "cpu", "cpu")) == \
        {"hbm_bytes": 0, "dram_bytes": 18 * P, "nvme_bytes": 0}
    assert model_state_bytes(P, 4, ledger_terms(2, "none", "cpu")) == \
        {"hbm_bytes": 2 * P, "dram_bytes": (4 + 12) * P // 4, "nvme_bytes": 0}
    assert model_state_bytes(P, 1, ledger_terms(0, precision="fp32")) == \
        {"hbm_bytes": 16 * P, "dram_bytes": 0, "nvme_bytes": 0}             # 4 + 4 + K=8
    with pytest.raises(ValueError, match="offload_param=ssd"):
        ledger_terms(3, "ssd")


def test_runtime_buffers_follow_their_stated_formula():
    """The estimate's runtime is offload.memory's (the engine's own plan), every unit as large as the largest."""
    U = 1_000_000
    none = runtime_bytes(U, ledger_terms(0))
    # states in hbm on a GPU: new weights still pass through 2 pool chunks (one filled, one copied up)
    assert none["dram_bytes"] == 2 * (32 << 20) and [p["name"] for p in none["parts"]] == ["gradients in flight", "chunk pool"]
    r = runtime_bytes(U, ledger_terms(3, "nvme", "nvme"), chunk_bytes=1 << 20)
    parts = {p["name"]: p["bytes"] for p in r["parts"]}
    assert parts["fetched weights"] == 4 * 2 * U        # 1 in use + 2 prefetched + 1 kept by reuse_distance
    assert parts["gradients in flight"] == 2 * 2 * U
    assert parts["chunk pool"] == (2 + 3 * 5) * (1 << 20)   # 2 per fetch + 3 windows x (4 states + new weights)
    assert r["hbm_bytes"] == 12 * U and r["dram_bytes"] == parts["chunk pool"]
    assert runtime_bytes(10 * U, ledger_terms(3, "nvme", "nvme"), chunk_bytes=1 << 20)["dram_bytes"] == r["dram_bytes"]


LLAMA_CONFIGS = [
    dict(tie_word_embeddings=False),
    dict(tie_word_embeddings=True),
    dict(num_key_value_heads=2, head_dim=24, tie_word_embeddings=True),      # GQA, head_dim != hidden/heads
    dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True),
]


@pytest.mark.parametrize("extra", LLAMA_CONFIGS)
def test_llama_count_equals_transformers_model(tmp_path, capsys, extra):
    transformers = pytest.importorskip("transformers")
    import torch
    config = dict(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=176,
                  num_hidden_layers=3, num_attention_heads=4, **extra)
    hf_config = transformers.LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf_config)
    expected = sum(p.numel() for p in model.parameters())
    assert llama_param_count(config)[0] == expected
    hf_config.save_pretrained(tmp_path)                  # the config.json transformers itself writes
    assert run_json(capsys, "--model", str(tmp_path))["params"] == expected
    assert run_json(capsys, "--model", str(tmp_path / "config.json"))["params"] == expected


def test_preset_count_and_largest_unit():
    from offload.models import PRESETS, build_model
    shape = model_shape("tiny")
    model = build_model("tiny")
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.largest_unit_numel == max(sum(p.numel() for p in model.layers[0].parameters()),
                                           model.embed.weight.numel())
    assert model_shape("3b").params == PRESETS["3b"].num_params()
    for name in ("tiny", "3b"):
        ours = shape_of_model(build_model(name, device="meta"))
        ref = model_shape(name)
        assert (ours.params, ours.largest_unit_numel) == (ref.params, ref.largest_unit_numel)


@pytest.mark.parametrize("tie", [False, True])
def test_shape_of_a_transformers_model_equals_its_config_count(tie):
    transformers = pytest.importorskip("transformers")
    import torch
    config = dict(vocab_size=50, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    shape = shape_of_model(model)
    assert (shape.params, shape.largest_unit_numel) == llama_param_count(config)



def _cli(*argv):
    return subprocess.run([sys.executable, "-m", "offload", *argv], capture_output=True, text=True, timeout=60)


def test_help_works():
    for argv in (["--help"], ["estimate", "--help"]):
        res = _cli(*argv)
        assert res.returncode == 0 and "estimate" in res.stdout


@pytest.mark.parametrize("argv,message", [
    (["estimate", "--params", "1e9", "--bogus"], "unrecognized arguments: --bogus"),
    (["estimate"], "one of the arguments --params --model is required"),
    (["estimate", "--params", "lots"], "--params=lots: not a number"),
    (["estimate", "--params", "1e9", "--dp", "0"], "dp=0: must be >= 1"),
    (["estimate", "--model", "/no/such/dir/config.json"], "/no/such/dir/config.json"),
    (["estimate", "--model", "no-such-preset"], "--model=no-such-preset: no such file, directory or preset"),
])
def test_bad_input_is_one_line_and_exit_code_2(argv, message):
    res = _cli(*argv)
    assert res.returncode == 2 and res.stdout == ""
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_non_llama_config_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8}))
    assert cli.main(["estimate", "--model", str(tmp_path)]) == 2
    assert "model_type='gpt2'" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    assert cli.main(["estimate", "--model", str(tmp_path)]) == 2
    assert "missing 'vocab_size'" in capsys.readouterr().err


def test_resident_units_sets_the_fetch_window(capsys):
    base = ["--params", "1B", "--unit-numel", "1000000", "--offload-param", "nvme", "--offload-optimizer", "nvme",
            "--precision", "bf16"]  # 2 B weights
    default = {p["name"]: p["bytes"] for p in run_json(capsys, *base)["runtime"]["parts"]}
    two = {p["name"]: p["bytes"] for p in run_json(capsys, *base, "--resident-units", "2")["runtime"]["parts"]}
    assert default["fetched weights"] == 4 * 2 * 1_000_000 and two["fetched weights"] == 2 * 2 * 1_000_000


def test_runtime_buffers_are_for_the_device_given_and_match_the_engine_plan_on_cpu(capsys):
    """On the CPU backend a fetch reads straight into the hbm copy: no staging chunk, so the ledger's dram is the
    engine's own plan's (a LoRA run: the optimizer windows' new weights alone); --device cuda adds the fetch's."""
    argv = ["--model", "tiny", "--lora", "4", "--offload-param", "nvme", "--offload-optimizer", "none",
            "--precision", "fp32"]
    cpu, cuda = run_json(capsys, *argv, "--device", "cpu"), run_json(capsys, *argv, "--device", "cuda")
    assert cpu["device"] == "cpu" and cuda["device"] == "cuda"
    # the same two chunks; the plan's are of the padded unit (its flat buffer aligns each parameter to 8 KiB)
    assert 0 <= cpu["engine_plan"]["dram_bytes"] - cpu["per_rank"]["dram_bytes"] <= 2 * 8192
    assert cpu["per_rank"]["dram_bytes"] > 0
    assert cuda["per_rank"]["dram_bytes"] > cpu["per_rank"]["dram_bytes"]
