import json
import re
import subprocess
import sys

import pytest

import offload
from offload import cli
from offload.estimate import format_bytes, ledger_terms, model_shape, model_state_bytes, runtime_bytes, shape_of_model
from tests import hf_archs


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


def test_without_placement_flags_it_says_so_and_how_to_see_what_train_places(capsys):
    from offload import recipe

    assert cli.main(["estimate", "--params", "1e9"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("placement: nothing offloaded (this command's default")
    flags = re.search(r"add (--offload-param \S+ --offload-optimizer \S+) for its figures", line).group(1).split()
    cfg, _ = recipe.resolve(recipe.as_namespace({}))  # offload train with no flags
    assert flags == ["--offload-param", cfg.offload_param.device, "--offload-optimizer", cfg.offload_optimizer.device]
    assert run_json(capsys, "--params", "1e9", *flags)["model_states"]["hbm_bytes"] == 0
    assert cli.main(["estimate", "--params", "1e9", "--offload-optimizer", "cpu"]) == 0
    assert "placement:" not in capsys.readouterr().out  # a placement given: the head line names it


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
    """The estimate's runtime is offload.plan.memory's (the engine's own plan), every unit as large as the largest."""
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
    config = dict(vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
                  **extra)
    hf_config = transformers.LlamaConfig(**config)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf_config)
    expected = sum(p.numel() for p in model.parameters())
    hf_config.save_pretrained(tmp_path)                  # the config.json transformers itself writes
    assert run_json(capsys, "--model", str(tmp_path))["params"] == expected
    assert run_json(capsys, "--model", str(tmp_path / "config.json"))["params"] == expected


def _units(model):
    """{unit path: parameters} as the engine splits the model: the embedding, each decoder layer, an untied
    head; the norms (small) resident."""
    from offload.plan.units import partition

    return {u.name: sum(s.numel for s in u.slots) for u in partition(model, offload.Config().units.min_numel)}


@pytest.mark.parametrize("arch", sorted(hf_archs.ARCHS))
def test_any_causal_lm_directory_is_counted_as_transformers_builds_it(tmp_path, capsys, arch):
    """Issue 41 item 2: the count of any architecture AutoModelForCausalLM builds, tied weights once, MoE experts
    whole, LoRA on all its linears as peft puts them (no formula per architecture)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    import torch
    hf_archs.config(arch).save_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_archs.config(arch))
    params = sum(p.numel() for p in model.parameters())
    units = _units(model)
    out = run_json(capsys, "--model", str(tmp_path), "--precision", "fp32")
    assert out["params"] == params and out["largest_unit_numel"] == max(units.values())
    assert sum(units.values()) == params and len(units) >= 3  # the layers are units of their own
    lora = run_json(capsys, "--model", str(tmp_path), "--precision", "fp32", "--lora", "4", "--lora-targets",
                    "all-linear")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
    trained = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    assert lora["trainable_params"] == trained > 0 and lora["frozen_params"] == params
    # every weight (fp32), frozen or not; gradients and m, v of the adapters only
    assert lora["model_states"]["hbm_bytes"] == 4 * (params + trained) + (4 + 8) * trained


def test_lora_default_targets_are_peft_s_for_the_model_type(tmp_path, capsys):
    hf_archs.config("qwen2").save_pretrained(tmp_path / "qwen2")
    hf_archs.config("phi3").save_pretrained(tmp_path / "phi3")
    argv = ["--precision", "fp32", "--lora", "4"]
    default = run_json(capsys, "--model", str(tmp_path / "qwen2"), *argv)
    named = run_json(capsys, "--model", str(tmp_path / "qwen2"), *argv, "--lora-targets", "q_proj,v_proj")
    assert default["trainable_params"] == named["trainable_params"] == 2 * 4 * ((64 + 64) + (64 + 32))
    assert "with LoRA r 4 on q_proj,v_proj" in default["source"]
    assert cli.main(["estimate", "--model", str(tmp_path / "phi3"), *argv]) == 2  # peft has no default for phi3
    err = capsys.readouterr().err
    assert "peft has no default targets for model_type='phi3'" in err and "qkv_proj" in err and "all-linear" in err


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
def test_shape_of_a_transformers_model_is_its_units(tie):
    transformers = pytest.importorskip("transformers")
    import torch
    config = dict(vocab_size=50, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    shape = shape_of_model(model)
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert shape.params == sum(p.numel() for p in model.parameters()) and shape.largest_unit_numel == layer
    assert shape.trainable is None


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
    (["estimate", "--model", "tiny", "--seq", "512"], "--seq=512: activations need both --seq and --batch; add --batch"),
    (["estimate", "--params", "1B", "--seq", "512", "--batch", "1"], "--seq=512: needs --model"),
    (["estimate", "--model", "tiny", "--seq", "0", "--batch", "1"], "--seq=0: must be a positive integer"),
    (["estimate", "--model", "tiny", "--seq", "64", "--batch", "1", "--offload-activations", "cpu"],
     "--offload-activations=cpu: places the inputs the engine's checkpoints keep; add --activation-checkpointing"),
])
def test_bad_input_is_one_line_and_exit_code_2(capsys, argv, message):
    """In process (argparse's refusals exit, the others return 2); test_help_works runs the entry point."""
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_lora_target_that_names_no_module_is_refused_as_offload_train_refuses_it(tmp_path, capsys):
    hf_archs.config("gpt2").save_pretrained(tmp_path)
    assert cli.main(["estimate", "--model", str(tmp_path), "--lora", "8", "--lora-targets", "c_attn,c_prj"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "c_prj names no module of the model (model_type gpt2); nearest: c_proj" in err[0], err


def test_a_config_that_is_not_a_causal_lm_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))
    assert cli.main(["estimate", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model_type='vit': not a causal language model" in err[0], err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model", "hidden_size": 8}))
    assert cli.main(["estimate", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "model_type='no-such-model'" in err and "does not know it" in err


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


# -- a quantized frozen base (--lora R --quantize nf4|int8) ------------------------------------------

def _llama_linears(d, ff, q, kv):
    """(out, in) of the 7 linears of a Llama decoder layer: q, k, v, o, gate, up, down."""
    return [(q, d), (kv, d), (kv, d), (d, q), (ff, d), (ff, d), (d, ff)]


@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize("precision,itemsize", [("bf16", 2), ("fp32", 4)])
def test_quantized_base_weights_are_the_records_bytes_in_their_tier(capsys, kind, precision, itemsize):
    """7b (Llama-2-7B's shape) with LoRA r 16 on q, v: the nvme weights are exactly the decoder layers' 7 x 32
    linears at their record bytes, plus embedding, head, norms and adapters at the compute dtype."""
    from offload.plan.quantized import record_bytes
    d, ff, layers, vocab, r = 4096, 11008, 32, 32000, 16
    linears = _llama_linears(d, ff, d, d)
    records = layers * sum(record_bytes(kind, s) for s in linears)
    linear_numel = layers * sum(o * i for o, i in linears)
    rest = 2 * vocab * d + layers * 2 * d + d                    # embedding, untied head, norms
    adapters = layers * r * ((d + d) + (d + d))                  # q_proj, v_proj: r x (in + out)
    argv = ["--model", "7b", "--lora", str(r), "--offload-param", "nvme", "--offload-optimizer", "cpu",
            "--precision", precision]
    out = run_json(capsys, *argv, "--quantize", kind)
    full = run_json(capsys, *argv)
    assert linear_numel + rest == out["frozen_params"] == full["frozen_params"] and out["trainable_params"] == adapters
    assert out["quantize"] == kind and full["quantize"] is None
    assert out["frozen_base"]["bytes"] == records + rest * itemsize
    assert out["frozen_base"]["quantized_bytes"] == records and out["frozen_base"]["quantized_params"] == linear_numel
    assert out["model_states"]["nvme_bytes"] == records + (rest + adapters) * itemsize
    assert full["model_states"]["nvme_bytes"] == (linear_numel + rest + adapters) * itemsize
    assert out["model_states"]["dram_bytes"] == full["model_states"]["dram_bytes"]   # adapters' grads + states
    bits = {"nf4": (4.12, 4.14), "int8": (8.0, 8.01)}[kind]
    assert bits[0] < 8 * records / linear_numel < bits[1]
    ratio = out["model_states"]["nvme_bytes"] / full["model_states"]["nvme_bytes"]
    # nf4 is 4.13 bits of 16 (bf16) or 32 (fp32), int8 8 bits; the embedding and head stay at the compute dtype
    # (so against bf16 even nf4 is above a quarter: 4.13 / 16 = 0.258 for the linears alone)
    assert ratio < {("nf4", 4): 0.17, ("nf4", 2): 0.29, ("int8", 4): 0.29, ("int8", 2): 0.53}[kind, itemsize]
    assert kind != "nf4" or itemsize != 4 or ratio < 0.25
    # the working set: 4 units, each as large as the largest as fetched: here the embedding at the compute dtype
    fetched = {p["name"]: p["bytes"] for p in out["runtime"]["parts"]}["fetched weights"]
    assert fetched == 4 * vocab * d * itemsize == 4 * out["largest_unit_bytes"]


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_quantized_decoder_layer_is_fetched_at_its_records_bytes(tmp_path, capsys, kind):
    """A small vocabulary (d 128, ff 384, 4 heads, 2 kv heads of 32, biases): a decoder layer is the largest unit,
    and the fetched working set is 4 of it at its records' bytes plus its biases, norms and adapters at the
    compute dtype; with ZeRO 3 over 2 ranks each rank holds half the weights' bytes."""
    from offload.plan.quantized import record_bytes
    d, ff, kv, layers, vocab, r = 128, 384, 64, 3, 64, 4
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="llama", vocab_size=vocab, hidden_size=d, intermediate_size=ff, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)))
    linears = _llama_linears(d, ff, d, kv)
    adapters = r * ((d + d) + (d + kv))                          # per layer: q_proj, v_proj
    rest = sum(o for o, _ in linears) + 2 * d + adapters         # biases (one per output), norms, adapters
    layer = sum(record_bytes(kind, s) for s in linears) + rest * 4
    assert layer > vocab * d * 4
    argv = ["--model", str(tmp_path), "--lora", str(r), "--quantize", kind, "--offload-param", "cpu",
            "--precision", "fp32"]
    out = run_json(capsys, *argv)
    assert out["largest_unit_bytes"] == layer
    assert {p["name"]: p["bytes"] for p in out["runtime"]["parts"]}["fetched weights"] == 4 * layer
    weights = layers * layer + (vocab * d + d) * 4               # tied embedding: no head; the final norm
    assert out["model_states"]["dram_bytes"] == weights
    zero3 = run_json(capsys, *argv, "--stage", "3", "--dp", "2")
    assert zero3["model_states"]["dram_bytes"] == -(-weights // 2)


def test_quantized_llama_2_70b_shape_is_about_35_gb(tmp_path, capsys):
    config = dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["--model", str(tmp_path), "--lora", "16", "--quantize", "nf4", "--offload-param", "nvme",
            "--offload-optimizer", "cpu", "--precision", "bf16"]
    out = run_json(capsys, *argv)
    assert 68.9e9 < out["frozen_params"] < 69.0e9
    assert 34e9 <= out["frozen_base"]["bytes"] <= 37e9
    assert 34e9 <= out["model_states"]["nvme_bytes"] <= 37e9
    assert cli.main(["estimate", *argv]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("frozen base:")]
    assert len(lines) == 1 and " nf4 (4.13 bits a parameter" in lines[0] and "36.4 GB in all" in lines[0], lines


@pytest.mark.parametrize("argv,message", [
    (["--model", "7b", "--quantize", "nf4"],
     "--quantize=nf4: a quantized base is frozen, it is trained through adapters; add --lora R"),
    (["--params", "7B", "--quantize", "int8"], "--quantize=int8: needs --model"),
    (["--params", "7B", "--lora", "8", "--quantize", "nf4"], "--quantize=nf4: needs --model"),
    (["--model", "7b", "--lora", "8", "--quantize", "nf4", "--unit-numel", "1000"], "--unit-numel=1000: with --quantize"),
])
def test_quantize_refusals_are_one_line(capsys, argv, message):
    assert cli.main(["estimate", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_quantize_kind_is_a_choice(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["estimate", "--model", "7b", "--lora", "8", "--quantize", "fp8"])
    assert e.value.code == 2 and "invalid choice: 'fp8'" in capsys.readouterr().err


# -- activations (--seq, --batch, --activation-checkpointing) -------------------------------------------------

def test_activations_by_formula_in_their_tier(tmp_path, capsys):
    """--seq and --batch add the activations of offload.plan.activation_memory's formula, read from the model's
    config, to hbm (with --offload-activations cpu the kept unit inputs to dram), in the ledger and in the
    engine's own plan; --activation-bytes replaces them."""
    from offload.plan.activation_memory import ModelDims, activation_parts

    hf_archs.config("llama").save_pretrained(tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    dims = ModelDims(conf["hidden_size"], conf["intermediate_size"], conf["num_attention_heads"],
                     conf["num_key_value_heads"], conf.get("head_dim") or conf["hidden_size"] // conf["num_attention_heads"],
                     conf["vocab_size"], conf["num_hidden_layers"])
    argv = ["--model", str(tmp_path), "--precision", "fp32", "--device", "cpu", "--offload-param", "cpu",
            "--offload-optimizer", "cpu"]
    none = run_json(capsys, *argv)
    plain = run_json(capsys, *argv, "--seq", "2048", "--batch", "2")
    [part] = [p for p in plain["runtime"]["parts"] if p["name"].startswith("activations")]
    [expected] = activation_parts(dims, 2, 2048, 4, scores=False, checkpointing=False)
    assert part == expected and part["tier"] == "hbm"
    assert plain["per_rank"]["hbm_bytes"] == none["per_rank"]["hbm_bytes"] + part["bytes"]
    assert plain["engine_plan"]["hbm_bytes"] == none["engine_plan"]["hbm_bytes"] + part["bytes"]
    ckpt = run_json(capsys, *argv, "--seq", "2048", "--batch", "2", "--activation-checkpointing",
                    "--offload-activations", "cpu")
    parts = {p["name"]: p for p in ckpt["runtime"]["parts"] if p["name"].startswith("activations")}
    kept = parts["activations: kept unit inputs"]
    assert kept["tier"] == "dram" and kept["bytes"] == (dims.layers - 1) * 2 * 2048 * 4 * dims.hidden
    assert ckpt["per_rank"]["dram_bytes"] == none["per_rank"]["dram_bytes"] + kept["bytes"]
    assert sum(p["bytes"] for p in parts.values()) < part["bytes"]
    given = run_json(capsys, *argv, "--seq", "2048", "--batch", "2", "--activation-bytes", "1000")
    assert given["per_rank"]["hbm_bytes"] == none["per_rank"]["hbm_bytes"] + 1000
    assert cli.main(["estimate", *argv, "--seq", "4096", "--batch", "1"]) == 0
    table = capsys.readouterr().out
    assert "hbm activations: " in table and "L x layer + max(head, backward)" in table and "T 4096" in table
    assert "Not included: allocator slack." in table


def test_a_model_whose_shape_cannot_be_read_is_estimated_without_activations_and_says_so(tmp_path, capsys):
    hf_archs.config("gpt2").save_pretrained(tmp_path)  # GPT-2's config names no intermediate_size
    result = run_json(capsys, "--model", str(tmp_path), "--seq", "64", "--batch", "1")
    assert not [p for p in result["runtime"]["parts"] if p["name"].startswith("activations")]
    assert cli.main(["estimate", "--model", str(tmp_path), "--seq", "64", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "activations: not counted (its config has no intermediate_size)" in out
