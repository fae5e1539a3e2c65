"""`offload train --lora` (issue 31, parts 1-2): a HF Llama directory's LoRA run with the frozen base on nvme
trains as a plain torch + peft loop, leaves the base bit for bit, and saves an adapter peft loads and a merged
model transformers loads from the directory alone; a preset's LoRA run saves an adapter in HF names beside its
exported base; the placement of the adapters' states in hbm; peft's adapters inside their layer's unit."""

import json
import os
import subprocess
import sys

import pytest
import torch

import offload
from offload import recipe
from offload.cli import main
from offload.data import load_data, make_sampler
from offload.lora import base_name
from offload.step.scale import lr_factor
from tests.hf_util import probe, save_tokenizer, spy_on_saves, tiny_llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("safetensors")

STEPS, BATCH, SEQ, LR = 4, 2, 16, 1e-2
TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 30


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora") / "llama"
    tiny_llama(tied=False).save_pretrained(path, max_shard_size="60KB")
    save_tokenizer(path, TEXT)
    data = path.parent / "data.jsonl"
    data.write_text("".join(json.dumps({"text": TEXT[i:i + 200]}) + "\n" for i in range(0, len(TEXT), 200)))
    return path


def _auto_peft_logits(adapter, tmp_path) -> torch.Tensor:
    """The probe's logits of `AutoPeftModelForCausalLM.from_pretrained(adapter)` in a process with no hub
    (HF_HUB_OFFLINE=1): the adapter alone says where its base is."""
    ids, out = tmp_path / "probe.pt", tmp_path / "auto_peft_logits.pt"
    torch.save(probe(), ids)
    code = ("import sys, torch, peft; m = peft.AutoPeftModelForCausalLM.from_pretrained(sys.argv[1]).eval(); "
            "torch.save(m(torch.load(sys.argv[2])).logits.detach(), sys.argv[3])")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code, str(adapter), str(ids), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return torch.load(out)


def _card_base(adapter) -> str:
    """base_model in the adapter's model card (README.md front matter)."""
    front = (adapter / "README.md").read_text().split("---")[1]
    return next(line.split(":", 1)[1].strip() for line in front.splitlines() if line.startswith("base_model:"))


