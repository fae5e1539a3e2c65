"""Activation checkpointing by the engine (config activation_checkpointing; [Note: activation checkpointing] in
offload/step/activations.py): bit for bit the numbers of the model calling torch's non-reentrant checkpoint on each
unit itself, with dropout, for every placement and over ranks (stages 0 and 3); each unit's body runs twice a
step (its forward and one recompute), also when the model checkpoints its units already; only the units' inputs
are kept."""

import pytest
import torch

import offload
from offload.step import activations
from tests.engine_util import MLP, LlamaLoss, Reference, llama, llama_batches, max_state_err, mlp_batches
from tests.ranks_util import run_ranks

STEPS = 4


def config(tmp_path, param: str, optim: str, precision: str, **extra) -> dict:
    return {"precision": precision, "offload_param": {"device": param}, "offload_optimizer": {"device": optim},
            "nvme_path": str(tmp_path / "swap"), "units": {"min_numel": 512}, "reuse_bytes": 0,
            "optimizer": {"lr": 1e-2}, **extra}


def counting(module: torch.nn.Module) -> list[int]:
    """[runs]: how many times `module`'s forward ran."""
    runs = [0]
    module.register_forward_pre_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
    return runs


def train(eng, batches, seed: int = 100) -> list[float]:
    """A step per batch; the global RNG seeded before each forward (dropout), as for the reference."""
    losses = []
    for s, batch in enumerate(batches):
        torch.manual_seed(seed + s)
        loss = eng(*batch)
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("param,optim", [("none", "none"), ("cpu", "cpu"), ("nvme", "nvme")])
def test_engine_checkpointing_equals_torch_checkpoint_per_unit(tmp_path, param, optim, precision):
    """A plain model with dropout, checkpointed by the engine, against the same model calling
    torch.utils.checkpoint.checkpoint(block, ..., use_reentrant=False) on each block in a plain loop (the same
    Adam kernel): losses and weights bit for bit. Each block's body runs twice a step; the engine keeps each
    block's input (one [8, 64] tensor) until its backward, and no block's hidden activation [8, 128]."""
    torch.manual_seed(0)
    model = MLP(dropout=0.2)
    ref = Reference(model, precision, kernel=True)
    ref.model.outer_ckpt = True
    ref_losses = []
    for s, batch in enumerate(mlp_batches(STEPS)):
        torch.manual_seed(100 + s)
        ref_losses.append(ref.micro_step(*batch))
        ref.step()
    runs = counting(model.blocks[1].fc1)
    with offload.initialize(model, config(tmp_path, param, optim, precision, activation_checkpointing=True)) as eng:
        hidden = []  # what autograd keeps of the forward outside the engine's checkpoints
        with torch.autograd.graph.saved_tensors_hooks(lambda t: hidden.append(tuple(t.shape)) or t, lambda t: t):
            losses = train(eng, mlp_batches(STEPS))
        act = eng.stats()["activations"]
        sd = eng.full_state_dict()
    assert losses == ref_losses
    assert max_state_err(sd, ref.state()) == 0.0
    assert runs[0] == 2 * STEPS
    itemsize = torch.finfo(ref.dtype).bits // 8
    assert act == {"checkpointed_units": 3, "inputs_bytes": 0, "inputs_peak_bytes": 3 * 8 * 64 * itemsize, "where": "hbm"}
    assert (8, 128) not in hidden and (8, 64) in hidden  # the norm's input is kept: it is no unit's


def test_without_the_key_the_hidden_activations_are_kept(tmp_path):
    """The check above sees them when the engine does not checkpoint."""
    torch.manual_seed(0)
    with offload.initialize(MLP(dropout=0.2), config(tmp_path, "cpu", "cpu", "fp32")) as eng:
        hidden = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: hidden.append(tuple(t.shape)) or t, lambda t: t):
            train(eng, mlp_batches(1))
        assert (8, 128) in hidden and eng.stats()["activations"]["checkpointed_units"] == 0


@pytest.mark.parametrize("stage,place", [pytest.param(0, "cpu", marks=pytest.mark.slow), (3, "nvme")])
def test_over_ranks_engine_checkpointing_equals_torch_checkpoint_per_unit(tmp_path, stage, place):
    """2 ranks, stage 0 (dram) and stage 3 (nvme, weights gathered again for each backward: the recompute
    runs on the gathered weights), dropout: each rank's losses and the final weights equal those of the same
    ranks running the model that calls torch's checkpoint on each block, bit for bit."""
    cfg = {**config(tmp_path, place, place, "fp32"), "zero_stage": stage, "chunk_bytes": 8192}
    ours = run_ranks(2, {**cfg, "activation_checkpointing": True, "_model": {"dropout": 0.2},
                         "nvme_path": str(tmp_path / "a")}, str(tmp_path / "a"), STEPS)
    theirs = run_ranks(2, {**cfg, "_model": {"dropout": 0.2, "outer_ckpt": True}, "nvme_path": str(tmp_path / "b")},
                       str(tmp_path / "b"), STEPS)
    assert [r["losses"] for r in ours] == [r["losses"] for r in theirs]
    assert ours[0]["losses"] != ours[1]["losses"]  # each rank its own slice
    sd_a, sd_b = torch.load(str(tmp_path / "a.pt")), torch.load(str(tmp_path / "b.pt"))
    assert sd_a.keys() == sd_b.keys() and all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)


