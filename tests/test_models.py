import dataclasses
import json

import pytest
import torch

from offload.models import PRESETS, LlamaLM, ModelConfig, build_model, hf_llama_config, hf_name, init_weights, loss_of

CFG = dataclasses.replace(PRESETS["tiny"], n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96)


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_preset_sizes_match_their_parameter_count():
    for name in PRESETS:
        model = build_model(name, device="meta")
        assert sum(p.numel() for p in model.parameters()) == PRESETS[name].num_params()
    assert 0.5e6 < PRESETS["tiny"].num_params() < 1.5e6
    assert 8e6 < PRESETS["small"].num_params() < 20e6
    assert 180e6 < PRESETS["bench-200m"].num_params() < 240e6
    assert 2.8e9 < PRESETS["3b"].num_params() < 3.5e9
    untied = dataclasses.replace(CFG, tie_embeddings=False)
    assert sum(p.numel() for p in LlamaLM(untied).parameters()) == untied.num_params()


def test_meta_model_materialized_unit_by_unit_equals_cpu_build(tmp_path):
    import offload

    expected = _state(build_model(CFG, seed=7))
    meta = build_model(CFG, device="meta", seed=7)
    assert all(p.is_meta for p in meta.parameters())
    cfg = {"precision": "fp32", "seed": 7, "offload_param": {"device": "nvme"},
           "offload_optimizer": {"device": "nvme"}, "nvme_path": str(tmp_path)}
    with offload.initialize(meta, cfg) as eng:  # the Engine's side of the seeding contract
        got = eng.full_state_dict()
    assert got.keys() == expected.keys()
    for k in expected:
        assert torch.equal(got[k], expected[k]), k
    other = _state(build_model(CFG, seed=8))
    assert not torch.equal(other["layers.0.attn.wq.weight"], expected["layers.0.attn.wq.weight"])


def test_init_weights_is_device_and_dtype_independent_and_rejects_modules_without_reset():
    a = init_weights(LlamaLM(CFG), 3)
    b = init_weights(LlamaLM(CFG, dtype=torch.bfloat16), 3)
    for (k, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa.to(torch.bfloat16), pb), k
    bad = torch.nn.Sequential(torch.nn.Module())
    bad[0].w = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(TypeError, match="reset_parameters"):
        init_weights(bad, 0)


def test_loss_is_shifted_cross_entropy_and_ignores_minus_100():
    model = build_model(CFG, seed=1)
    ids = torch.randint(0, CFG.vocab_size, (2, 16))
    logits = model(ids)
    assert logits.shape == (2, 16, CFG.vocab_size)
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, CFG.vocab_size), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(model(ids, labels=ids), ref)
    labels = ids.clone()
    labels[:, 8:] = -100
    ref = torch.nn.functional.cross_entropy(logits[:, :7].reshape(-1, CFG.vocab_size), ids[:, 1:8].reshape(-1))
    torch.testing.assert_close(model(ids, labels=labels), ref)
    assert loss_of(model(ids, labels=ids)).ndim == 0


@pytest.mark.parametrize("tie", [True, False])
def test_logits_equal_transformers_llama_with_the_same_weights(tie):
    transformers = pytest.importorskip("transformers")
    cfg = dataclasses.replace(CFG, tie_embeddings=tie)
    ours = build_model(cfg, seed=2).eval()
    config = transformers.LlamaConfig(**{k: v for k, v in hf_llama_config(cfg).items()
                                         if k not in ("model_type", "architectures")})
    theirs = transformers.LlamaForCausalLM(config).eval()
    missing, unexpected = theirs.load_state_dict({hf_name(k): v for k, v in ours.state_dict().items()},
                                                 strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if tie else set())
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ours(ids, labels=ids), theirs(ids, labels=ids).loss, atol=1e-5, rtol=1e-4)


def test_activation_checkpointing_gives_the_same_loss_and_grads():
    ids = torch.randint(0, CFG.vocab_size, (2, 16))
    plain = build_model(CFG, seed=4)
    ckpt = build_model(CFG, seed=4, checkpoint_activations=True)
    assert ckpt.config.checkpoint_activations
    plain(ids, labels=ids).backward()
    ckpt(ids, labels=ids).backward()
    for (k, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=k)


def test_tiny_model_learns():
    torch.manual_seed(0)
    model = build_model(CFG, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 16, (2, 16))
    losses = []
    for _ in range(12):
        loss = model(ids, labels=ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_bad_configs_and_names_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="n_kv_heads=3"):
        ModelConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="--model=nope"):
        build_model("nope")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))  # not a causal LM
    with pytest.raises(ValueError, match="model_type='vit': not a causal language model"):
        build_model(str(tmp_path))
    with pytest.raises(ValueError, match="max_seq_len"):
        build_model(CFG)(torch.zeros(1, CFG.max_seq_len + 1, dtype=torch.long))


def test_build_model_from_a_hf_directory(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(hf_llama_config(CFG)))
    model = build_model(str(tmp_path), device="meta")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == CFG.num_params()
    assert all(p.is_meta for p in model.parameters())