def _plain_peft_losses(model_dir, data: str, cfg) -> list[float]:
    """The same run without offload: transformers' from_pretrained, peft's get_peft_model under the run's
    seed, torch.optim.AdamW (foreach=False) at the engine's hyperparameters and lr schedule, the same batches."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    sampler = make_sampler(load_data(data, tok), BATCH, SEQ, seed=cfg.seed)
    base = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    base.config.use_cache = False
    torch.manual_seed(cfg.seed)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0))
    o = cfg.optimizer
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=o.lr, betas=o.betas, eps=o.eps,
                            weight_decay=o.weight_decay, foreach=False)
    model.train()
    losses = []
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = o.lr * lr_factor(cfg.lr_schedule, step)
        ids, labels = sampler.batch(step)
        loss = model(ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("optimizer", ["none", "nvme"])
def test_lora_run_of_a_hf_directory_equals_torch_and_peft_and_saves_what_they_load(model_dir, tmp_path, monkeypatch,
                                                                                   capsys, optimizer):
    data = str(model_dir.parent / "data.jsonl")
    save, merged = tmp_path / "adapter", tmp_path / "merged"
    args = ["--model", str(model_dir), "--data", data, "--lora", "4", "--steps", str(STEPS), "--batch-size",
            str(BATCH), "--seq-len", str(SEQ), "--lr", str(LR), "--clip", "0", "--precision", "fp32",
            "--offload-param", "nvme", "--offload-optimizer", optimizer, "--nvme-path", str(tmp_path / "swap")]
    seen = spy_on_saves(monkeypatch)
    rc = main(["train", *args, "--out", str(tmp_path / "run"), "--save", str(save), "--save-merged", str(merged),
               "--json", "--no-progress"])
    assert rc == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out.strip().splitlines()[-1])
    assert "parameters: 1,792 trained" in captured.err and "frozen (weights only, in nvme)" in captured.err
    cfg, _ = recipe.resolve(recipe.train_parser().parse_args(args))
    theirs = _plain_peft_losses(model_dir, data, cfg)
    for ours, ref in zip(report["losses"], theirs, strict=True):
        assert abs(ours - ref) <= 1e-6 * abs(ref), (report["losses"], theirs)
    assert report["losses"][-1] < report["losses"][0]

    # the frozen base: bit for bit the checkpoint's
    from offload.integrations.hf_io import iter_safetensors

    original = dict(iter_safetensors(str(model_dir)))
    frozen = {base_name(n): t for n, t in seen["state"].items() if ".lora_" not in n}
    assert frozen.keys() == original.keys()
    assert all(torch.equal(frozen[n], original[n]) for n in original)

    # --save: the adapter, loaded by peft on the HF base, gives the engine's logits; it names its base (the
    # directory's absolute path) in its config and model card, so AutoPeftModelForCausalLM loads it with no hub
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(os.listdir(save))
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    loaded = peft.PeftModel.from_pretrained(base, str(save)).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(probe()).logits, seen["logits"], rtol=1e-5, atol=1e-5)
    assert json.loads((save / "adapter_config.json").read_text())["base_model_name_or_path"] == str(model_dir)
    assert _card_base(save) == str(model_dir)
    torch.testing.assert_close(_auto_peft_logits(save, tmp_path), seen["logits"], rtol=1e-5, atol=1e-5)

    # --save-merged: from the directory alone, with its tokenizer; use_cache as the directory had it
    tok = transformers.AutoTokenizer.from_pretrained(merged)
    original_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert tok("the question").input_ids == original_tok("the question").input_ids
    model = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    assert model.config.use_cache is True and (merged / "generation_config.json").is_file()
    assert not any("lora" in n or "base_layer" in n for n, _ in model.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(probe()).logits, seen["logits"], rtol=1e-5, atol=1e-5)
    assert report["saved"] == str(save) and report["saved_merged"] == str(merged)


def test_lora_on_a_preset_saves_its_adapter_in_hf_names_beside_its_exported_base(tmp_path, monkeypatch, capsys):
    save, merged, ckpts, export = tmp_path / "adapter", tmp_path / "merged", tmp_path / "ckpts", tmp_path / "export"
    seen = spy_on_saves(monkeypatch)
    rc = main(["train", "--model", "tiny", "--lora", "4", "--lora-targets", "q_proj,v_proj,down_proj",
               "--steps", "3", "--batch-size", "2", "--seq-len", "16", "--lr", "1e-2", "--precision", "fp32",
               "--nvme-path", str(tmp_path / "swap"), "--out", str(tmp_path / "run"), "--save", str(save),
               "--save-merged", str(merged), "--save-every", "3", "--checkpoint-dir", str(ckpts), "--json",
               "--no-progress"])
    assert rc == 0
    assert main(["checkpoint", "export", str(ckpts), str(export)]) == 0  # merged as --save-merged
    config = json.loads((save / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"] and config["lora_alpha"] == 8
    base = transformers.AutoModelForCausalLM.from_pretrained(save / "base")
    loaded = peft.PeftModel.from_pretrained(base, str(save)).eval()
    # the adapter says what its base is: the exported directory (absolute), and in its card, which preset
    assert config["base_model_name_or_path"] == str(save / "base") == _card_base(save)
    assert "`tiny` preset" in (save / "README.md").read_text()
    torch.testing.assert_close(_auto_peft_logits(save, tmp_path), seen["logits"], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(loaded(probe()).logits, seen["logits"], rtol=1e-5, atol=1e-5)
        for out in (merged, export):
            merged_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
            torch.testing.assert_close(merged_model(probe()).logits, seen["logits"], rtol=1e-5, atol=1e-5)
        plain = transformers.AutoModelForCausalLM.from_pretrained(save / "base").eval()
        assert not torch.allclose(plain(probe()).logits, seen["logits"])  # the adapters trained


def test_a_lora_run_resumes_from_its_checkpoint_exactly(tmp_path, capsys):
    args = ["train", "--model", "tiny", "--lora", "2", "--steps", "3", "--batch-size", "2", "--seq-len", "16",
            "--precision", "fp32", "--nvme-path", str(tmp_path / "swap"), "--json", "--no-progress"]
    ckpts = ["--save-every", "2", "--checkpoint-dir", str(tmp_path / "ck")]
    assert main([*args, *ckpts, "--out", str(tmp_path / "a")]) == 0
    whole = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["losses"]
    assert main([*args, "--resume", str(tmp_path / "ck" / "step00000002"), "--out", str(tmp_path / "b")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["losses"] == whole[2:]


def test_lora_adapters_start_as_peft_initializes_them_on_a_loaded_base(model_dir):
    """LoraWeights' adapters equal `torch.manual_seed(seed); get_peft_model(from_pretrained(dir), config)`."""
    cfg = offload.load_config({"precision": "fp32", "seed": 3})
    run = {"model": str(model_dir), "seq_len": 16, "lora": {"r": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj"],
                                                           "dropout": 0.0}}
    model, weights, _ = recipe.build(run, cfg)
    base = transformers.LlamaForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(3)
    ref = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    lora = {n: p for n, p in ref.named_parameters() if "lora_" in n}
    assert lora.keys() == weights.adapters.keys()
    assert all(torch.equal(weights(n), p) for n, p in lora.items())
    assert all(not weights(n).any() for n in lora if "lora_B" in n)
    name = "base_model.model.model.layers.1.self_attn.q_proj.base_layer.weight"
    assert torch.equal(weights(name), base.model.layers[1].self_attn.q_proj.weight)
    with pytest.raises(ValueError, match=r"a peft LoRA model's name.*offload.lora.LoraWeights"):
        weights.source(name)  # the checkpoint alone, asked by peft's name: says what to wrap it in
    weights.close()


