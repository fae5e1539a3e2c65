"""The dtype `offload train --save / --save-merged` writes (issue 41 item 5): the source's by default (a bf16
directory saves bf16 tensors under a config that says so, half the bytes of fp32), `--save-dtype` to choose,
a LoRA merge in that dtype as peft merges into a base loaded in it, and a bad value refused in one line."""

import json
import os

import pytest
import torch

from offload import recipe
from offload.cli import main
from offload.integrations.hf_io import iter_safetensors, source_dtype, with_dtype
from tests.hf_util import tiny_llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16") / "llama"
    tiny_llama(tied=False).to(torch.bfloat16).save_pretrained(path, max_shard_size="60KB")
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    return path


def _train(bf16_dir, tmp_path, *flags):
    rc = main(["train", "--model", str(bf16_dir), "--steps", "2", "--batch-size", "2", "--seq-len", "16",
               "--lr", "1e-2", "--nvme-path", str(tmp_path / "swap"), "--out", str(tmp_path / "run"),
               "--no-progress", "--json", *flags])
    assert rc == 0


def _tensors(directory) -> dict:
    return dict(iter_safetensors(str(directory)))


def _weight_bytes(directory) -> int:
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory) if f.endswith(".safetensors"))


def _config_dtype(directory) -> str:
    return json.loads((directory / "config.json").read_text())["dtype"]


def test_a_bf16_source_saves_bf16_and_save_dtype_fp32_saves_fp32(bf16_dir, tmp_path, capsys):
    auto, merged, fp32 = tmp_path / "auto", tmp_path / "merged", tmp_path / "fp32"
    _train(bf16_dir, tmp_path / "a", "--save", str(auto), "--save-merged", str(merged))
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert f"saved       {auto} (Hugging Face directory, bfloat16)" in out
    assert f"merged      {merged} (Hugging Face directory, bfloat16)" in out  # --save-merged says so too
    assert report["saved_dtype"] == report["saved_merged_dtype"] == "bfloat16"
    _train(bf16_dir, tmp_path / "b", "--save", str(fp32), "--save-dtype", "fp32")
    assert f"saved       {fp32} (Hugging Face directory, float32)" in capsys.readouterr().out

    for directory in (auto, merged):
        assert {t.dtype for t in _tensors(directory).values()} == {torch.bfloat16}, directory
        assert _config_dtype(directory) == "bfloat16"
        assert transformers.AutoModelForCausalLM.from_pretrained(directory).dtype == torch.bfloat16
    assert {t.dtype for t in _tensors(fp32).values()} == {torch.float32} and _config_dtype(fp32) == "float32"
    assert transformers.AutoModelForCausalLM.from_pretrained(fp32).dtype == torch.float32
    assert abs(_weight_bytes(auto) / _weight_bytes(fp32) - 0.5) < 0.01
    # the same training (same seed and batches): bf16 is the fp32 masters rounded, and they trained
    rounded = {n: t.to(torch.bfloat16) for n, t in _tensors(fp32).items()}
    assert all(torch.equal(t, rounded[n]) for n, t in _tensors(auto).items())
    assert not torch.equal(_tensors(auto)["model.layers.0.self_attn.q_proj.weight"],
                           _tensors(bf16_dir)["model.layers.0.self_attn.q_proj.weight"])


def test_a_lora_merge_in_bf16_is_peft_merge_and_unload_on_the_bf16_base(bf16_dir, tmp_path, capsys):
    peft = pytest.importorskip("peft")
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    _train(bf16_dir, tmp_path, "--lora", "4", "--save", str(adapter), "--save-merged", str(merged))
    out = capsys.readouterr().out
    assert f"saved       {adapter} (peft LoRA adapter, float32)" in out
    assert f"merged      {merged} (Hugging Face directory, bfloat16)" in out
    assert {t.dtype for t in _tensors_of(adapter / "adapter_model.safetensors")} == {torch.float32}
    base = transformers.AutoModelForCausalLM.from_pretrained(bf16_dir)  # bf16: config.json's dtype
    theirs = peft.PeftModel.from_pretrained(base, str(adapter)).merge_and_unload().state_dict()
    ours = _tensors(merged)
    assert ours.keys() == theirs.keys() and _config_dtype(merged) == "bfloat16"
    for name, t in ours.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, theirs[name]), name


def _tensors_of(path) -> list:
    from safetensors.torch import load_file

    return list(load_file(str(path)).values())


def test_a_bad_save_dtype_is_one_line(bf16_dir, tmp_path, capsys):
    base = ["train", "--model", "tiny", "--steps", "1", "--nvme-path", str(tmp_path), "--out", str(tmp_path / "r")]
    with pytest.raises(SystemExit) as e:
        main([*base, "--save", str(tmp_path / "s"), "--save-dtype", "int4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--save-dtype: invalid choice: 'int4'" in err[0], err
    assert main([*base, "--save-dtype", "bf16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["offload train: error: --save-dtype=bf16: applies to what --save or --save-merged writes; add "
                   "one of them"]
    with pytest.raises(ValueError, match=r"^--save-dtype=half: not a dtype to save in; pass auto, bf16, fp16, fp32$"):
        recipe.resolve(recipe.as_namespace({"save": str(tmp_path / "s"), "save_dtype": "half"}))


def test_the_source_dtype_is_the_configs_else_the_tensors(bf16_dir, tmp_path):
    config = json.loads((bf16_dir / "config.json").read_text())
    assert source_dtype(config) == torch.bfloat16
    assert source_dtype({**config, "dtype": "float16"}, str(bf16_dir)) == torch.float16  # as from_pretrained reads it
    del config["dtype"]
    assert source_dtype(config, str(bf16_dir)) == torch.bfloat16  # no dtype in config.json: the weights'
    assert source_dtype(config) == torch.float32
    assert source_dtype({"torch_dtype": "float16"}) == torch.float16  # transformers 4's key
    assert with_dtype({"torch_dtype": "float32"}, torch.bfloat16) == {"torch_dtype": "bfloat16"}
    assert with_dtype({"torch_dtype": None, "dtype": "float32"}, torch.float16)["dtype"] == "float16"
