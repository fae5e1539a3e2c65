"""`offload train --model HF_DIR`: a sharded safetensors directory streams into a meta-built model, its
logits equal transformers' own loading, and `--save` writes a directory transformers loads back; any causal
LM AutoModelForCausalLM builds (issue 41 item 2: tests/hf_archs.py's architectures) streams, trains with
LoRA, and saves a merged model, a checkpoint and an export that transformers loads."""

import json
import os

import pytest
import torch

import offload
from offload import recipe
from offload import train as training
from offload.cli import main
from offload.integrations.hf_io import SafetensorsWeights, iter_safetensors
from tests import hf_archs
from tests.hf_util import probe, save_tokenizer, spy_on_saves, tiny_llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("safetensors")


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def hf_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "llama"
    tiny_llama(request.param).save_pretrained(path, max_shard_size="60KB", safe_serialization=True)
    shards = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert len(shards) >= 3 and os.path.isfile(path / "model.safetensors.index.json")
    return str(path)


def _ids():
    return torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(5))


def test_first_logits_equal_transformers_loading(hf_dir, tmp_path):
    cfg = offload.load_config({"precision": "fp32", "offload_param": {"device": "nvme"},
                               "offload_optimizer": {"device": "nvme"}, "nvme_path": str(tmp_path)})
    model, weights, info = recipe.build({"model": hf_dir, "seq_len": 24}, cfg)
    assert all(p.is_meta for p in model.parameters())  # nothing materialized before the Engine streams it
    assert weights._open == {}                          # no shard opened yet
    ref = transformers.LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(input_ids=_ids()).logits
    del ref  # its tensors map the shards too
    with offload.initialize(model, cfg, weights=weights) as eng, torch.no_grad():
        # the values placed, the engine let the source go and closed it: no shard stays mapped
        assert eng.weights_source is None and weights._open == {}
        assert not [line for line in open("/proc/self/maps") if hf_dir in line]
        eng.eval()
        got = eng(input_ids=_ids()).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_weights_source_reports_missing_tensors(hf_dir):
    weights = SafetensorsWeights(hf_dir)
    with pytest.raises(ValueError, match=r"weights\['nope'\]: not in the safetensors"):
        weights("nope")
    assert weights("model.norm.weight").shape == (64,)
    assert len(weights._open) == 1  # only the shard holding that tensor was opened