def test_peft_adapters_stay_in_their_decoder_layers_unit(model_dir):
    model, _, _ = recipe.build({"model": str(model_dir), "seq_len": 16,
                                "lora": {"r": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj"], "dropout": 0.0}},
                               offload.Config())
    from offload.plan.units import partition

    units = partition(model, 1 << 20)
    assert [u.name for u in units if not u.persistent] == ["base_model.model.model.layers.0",
                                                            "base_model.model.model.layers.1"]
    assert all(u.trainable_numel and any(".lora_A." in s.name for s in u.slots) for u in units[:2])


@pytest.mark.parametrize("optimizer", ["none", "cpu"])
def test_a_step_writes_the_adapters_not_the_frozen_chunk_beside_them(model_dir, tmp_path, optimizer):
    """Weight chunks split at the trainable prefix (offload.plan.chunks.weight_chunks): a step writes each layer's
    adapters alone (fp32 here: 4 B each) and reads no frozen weight back to rewrite it; the chunks are small
    enough that a unit has several, so a chunk shared with frozen weights would show."""
    model, weights, _ = recipe.build({"model": str(model_dir), "seq_len": SEQ,
                                      "lora": {"r": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj"], "dropout": 0.0}},
                                     offload.Config())
    cfg = {"precision": "fp32", "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": optimizer},
           "nvme_path": str(tmp_path), "chunk_bytes": 16384, "optimizer": {"lr": LR}}
    ids = torch.randint(0, 200, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with offload.initialize(model, cfg, weights=recipe.LoraWeights(weights, model, 0)) as eng:
        layers = [u for u in eng.units if u.trainable_numel]
        assert len(layers) == 2 and all(eng.weights[u.index].chunks[0][1] < u.numel for u in layers)
        for _ in range(2):
            eng.backward(eng(ids, labels=ids).loss)
            eng.step()
        links = eng.stats()["last_step"]["links"]
        assert links["dram_to_nvme"]["bytes"] == sum(u.trainable_numel for u in layers) * 4
        fetched = sum(u.numel for u in eng.units if not u.persistent) * 4
        assert links["nvme_to_dram"]["bytes"] in (fetched, 2 * fetched)  # whole fetches (kept or not), nothing more


def _lora_mlp():
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    return peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["0", "2"]))


def test_states_in_hbm_beside_weights_on_nvme_are_planned_checked_and_refused_on_cuda(tmp_path):
    from offload.plan.placement import PlacementError, plan_placement
    from offload.plan.precision import resolve_precision
    from offload.plan.units import partition

    model = _lora_mlp()
    units = partition(model, 0)
    cfg = offload.load_config({"precision": "fp32", "offload_param": {"device": "nvme"},
                               "offload_optimizer": {"device": "none"}, "nvme_path": str(tmp_path),
                               "budgets": {"hbm_bytes": 1 << 20}})
    p = plan_placement(units, cfg, torch.device("cpu"))
    assert set(p.state_home.values()) == {"hbm"} and set(p.weight_home.values()) == {"nvme"}
    assert "512 trained" in p.summary() and "frozen (weights only, in nvme)" in p.summary()
    small = offload.load_config({**cfg.to_dict(), "budgets": {"hbm_bytes": 4096, "dram_bytes": None}})
    with pytest.raises(PlacementError, match=r"states of the 512 trained parameters need .* set offload_optimizer "
                                             r"to cpu or nvme"):
        plan_placement(units, small, torch.device("cpu"))
    with pytest.raises(PlacementError, match="never run on CUDA; set offload_optimizer to cpu"):
        plan_placement(units, cfg, torch.device("cuda"), precision=resolve_precision("fp32", torch.device("cpu")))


def test_lora_flags_refused_in_one_line(monkeypatch, capsys, tmp_path):
    base = ["train", "--model", "tiny", "--steps", "1", "--nvme-path", str(tmp_path), "--out", str(tmp_path / "r")]
    assert main([*base, "--lora-alpha", "16"]) == 2
    assert "--lora-alpha: applies to a LoRA run only; add --lora R" in capsys.readouterr().err
    assert main([*base, "--lora", "4", "--lora-targets", "q_proj,qkv"]) == 2
    assert "qkv is not a linear of the preset" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "peft", None)  # not installed
    assert main([*base, "--lora", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'offload[lora]' (in a source checkout: pip install -e '.[lora]')" in err[0], err


def test_lora_on_an_embedding_is_refused_with_what_the_command_line_can_do(model_dir, tmp_path, capsys):
    """peft adapts embeddings too (lora_embedding_A/B), which offload neither initializes nor merges: refused before
    anything is built, naming the module and what a command-line user can do instead."""
    assert main(["train", "--model", str(model_dir), "--lora", "4", "--lora-targets", "embed_tokens,q_proj", "--steps",
                 "1", "--seq-len", "16", "--nvme-path", str(tmp_path / "swap"), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "LoraWeights" not in err[0], err
    assert ("--lora-targets=embed_tokens,q_proj: embed_tokens (Embedding) is not a linear layer, and offload trains "
            "LoRA adapters of linear layers only; target linears of this model (down_proj, gate_proj, k_proj, lm_head, "
            "o_proj, q_proj, up_proj, v_proj), or train every parameter, embed_tokens included, without "
            "--lora") in err[0], err
    assert not list((tmp_path / "swap").glob("offload-swap-*"))


def test_lora_weights_refuse_an_adapter_they_do_not_initialize(model_dir):
    """In Python, peft's embedding adapters through LoraWeights: an error about the adapter, not advice to use
    LoraWeights."""
    from offload.integrations.hf_io import SafetensorsWeights
    from offload.lora import LoraWeights
    from offload.models import build_model

    model = peft.get_peft_model(build_model(str(model_dir), device="meta"),
                                peft.LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]))
    weights = LoraWeights(SafetensorsWeights(str(model_dir)), model, 0)
    with pytest.raises(ValueError, match=r"'base_model.model.model.embed_tokens.lora_embedding_A.default'\]: an "
                                         r"adapter LoraWeights has no initial value for: it initializes the lora_A"):
        weights("base_model.model.model.embed_tokens.lora_embedding_A.default")
    weights.close()


def test_estimate_shows_the_frozen_and_trained_split(capsys):
    assert main(["estimate", "--model", "small", "--offload-param", "nvme", "--offload-optimizer", "none",
                 "--precision", "fp32", "--lora", "8", "--json"]) == 0
    lora = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["estimate", "--model", "small", "--offload-param", "nvme", "--offload-optimizer", "none",
                 "--precision", "fp32", "--json"]) == 0
    full = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    trained = 6 * 8 * (384 + 384 + 384 + 128)  # 6 layers, q: 384 -> 384, v: 384 -> 2 x 64
    assert lora["trainable_params"] == trained and lora["frozen_params"] == full["params"]
    assert lora["model_states"]["nvme_bytes"] == 4 * (full["params"] + trained)   # every weight, frozen or not
    assert lora["model_states"]["hbm_bytes"] == 12 * trained                      # gradients + m, v: trained only
    assert full["model_states"]["hbm_bytes"] == 12 * full["params"]
    plan = lora["engine_plan"]
    assert plan["hbm_bytes"] < full["engine_plan"]["hbm_bytes"]


def test_a_lora_target_that_names_no_module_is_refused_with_the_nearest_names(model_dir, tmp_path, capsys):
    """Issue 41 item 4: q_prj,v_proj trained v_proj alone and said "on q_prj,v_proj"; now a target that names no
    module of the model is one line naming it and the nearest names, before anything is built or trained
    (offload estimate alike: tests/test_estimate.py)."""
    base = ["--model", str(model_dir), "--lora", "8", "--steps", "1", "--batch-size", "2", "--seq-len", "16",
            "--nvme-path", str(tmp_path / "swap")]
    assert main(["train", *base, "--lora-targets", "q_prj,v_proj", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--lora-targets=q_prj,v_proj: q_prj names no module of the model" in err[0], err
    assert "; nearest: q_proj," in err[0] and "or pass all-linear" in err[0]
    assert not (tmp_path / "r").exists() and not (tmp_path / "swap").exists()
    assert main(["train", *base, "--lora-targets", "q_proj,v_proj", "--out", str(tmp_path / "ok"),
                 "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "parameters: 3,584 trained" in captured.err  # 2 layers x 8 x ((64 + 64) + (64 + 32))
    assert "LoRA r 8 alpha 16 on q_proj,v_proj" in captured.out


@pytest.mark.parametrize("model", ["tiny", "hf"])
def test_all_linear_adapts_every_linear_but_the_output_head(model_dir, tmp_path, capsys, model):
    model = str(model_dir) if model == "hf" else model
    assert main(["train", "--model", model, "--lora", "2", "--lora-targets", "all-linear", "--steps", "1",
                 "--batch-size", "2", "--seq-len", "16", "--nvme-path", str(tmp_path / "swap"), "--out",
                 str(tmp_path / "r"), "--no-progress"]) == 0
    captured = capsys.readouterr()
    d, kv, ff, layers = (64, 32, 128, 2) if model != "tiny" else (128, 64, 384, 4)
    per_layer = 2 * ((d + d) + 2 * (d + kv) + (d + d) + 2 * (d + ff) + (ff + d))  # q, k, v, o, gate, up, down
    assert f"parameters: {layers * per_layer:,} trained" in captured.err and "on all-linear" in captured.out
