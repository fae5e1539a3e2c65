import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

from offload.integrations import hf_io as hf  # noqa: E402


def tiny_llama(tie: bool):
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def saved(request, tmp_path):
    model = tiny_llama(request.param)
    src = tmp_path / "src"
    model.save_pretrained(src, max_shard_size="20KB", safe_serialization=True)
    return model, src


def test_reads_every_tensor_of_a_sharded_directory(saved):
    model, src = saved
    assert os.path.exists(src / hf.INDEX_FILE) and len(hf.shard_files(str(src))) > 2
    got = dict(hf.iter_safetensors(str(src)))
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")       # transformers does not save the tied copy
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_streams_one_shard_at_a_time(saved, monkeypatch):
    _, src = saved
    opened, open_now, peak = [], [0], [0]
    real = safetensors.safe_open

    class Counting:
        def __init__(self, path, **kw):
            self.inner = real(path, **kw)
            opened.append(path)

        def __enter__(self):
            open_now[0] += 1
            peak[0] = max(peak[0], open_now[0])
            return self.inner.__enter__()

        def __exit__(self, *exc):
            open_now[0] -= 1
            return self.inner.__exit__(*exc)

    monkeypatch.setattr(safetensors, "safe_open", Counting)
    stream = hf.iter_safetensors(str(src))
    next(stream)
    assert len(opened) == 1                  # lazy: the first tensor opens only the first shard
    n = 1 + sum(1 for _ in stream)
    assert peak[0] == 1 and len(opened) == len(hf.shard_files(str(src))) and n > len(opened)


@pytest.mark.parametrize("max_shard_bytes,files", [(30_000, "several"), (1 << 30, "one")])
def test_saved_directory_loads_in_transformers(saved, tmp_path, max_shard_bytes, files):
    model, src = saved
    dst = tmp_path / "dst"
    paths = hf.save_hf_directory(hf.iter_safetensors(str(src)), model.config, str(dst), max_shard_bytes)
    assert (len(paths) > 1) == (files == "several")
    assert os.path.exists(dst / hf.INDEX_FILE) == (files == "several")
    loaded = transformers.LlamaForCausalLM.from_pretrained(dst).eval()
    ids = torch.randint(0, 300, (2, 10))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_resave_replaces_old_shards_and_writes_a_plain_dict_config(tmp_path):
    model = tiny_llama(False)
    state = list(model.state_dict().items())
    hf.save_hf_directory(iter(state), model.config.to_dict(), str(tmp_path), 20_000)
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 2
    hf.save_hf_directory(iter(state), json.loads(model.config.to_json_string()), str(tmp_path), 1 << 30)
    assert sorted(f for f in os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    assert hf.read_config(str(tmp_path))["hidden_size"] == 32
    # a view into a bigger tensor and a shared (tied) tensor are both written as their own storage
    base = torch.arange(12.0)
    hf.save_hf_directory(iter([("a", base[2:5]), ("b", base), ("c", base)]), {}, str(tmp_path / "v"))
    got = dict(hf.iter_safetensors(str(tmp_path / "v")))
    assert torch.equal(got["a"], base[2:5]) and torch.equal(got["c"], base)


def test_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.safetensors") as e:
        list(hf.iter_safetensors(str(tmp_path)))
    assert e.value.filename == str(tmp_path)
    (tmp_path / hf.INDEX_FILE).write_text(json.dumps({"weight_map": {"w": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError) as e:
        list(hf.iter_safetensors(str(tmp_path)))
    assert e.value.filename.endswith("model-00001-of-00002.safetensors")
    with pytest.raises(ValueError, match="appears twice"):
        hf.save_hf_directory(iter([("w", torch.zeros(2)), ("w", torch.ones(2))]), {}, str(tmp_path / "d"))