def test_train_hf_dir_and_save_loads_back_into_transformers(hf_dir, tmp_path, capsys):
    out, save = tmp_path / "run", tmp_path / "saved"
    rc = main(["train", "--model", hf_dir, "--steps", "2", "--batch-size", "2", "--seq-len", "32",
               "--nvme-path", str(tmp_path / "swap"), "--out", str(out), "--save", str(save), "--json",
               "--no-progress"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["steps"] == 2 and report["saved"] == str(save)
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(save, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    before = transformers.LlamaForCausalLM.from_pretrained(hf_dir)
    changed = [n for n, p in loaded.named_parameters() if not torch.equal(p, before.state_dict()[n])]
    assert "model.layers.0.self_attn.q_proj.weight" in changed  # trained, not a copy of the input
    with torch.no_grad():
        assert torch.isfinite(loaded(input_ids=_ids()).logits).all()


def test_activation_checkpointing_flag_on_a_hf_directory(hf_dir, tmp_path, capsys):
    """--activation-checkpointing checkpoints the decoder layers of a Hugging Face model as the presets' blocks
    (the engine's mechanism, nothing asked of the model): the same losses as without."""
    losses = {}
    for flag in ([], ["--activation-checkpointing"]):
        rc = main(["train", "--model", hf_dir, "--steps", "2", "--batch-size", "2", "--seq-len", "32",
                   "--nvme-path", str(tmp_path / "swap"), "--out", str(tmp_path / f"run{len(flag)}"), "--json",
                   "--no-progress", *flag])
        assert rc == 0
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert report["stats"]["activations"]["checkpointed_units"] == 2 * len(flag)  # the 2 layers
        losses[bool(flag)] = report["losses"]
    assert losses[True] == losses[False]


def test_a_directory_with_a_tokenizer_trains_on_its_ids(tmp_path, capsys):
    model_dir = tmp_path / "llama"
    tiny_llama(tied=False).save_pretrained(model_dir, max_shard_size="60KB")
    text = "To be, or not to be, that is the question. " * 40
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": text[i:i + 300]}) + "\n" for i in range(0, len(text), 300)))
    tok = save_tokenizer(model_dir, text)
    ids = recipe.load_token_ids(str(data), recipe._hf_tokenizer(str(model_dir)))
    first = tok(text[:300], add_special_tokens=False)["input_ids"]
    assert ids.dtype == torch.int32 and ids[:len(first)].tolist() == first and ids[len(first)] == tok.eos_token_id
    rc = main(["train", "--model", str(model_dir), "--data", str(data), "--steps", "1", "--batch-size", "2",
               "--seq-len", "16", "--nvme-path", str(tmp_path / "swap"), "--out", str(tmp_path / "run"),
               "--json", "--no-progress"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokenizer"] != "bytes"


def test_save_and_export_write_what_from_pretrained_and_autotokenizer_load_as_it_was(tmp_path, capsys):
    model_dir, save, ckpts, export = tmp_path / "llama", tmp_path / "saved", tmp_path / "ckpts", tmp_path / "export"
    tiny_llama(tied=False).save_pretrained(model_dir, max_shard_size="60KB")
    tok = save_tokenizer(model_dir, "To be, or not to be, that is the question. " * 40)
    assert json.loads((model_dir / "config.json").read_text())["use_cache"] is True
    rc = main(["train", "--model", str(model_dir), "--steps", "2", "--batch-size", "2", "--seq-len", "16",
               "--nvme-path", str(tmp_path / "swap"), "--out", str(tmp_path / "run"), "--save", str(save),
               "--save-every", "2", "--checkpoint-dir", str(ckpts), "--json", "--no-progress"])
    assert rc == 0
    assert main(["checkpoint", "export", str(ckpts), str(export)]) == 0
    for out in (save, export):
        assert json.loads((out / "config.json").read_text())["use_cache"] is True, out  # as the directory had it
        assert (out / "generation_config.json").is_file(), out
        loaded_tok = transformers.AutoTokenizer.from_pretrained(out)
        assert loaded_tok("question").input_ids == tok("question").input_ids
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
        assert loaded.generation_config.eos_token_id == transformers.GenerationConfig.from_pretrained(model_dir).eos_token_id


# --- any causal LM (issue 41 item 2) ---------------------------------------------------------------------

TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 30
STEPS = 2


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory):
    """model_type -> a directory of that tiny architecture, with a 200-token BPE tokenizer, and the data."""
    root = tmp_path_factory.mktemp("archs")
    (root / "data.jsonl").write_text("".join(json.dumps({"text": TEXT[i:i + 200]}) + "\n"
                                             for i in range(0, len(TEXT), 200)))
    dirs = {}
    for arch in hf_archs.ARCHS:
        hf_archs.save_model(arch, root / arch)
        save_tokenizer(root / arch, TEXT)
        dirs[arch] = root / arch
    return dirs


@pytest.mark.parametrize("arch", sorted(hf_archs.ARCHS))
def test_any_causal_lm_streams_into_the_engine_with_transformers_logits(arch_dirs, tmp_path, arch):
    """Built by AutoModelForCausalLM on the meta device; its checkpoint's tensors (renamed or converted as
    from_pretrained does: GPT-NeoX's embed_out, an MoE's experts one tensor each on disk) stream in; the
    buffers nothing holds (rotary inv_freq, Gemma's embedding scale) come from the model's own init."""
    cfg = offload.load_config({"precision": "fp32", "offload_param": {"device": "nvme"},
                               "offload_optimizer": {"device": "nvme"}, "nvme_path": str(tmp_path)})
    model, weights, info = recipe.build({"model": str(arch_dirs[arch]), "seq_len": 16}, cfg)
    assert info["kind"] == "hf" and all(p.is_meta for p in model.parameters())
    ref = transformers.AutoModelForCausalLM.from_pretrained(arch_dirs[arch], dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(input_ids=probe()).logits
    with offload.initialize(model, cfg, weights=weights) as eng, torch.no_grad():
        eng.eval()
        got = eng(input_ids=probe()).logits
        for name, b in ref.named_buffers():
            assert torch.equal(model.get_buffer(name), b), name
    weights.close()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


# the architectures of the "done when" (Qwen2-MoE: its merged experts are saved one tensor each), and
# Mixtral with peft's default targets (all-linear puts adapters on its experts' parameters: not merged)
LORA_RUNS = [("qwen2", "all-linear"), ("mistral", "all-linear"), ("gpt2", "all-linear"), ("phi3", "all-linear"),
             ("qwen2_moe", "all-linear"), ("mixtral", None)]


@pytest.mark.parametrize("arch,targets", LORA_RUNS, ids=[a for a, _ in LORA_RUNS])
def test_lora_run_saves_a_merged_model_and_an_export_transformers_loads(arch_dirs, tmp_path, monkeypatch, capsys,
                                                                         arch, targets):
    model_dir = arch_dirs[arch]
    merged, adapter, ckpts, export = tmp_path / "merged", tmp_path / "adapter", tmp_path / "ck", tmp_path / "export"
    seen = spy_on_saves(monkeypatch)
    rc = main(["train", "--model", str(model_dir), "--data", str(model_dir.parent / "data.jsonl"), "--lora", "4",
               *(["--lora-targets", targets] if targets else []), "--steps", str(STEPS), "--batch-size", "2",
               "--seq-len", "16", "--lr", "1e-2", "--precision", "fp32", "--nvme-path", str(tmp_path / "swap"),
               "--out", str(tmp_path / "run"), "--save", str(adapter), "--save-merged", str(merged),
               "--save-every", str(STEPS), "--checkpoint-dir", str(ckpts), "--json", "--no-progress"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["saved_merged"] == str(merged)
    assert main(["checkpoint", "export", str(ckpts), str(export)]) == 0  # merged as --save-merged
    source = dict(iter_safetensors(str(model_dir)))
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        for out in (merged, export):
            assert set(dict(iter_safetensors(str(out)))) == set(source), out  # the keys save_pretrained writes
            loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
            assert not any(info.values()), info
            assert loaded.config.use_cache is True and (out / "tokenizer.json").is_file()
            torch.testing.assert_close(loaded.eval()(probe()).logits, seen["logits"], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(base(probe()).logits, seen["logits"])  # the adapters trained
        peft_model = peft.PeftModel.from_pretrained(base, str(adapter)).eval()  # into base, in place
        torch.testing.assert_close(peft_model(probe()).logits, seen["logits"], rtol=1e-5, atol=1e-5)
    if base.config.tie_word_embeddings:  # one tensor in the engine, once on disk, one parameter when loaded
        assert "lm_head.weight" not in source and not any("lm_head" in n for names in seen["units"] for n in names)
        assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight


def test_full_fine_tune_of_an_moe_resumes_exactly_and_exports_what_save_writes(arch_dirs, tmp_path, capsys):
    """Qwen2-MoE without LoRA: --save-every, --resume from step 1 continues the run's losses exactly; the
    experts' stacked parameters go out one tensor per expert, as save_pretrained writes them."""
    model_dir = arch_dirs["qwen2_moe"]
    args = ["train", "--model", str(model_dir), "--data", str(model_dir.parent / "data.jsonl"), "--steps", "3",
            "--batch-size", "2", "--seq-len", "16", "--precision", "fp32", "--nvme-path", str(tmp_path / "swap"),
            "--json", "--no-progress"]
    ckpts = ["--save-every", "1", "--keep-checkpoints", "3", "--checkpoint-dir", str(tmp_path / "ck")]
    assert main([*args, *ckpts, "--out", str(tmp_path / "a"), "--save", str(tmp_path / "saved")]) == 0
    whole = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["losses"]
    assert main([*args, "--resume", str(tmp_path / "ck" / "step00000001"), "--out", str(tmp_path / "b")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["losses"] == whole[1:]
    assert main(["checkpoint", "export", str(tmp_path / "ck"), str(tmp_path / "export")]) == 0
    saved, exported = dict(iter_safetensors(str(tmp_path / "saved"))), dict(iter_safetensors(str(tmp_path / "export")))
    assert saved.keys() == exported.keys() == dict(iter_safetensors(str(model_dir))).keys()
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in saved
    assert all(torch.equal(saved[k], exported[k]) for k in saved)
