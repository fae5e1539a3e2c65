"""`offload train --model HF_DIR`: a sharded safetensors directory streams into a meta-built model, its
logits equal transformers' own loading, and `--save` writes a directory transformers loads back."""

import json
import os

import pytest
import torch

import offload
from offload import train as recipe
from offload.cli import main
from offload.integrations.hf_io import SafetensorsWeights

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def _tiny_llama(tied: bool):
    cfg = transformers.LlamaConfig(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tied, rope_theta=10000.0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def hf_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "llama"
    _tiny_llama(request.param).save_pretrained(path, max_shard_size="60KB", safe_serialization=True)
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
    with offload.initialize(model, cfg, weights=weights) as eng, torch.no_grad():
        eng.eval()
        got = eng(input_ids=_ids()).logits
    weights.close()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_rotary_buffers_are_rebuilt_from_the_config(hf_dir):
    model, weights, _ = recipe.build({"model": hf_dir, "seq_len": 24}, offload.Config())
    ref = transformers.LlamaForCausalLM.from_pretrained(hf_dir)
    assert not any(b.is_meta for b in model.buffers())
    assert torch.equal(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)


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


def _save_tokenizer(directory, text: str):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.save_pretrained(directory)
    return fast


def test_a_directory_with_a_tokenizer_trains_on_its_ids(tmp_path, capsys):
    model_dir = tmp_path / "llama"
    _tiny_llama(tied=False).save_pretrained(model_dir, max_shard_size="60KB")
    text = "To be, or not to be, that is the question. " * 40
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": text[i:i + 300]}) + "\n" for i in range(0, len(text), 300)))
    tok = _save_tokenizer(model_dir, text)
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
    _tiny_llama(tied=False).save_pretrained(model_dir, max_shard_size="60KB")
    tok = _save_tokenizer(model_dir, "To be, or not to be, that is the question. " * 40)
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