def _mlp(kind: str):
    torch.manual_seed(0)
    model = MLP(dropout=0.2, ckpt=kind == "inside", outer_ckpt={"around": True, "reentrant": "reentrant"}.get(kind, False))
    return model, model.blocks[1].fc1, mlp_batches(STEPS)


def _preset(kind: str):
    from offload.models import build_model

    model = build_model("tiny", seed=0, checkpoint_activations=kind == "preset")
    ids = torch.randint(0, 257, (STEPS, 2, 32), generator=torch.Generator().manual_seed(1))
    return model, model.layers[1].mlp, [(i, i) for i in ids]


def _hf(kind: str):
    lm = llama()
    if kind == "hf":
        lm.activation_checkpointing_enable()  # gradient_checkpointing_enable(): each decoder layer's forward (non-reentrant)
    return LlamaLoss(lm), lm.model.layers[1].mlp, llama_batches(STEPS)


@pytest.mark.parametrize("build,kind", [(_mlp, "around"), (_mlp, "reentrant"), (_mlp, "inside"), (_preset, "preset"),
                                        (_hf, "hf")])
def test_a_model_that_checkpoints_its_units_recomputes_them_once(tmp_path, build, kind):
    """A model that checkpoints its units itself (around the unit's call: the presets' checkpoint_activations,
    also reentrant; inside its forward: Hugging Face's gradient_checkpointing_enable()), with the key on: each
    unit's body runs twice a step, as with either alone, and the numbers are those of the model alone."""
    out = {}
    for key in (False, True):
        model, body, batches = build(kind)
        runs = counting(body)
        with offload.initialize(model, config(tmp_path / str(key), "cpu", "cpu", "fp32",
                                              activation_checkpointing=key)) as eng:
            out[key] = train(eng, batches), eng.full_state_dict()
        assert runs[0] == 2 * STEPS, (key, runs[0])
    assert out[True][0] == out[False][0]
    assert max_state_err(out[True][1], out[False][1]) == 0.0


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_hugging_face_models_cache_is_off_in_the_training_forwards_it_checkpoints(tmp_path, caplog, attention):
    """A Hugging Face model with config.use_cache on (its default) under the engine's checkpointing: its training
    forwards run with use_cache=False (each recompute would append its keys and values to the cache again, held
    through the backward), as Hugging Face's gradient checkpointing does, with a warning where the caller asked
    for the cache (once); the numbers are those of the model without checkpointing; a forward without grad keeps
    it."""
    activations._warn_cache_off.cache_clear()
    out = {}
    for key in (False, True):
        lm = llama()
        lm.config._attn_implementation = attention
        assert lm.config.use_cache
        with offload.initialize(lm, config(tmp_path / str(key), "cpu", "cpu", "fp32",
                                           activation_checkpointing=key)) as eng:
            losses, caches = [], []
            for s, (ids, labels) in enumerate(llama_batches(STEPS)):
                got = eng(input_ids=ids, labels=labels, **({"use_cache": True} if s < 2 else {}))
                caches.append(got.past_key_values)
                eng.backward(got.loss)
                eng.step()
                losses.append(got.loss.item())
            with torch.no_grad():
                kept = eng(input_ids=ids).past_key_values
            out[key] = losses, eng.full_state_dict(), caches, kept
    assert out[True][0] == out[False][0] and max_state_err(out[True][1], out[False][1]) == 0.0
    assert all(c is None for c in out[True][2]) and all(c.get_seq_length() == 16 for c in out[False][2])
    assert out[True][3].get_seq_length() == 16
    assert caplog.text.count("use_cache=True is of no use to a training forward the engine checkpoints") == 1


def test_the_recorded_trace_is_the_same_with_and_without_checkpointing(tmp_path):
    """The fetch for a recompute is part of the unit's backward use: the engine's own recompute fetches
    nothing more, a model's own (the presets' checkpoint_activations) fetches the unit its backward fetched
    just before. So the trace (and over ranks, the gathers that follow it) is the one without checkpointing."""
    from offload.models import build_model

    ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(1))
    traces = set()
    for model_ckpt, key in [(False, False), (True, False), (False, True), (True, True)]:
        model = build_model("tiny", seed=0, checkpoint_activations=model_ckpt)
        cfg = config(tmp_path / f"{model_ckpt}{key}", "cpu", "cpu", "fp32", activation_checkpointing=key)
        with offload.initialize(model, cfg) as eng:
            train(eng, [(ids, ids)] * 2)
            traces.add(tuple(eng.trace.recorded))
    assert len(traces) == 1, traces


def test_close_gives_the_units_their_forwards_back(tmp_path):
    lm = llama()
    layer = lm.model.layers[0]
    with offload.initialize(LlamaLoss(lm), config(tmp_path, "cpu", "cpu", "fp32", activation_checkpointing=True)) as eng:
        assert "forward" in vars(layer) and eng.stats()["activations"]["checkpointed_units"] == 2  # not embed, head
        train(eng, llama_batches(1))
    assert "forward" not in vars(layer)
