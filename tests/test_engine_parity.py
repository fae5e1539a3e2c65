"""Parity: every placement trains to the same numbers as a plain loop without offload.

Two references. (1) The plain loop updating its fp32 masters with offload's own CPU Adam kernel,
parameter by parameter: the math is identical, so losses and full_state_dict() must be EXACTLY equal,
for every placement and precision (any missed wait, stale buffer or wrong offset shows up here).
(2) The plain loop with torch.optim.AdamW/Adam (foreach=False), independent of our kernel: fp32 losses
and states within 1e-5 relative (the kernel orders its float operations differently).
"""

import copy

import pytest
import torch

import offload
from tests.engine_util import MLP, Block, LlamaLoss, Reference, llama, llama_batches, max_state_err, mlp_batches
from tests.parity_util import check, config

MODES = [("none", "none"), ("none", "cpu"), ("none", "nvme"), ("cpu", "cpu"), ("cpu", "nvme"),
         ("nvme", "cpu"), ("nvme", "nvme")]
TORCH_TOL = 1e-5


def train_both(model, cfg, batches, steps: int, gas: int = 1, clip: float = 0.0, kernel: bool = True, **ref_kw):
    ref = Reference(model, cfg["precision"], lr=cfg["optimizer"]["lr"], clip=clip, gas=gas, kernel=kernel, **ref_kw)
    losses, ref_losses = [], []
    with offload.initialize(model, cfg) as eng:
        for s in range(steps):
            for m in range(gas):
                batch = batches[s * gas + m]
                loss = eng(*batch)
                eng.backward(loss)
                eng.step()
                losses.append(loss.item())
                ref_losses.append(ref.micro_step(*batch))
            ref.step()
        return losses, ref_losses, eng.full_state_dict(), ref.state(), eng.stats()


@pytest.mark.parametrize("param,optim", MODES)
def test_mlp_matches_torch_adamw_fp32(tmp_path, param, optim):
    torch.manual_seed(0)
    out = train_both(MLP(), config(tmp_path, param, optim, "fp32"), mlp_batches(5), steps=5, kernel=False)
    check(*out[:4], tol=TORCH_TOL)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("param,optim", MODES)
def test_mlp_parity(tmp_path, param, optim, precision):
    torch.manual_seed(0)
    out = train_both(MLP(), config(tmp_path, param, optim, precision), mlp_batches(5), steps=5)
    check(*out[:4], precision)
    assert out[4]["step"] == 5


@pytest.mark.parametrize("param,optim", [("none", "none"), ("cpu", "cpu"), ("nvme", "nvme")])
def test_llama_tied_embeddings_parity(tmp_path, param, optim):
    model = LlamaLoss(llama(tied=True))
    assert model.lm.lm_head.weight is model.lm.model.embed_tokens.weight
    out = train_both(model, config(tmp_path, param, optim, "bf16"), llama_batches(5), steps=5)
    check(*out[:4])
    assert "lm.lm_head.weight" in out[2] and "lm.model.embed_tokens.weight" in out[2]


@pytest.mark.parametrize("param,optim", [("cpu", "cpu"), ("nvme", "nvme")])
def test_frozen_parameters(tmp_path, param, optim):
    torch.manual_seed(0)
    model = MLP(frozen=True)
    frozen_before = model.inp.weight.detach().clone()
    out = train_both(model, config(tmp_path, param, optim, "fp32", optimizer={"weight_decay": 0.1}),
                     mlp_batches(5), steps=5, weight_decay=0.1)
    check(*out[:4])
    assert torch.equal(out[2]["inp.weight"], frozen_before)  # never written back


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("param,optim", [("none", "none"), ("cpu", "nvme"), ("nvme", "nvme")])
def test_activation_checkpointing(tmp_path, param, optim, precision):
    torch.manual_seed(0)
    out = train_both(MLP(ckpt=True), config(tmp_path, param, optim, precision), mlp_batches(5), steps=5)
    check(*out[:4], precision)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("param,optim", [("none", "cpu"), ("cpu", "cpu"), ("nvme", "nvme")])
def test_gradient_accumulation_and_clipping(tmp_path, param, optim, precision):
    torch.manual_seed(0)
    cfg = config(tmp_path, param, optim, precision, gradient_accumulation_steps=4, gradient_clipping=0.05)
    out = train_both(MLP(), cfg, mlp_batches(20), steps=5, gas=4, clip=0.05)
    check(*out[:4], precision)


@pytest.mark.parametrize("kernel", [True, False])
def test_adam_with_l2_weight_decay(tmp_path, kernel):
    torch.manual_seed(0)
    cfg = config(tmp_path, "cpu", "cpu", "fp32", optimizer={"type": "adam", "weight_decay": 0.01})
    out = train_both(MLP(), cfg, mlp_batches(5), steps=5, adamw=False, weight_decay=0.01, kernel=kernel)
    check(*out[:4], tol=0.0 if kernel else TORCH_TOL)


# --- overlap and delays: a missing wait must show up as a wrong number ------------------------------

@pytest.mark.parametrize("param", ["nvme", "cpu"])
def test_split_step_equals_every_step_in_backward(tmp_path, param):
    """[Note: split step] With nvme states a fraction of the units' steps (all but the first, every other) is
    deferred to their next fetch: the same numbers as stepping every unit in backward, bit for bit, also with
    an evaluation forward (no_grad) between steps and a weight read right after a step (both apply the
    waiting steps first)."""
    out = {}
    for split in (1.0, 0.5, 0):
        torch.manual_seed(0)
        cfg = {**config(tmp_path / str(split), param, "nvme", "bf16"), "split_step": split}
        with offload.initialize(MLP(), cfg) as eng:
            assert bool(eng.placement.deferred) == bool(split)
            losses = []
            for k, (x, y) in enumerate(mlp_batches(5)):
                loss = eng(x, y)
                eng.backward(loss)
                eng.step()
                losses.append(loss.item())
                if k == 1:
                    with torch.no_grad():
                        losses.append(eng(x, y).item())
                if k == 3:
                    mid = eng.full_state_dict()
            # the deferred units' gradients waited on nvme (in bf16); without split_step none is written
            grads = [k for k in eng.store.keys() if "/grad/" in k]
            assert bool(grads) == bool(split)
            out[split] = losses, mid, eng.full_state_dict()
    for split in (1.0, 0.5):
        assert out[split][0] == out[0][0]
        for a, b in zip(out[split][1:], out[0][1:]):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("param,optim", [("cpu", "cpu"), ("nvme", "nvme")])
def test_overlap_step_equals_step_after_backward(tmp_path, param, optim):
    runs = []
    for overlap in (True, False):
        torch.manual_seed(0)
        c = config(tmp_path / str(overlap), param, optim, "bf16", overlap_step=overlap)
        runs.append(train_both(MLP(), c, mlp_batches(4), steps=4))
    assert runs[0][0] == runs[1][0]
    assert max_state_err(runs[0][2], runs[1][2]) == 0.0


def test_overlapped_step_runs_during_backward(tmp_path):
    torch.manual_seed(0)
    with offload.initialize(MLP(), config(tmp_path, "nvme", "nvme", "fp32")) as eng:
        before = eng.full_state_dict()
        x, y = mlp_batches(1)[0]
        eng.backward(eng(x, y))
        after = eng.full_state_dict()  # before step(): the units were stepped as their gradients landed
        assert all(not torch.equal(before[n], after[n]) for n in before)
        assert eng.step() is True and eng.stats()["step"] == 1


class DelayedBackend:
    """Wraps an I/O backend so every completion arrives after a random delay."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s, self.name = inner, delay_s, f"delayed-{inner.name}"

    def submit(self, blocks):
        import random
        import time

        def late(done):
            def wrapped(block, result):
                time.sleep(random.uniform(0, self.delay_s))
                done(block, result)
            return wrapped

        for b in blocks:
            b.done = late(b.done)
        self.inner.submit(blocks)

    def close(self):
        self.inner.close()


@pytest.mark.parametrize("param,optim,precision", [("cpu", "cpu", "fp32"), ("nvme", "nvme", "bf16")])
def test_parity_with_injected_delays(tmp_path, monkeypatch, param, optim, precision):
    from offload.state.runtime import Runtime
    from offload.swap import SwapStore, ThreadsBackend

    monkeypatch.setenv("OFFLOAD_TEST_COPY_DELAY_S", "0.003")  # before each copy-stream job
    monkeypatch.setattr(Runtime, "open_store", staticmethod(lambda cfg, rank=0: SwapStore(
        cfg.swap_dir(rank), backend=DelayedBackend(ThreadsBackend(4), 0.003), checksum=True)))
    torch.manual_seed(0)
    out = train_both(MLP(), config(tmp_path, param, optim, precision), mlp_batches(5), steps=5)
    check(*out[:4])
    links = out[4]["links"]
    assert links["dram_to_hbm"]["bytes"] > 0
    if param == "nvme":  # on the CPU backend an nvme fetch reads straight into the hbm copy: no copy time
        assert links["nvme_to_dram"]["bytes"] > 0 and links["dram_to_hbm"]["seconds"] == 0


class Branchy(MLP):
    """Dynamic control flow: which blocks run depends on the step (a trace cannot be replayed)."""

    skip = None

    def forward(self, x, y):
        h = self.inp(x)
        for i, b in enumerate(self.blocks):
            if i != self.skip:
                h = b(h)
        return torch.nn.functional.mse_loss(self.head(self.norm(h)).float(), y.float())


def test_dynamic_control_flow_falls_back_to_on_demand_and_warns_once(tmp_path, caplog):
    import logging

    torch.manual_seed(0)
    model = Branchy(n_blocks=4)
    ref = Reference(model, "fp32", lr=1e-2, kernel=True)
    caplog.set_level(logging.WARNING, logger="offload")
    with offload.initialize(model, config(tmp_path, "nvme", "nvme", "fp32")) as eng:
        for step, (x, y) in enumerate(mlp_batches(6)):
            model.skip = ref.model.skip = step % 3   # a different unit order every step
            loss = eng(x, y)
            eng.backward(loss)
            eng.step()
            assert loss.item() == ref.micro_step(x, y)
            ref.step()
        assert max_state_err(eng.full_state_dict(), ref.state()) == 0.0
    warnings = [r for r in caplog.records if "differs from the recorded trace" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.parametrize("param", ["cpu", "nvme"])
def test_reuse_distance_keeps_the_last_block_and_changes_no_number(tmp_path, param):
    runs = []
    for reuse in (-1, 1):
        torch.manual_seed(0)
        c = config(tmp_path / str(reuse), param, param, "fp32", reuse_distance=reuse)
        runs.append(train_both(MLP(), c, mlp_batches(4), steps=4))
    assert runs[0][0] == runs[1][0] and max_state_err(runs[0][2], runs[1][2]) == 0.0
    fetched = [r[4]["links"]["dram_to_hbm"]["bytes"] for r in runs]
    assert fetched[1] < fetched[0]  # the last block is not released between its forward and backward


@pytest.mark.parametrize("param", ["cpu", "nvme"])
def test_reuse_bytes_keeps_forward_weights_for_backward_and_changes_no_number(tmp_path, monkeypatch, param):
    """reuse_bytes: units used again in the step stay in hbm while the kept bytes fit. Derived (None, all of
    this model), bounded (one block's worth), off (0) and every unit released after use (reuse_distance -1,
    which also turns off free holds: offload.plan.memory.free_holds) train to the reference's numbers exactly,
    fetch less the more they keep, and a bounded run's hbm peak stays within the plan; with copy delays
    injected. This model's tied embedding is held from lookup to head in all but the last (free), which is
    what a block's worth of reuse_bytes kept before free holds."""
    monkeypatch.setenv("OFFLOAD_TEST_COPY_DELAY_S", "0.002")
    model = LlamaLoss(llama(tied=True))
    block = sum(p.numel() for p in model.lm.model.layers[0].parameters()) * 2
    runs = {}
    for reuse in (None, block, 0, "release"):
        torch.manual_seed(0)
        keep = {"reuse_bytes": 0, "reuse_distance": -1} if reuse == "release" else {"reuse_bytes": reuse}
        c = config(tmp_path / str(reuse), param, param, "bf16", **keep, units={"min_numel": 4096})
        out = train_both(copy.deepcopy(model), c, llama_batches(4), steps=4)
        check(*out[:4])
        runs[reuse] = out
    fetched = {r: out[4]["links"]["dram_to_hbm"]["bytes"] for r, out in runs.items()}
    assert fetched[None] < fetched[block] <= fetched[0] < fetched["release"], fetched
    with offload.initialize(copy.deepcopy(model), config(tmp_path / "plan", param, param, "bf16", reuse_bytes=None,
                                                         units={"min_numel": 4096})) as eng:
        weights = sum(w.nbytes for u, w in zip(eng.units, eng.weights) if not u.persistent)
        assert eng.placement.reuse_bytes == weights  # derived: this small model is kept whole
    # After the first step (which records the trace, so keeps nothing) each unit is fetched once a step.
    assert runs[None][4]["last_step"]["links"]["dram_to_hbm"]["bytes"] == weights
    with offload.initialize(copy.deepcopy(model), config(tmp_path / "b", param, param, "bf16", reuse_bytes=block,
                                                         units={"min_numel": 4096})) as eng:
        ids = llama_batches(1)[0]
        for _ in range(3):
            eng.backward(eng(*ids))
            eng.step()
        assert eng.stats()["tiers"]["hbm"]["peak_bytes"] <= eng.placement.need["hbm"]


@pytest.mark.parametrize("path", ["accumulation+clipping", "checkpointing", "delayed"])
def test_reuse_bytes_in_every_step_path(tmp_path, path):
    """The derived reuse allowance (every weight kept for its backward) with accumulation and clipping,
    activation checkpointing (the recompute is a use too) and the delayed update: the reference's numbers."""
    torch.manual_seed(0)
    c = config(tmp_path, "nvme", "nvme", "bf16", reuse_bytes=None)
    if path == "accumulation+clipping":
        out = train_both(MLP(), {**c, "gradient_accumulation_steps": 2, "gradient_clipping": 0.05},
                         mlp_batches(8), steps=4, gas=2, clip=0.05)
    elif path == "checkpointing":
        out = train_both(MLP(ckpt=True), c, mlp_batches(4), steps=4)
    else:
        out = train_delayed(MLP(), c, mlp_batches(4), steps=4)
    check(*out[:4])


@pytest.mark.parametrize("extra", [{"delayed_update": True}, {"gradient_clipping": 0.05}])
def test_weights_kept_by_an_eval_forward_see_a_later_update(tmp_path, extra):
    """A forward under no_grad keeps units for a backward that never comes; an update applied after it
    (the delayed update's flush(), or a step after backward when an eval ran in between) must not leave
    those copies stale."""
    torch.manual_seed(0)
    cfg = config(tmp_path, "nvme", "nvme", "bf16", reuse_bytes=None, **extra)
    (x, y), (x2, y2) = mlp_batches(2)
    with offload.initialize(MLP(), cfg) as eng:
        for _ in range(3):
            eng.backward(eng(x, y))
            if not extra.get("delayed_update"):
                with torch.no_grad():
                    eng(x2, y2)  # between backward and the step: the step updates kept units' homes
            eng.step()
        with torch.no_grad():
            before = eng(x2, y2).item()
            eng.flush()
            after = eng(x2, y2).item()
            eng.prefetcher.release_all()  # everything fetched afresh from its home
            fresh = eng(x2, y2).item()
    assert after == fresh
    if extra.get("delayed_update"):
        assert before != after  # the flush moved the weights


def test_reuse_bytes_beyond_the_hbm_budget_fails_before_training(tmp_path):
    """An explicit reuse_bytes is honoured, not shrunk: when even the minimum working set plus the kept
    weights exceed the hbm budget, initialize refuses and names reuse_bytes."""
    from offload.plan.config import load_config
    from offload.plan.placement import PlacementError, plan_placement
    from offload.plan.units import forward_order, partition

    cfg = config(tmp_path, "cpu", "cpu", "fp32", budgets={"hbm_bytes": 1})
    c, model = load_config(cfg), MLP()
    units = partition(model, 512, ())
    least = plan_placement(units, c, torch.device("cpu"), check=False, order=forward_order(model, units)).need["hbm"]
    cfg = config(tmp_path, "cpu", "cpu", "fp32", reuse_bytes=1 << 40, budgets={"hbm_bytes": least})
    with pytest.raises(PlacementError, match="reuse_bytes"):
        offload.initialize(MLP(), cfg)
    offload.initialize(MLP(), {**cfg, "reuse_bytes": None}).close()  # derived: fits what the budget leaves


@pytest.mark.parametrize("param,optim", [("cpu", "cpu"), ("nvme", "nvme")])
def test_one_micro_step_keeps_the_gradient_in_its_own_dtype(tmp_path, param, optim):
    """With one micro-step per window the step reads the bf16 gradient itself (the parity tests check the
    numbers); with accumulation it sums into fp32."""
    for gas, dtype in ((1, torch.bfloat16), (2, torch.float32)):
        torch.manual_seed(0)
        cfg = config(tmp_path / str(gas), param, optim, "bf16", gradient_accumulation_steps=gas)
        with offload.initialize(MLP(), cfg) as eng:
            for x, y in mlp_batches(2 * gas):
                eng.backward(eng(x, y))
                eng.step()
            assert {st.grad_dtype for st in eng.states if st is not None} == {dtype}


def test_per_step_stats(tmp_path):
    torch.manual_seed(0)
    with offload.initialize(MLP(), config(tmp_path, "nvme", "nvme", "fp32")) as eng:
        for x, y in mlp_batches(3):
            eng.backward(eng(x, y))
            eng.step()
        st = eng.stats()
    last = st["last_step"]
    assert 0 < last["links"]["nvme_to_dram"]["bytes"] < st["links"]["nvme_to_dram"]["bytes"]
    assert last["links"]["dram_to_nvme"]["bytes"] > 0 and last["stall_seconds"] <= st["stall_seconds"]


# --- delayed_update: the documented one-step-stale semantics -------------------------------------------

def train_delayed(model, cfg, batches, steps: int, clip: float = 0.0):
    """Engine with delayed_update next to Reference(delayed=True); both flushed at the end."""
    ref = Reference(model, cfg["precision"], lr=cfg["optimizer"]["lr"], clip=clip, kernel=True, delayed=True)
    losses, ref_losses = [], []
    with offload.initialize(model, {**cfg, "delayed_update": True}) as eng:
        for batch in batches[:steps]:
            loss = eng(*batch)
            eng.backward(loss)
            assert eng.step() is True
            losses.append(loss.item())
            ref_losses.append(ref.micro_step(*batch))
            ref.step()
        before_flush = eng.full_state_dict()
        eng.flush()
        ref.flush()
        return losses, ref_losses, eng.full_state_dict(), ref.state(), before_flush


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("param,optim", MODES)
def test_delayed_update_parity(tmp_path, param, optim, precision):
    torch.manual_seed(0)
    out = train_delayed(MLP(), config(tmp_path, param, optim, precision), mlp_batches(5), steps=5)
    check(*out[:4])
    assert max_state_err(out[4], out[3]) > 0  # the last update was pending until flush()


@pytest.mark.parametrize("param,optim", [("none", "none"), ("cpu", "cpu"), ("nvme", "nvme")])
def test_delayed_update_with_clipping_tied_weights_and_checkpointing(tmp_path, param, optim):
    """Clipping (which keeps overlap_step off) pipelines under delayed_update: the global norm of step
    k is known when its update runs during step k+1's backward."""
    model = LlamaLoss(llama(tied=True))
    out = train_delayed(model, config(tmp_path, param, optim, "bf16", gradient_clipping=0.05), llama_batches(5),
                        steps=5, clip=0.05)
    check(*out[:4])
    torch.manual_seed(0)
    out = train_delayed(MLP(ckpt=True), config(tmp_path / "ckpt", param, optim, "bf16"), mlp_batches(4), steps=4)
    check(*out[:4])


def test_delayed_update_semantics_without_the_reference(tmp_path):
    """Steps 1 and 2 both run on the initial weights; step 3 on the weights after step 1's update only,
    which equal a plain (undelayed) run's weights after its first step."""
    torch.manual_seed(0)
    model = MLP()
    batches = mlp_batches(3)
    c = config(tmp_path, "nvme", "nvme", "fp32")
    with offload.initialize(copy.deepcopy(model), c) as plain:  # an engine takes over its model's parameters
        initial = plain.full_state_dict()
        expected_2 = plain(*batches[1]).item()  # the initial weights on batch 2
        plain.backward(plain(*batches[0]))
        plain.step()
        expected_3 = plain(*batches[2]).item()  # after step 1's update, on batch 3
        after_1 = plain.full_state_dict()
    with offload.initialize(model, {**c, "nvme_path": str(tmp_path / "d"), "delayed_update": True}) as eng:
        for i, batch in enumerate(batches):
            loss = eng(*batch)
            if i == 1:
                assert loss.item() == expected_2
                assert max_state_err(eng.full_state_dict(), initial) == 0.0  # step 1's update is pending
            if i == 2:
                assert loss.item() == expected_3
                assert max_state_err(eng.full_state_dict(), after_1) == 0.0
            eng.backward(loss)
            eng.step()


def test_delayed_update_refuses_gradient_accumulation(tmp_path):
    with pytest.raises(ValueError, match="delayed_update=True: needs gradient_accumulation_steps 1"):
        offload.initialize(MLP(), config(tmp_path, "cpu", "cpu", "bf16", delayed_update=True,
                                         gradient_accumulation_steps=2))


class BiasUnusedBlock(Block):
    def _f(self, x):
        return x + torch.nn.functional.linear(torch.relu(self.fc1(x)), self.fc2.weight)  # fc2.bias unused


class SometimesMLP(MLP):
    """blocks.2 runs only on odd calls and blocks.0's fc2 bias never gets a gradient: parameters without a
    gradient in a step are skipped by torch's optimizers (no decay, no moment update, no step count)."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.blocks[0].__class__ = BiasUnusedBlock

    def forward(self, x, y):
        self.calls += 1
        h = self.inp(x)
        for i, b in enumerate(self.blocks):
            if i != 2 or self.calls % 2:
                h = b(h)
        return torch.nn.functional.mse_loss(self.head(self.norm(h)).float(), y.float())


@pytest.mark.parametrize("kernel", [True, False], ids=["exact", "torch"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("param,optim", [("none", "cpu"), ("cpu", "nvme"), ("nvme", "nvme")])
def test_parameters_without_gradients_are_skipped_like_torch(tmp_path, param, optim, precision, kernel):
    """[Note: parameters without a gradient]: exact against the kernel reference (which skips them with
    per-parameter step counts), and within tolerance of torch.optim.AdamW itself (fp32)."""
    if precision == "bf16" and not kernel:
        pytest.skip("bf16 against torch's AdamW: covered by fp32 (the bf16 rounding of forward dominates)")
    torch.manual_seed(0)
    model = SometimesMLP()
    cfg = config(tmp_path, param, optim, precision, optimizer={"weight_decay": 0.1})
    ref = Reference(model, precision, lr=1e-2, weight_decay=0.1, kernel=kernel)
    ref.model.calls = 0
    bias0 = model.blocks[0].fc2.bias.detach().clone()
    tol = 0.0 if kernel else TORCH_TOL
    with offload.initialize(model, cfg) as eng:
        for batch in mlp_batches(6):
            loss = eng(*batch)
            eng.backward(loss)
            eng.step()
            assert abs(loss.item() - ref.micro_step(*batch)) <= tol * abs(loss.item())
            ref.step()
        sd = eng.full_state_dict()
    assert torch.equal(sd["blocks.0.fc2.bias"], bias0.float())  # never had a gradient: never touched
    assert max_state_err(sd, ref.state()) <= tol


@pytest.mark.parametrize("extra", [{"gradient_clipping": 1.0}, {"gradient_accumulation_steps": 2},
                                   {"delayed_update": True},
                                   {"precision": "fp16", "loss_scale": {"initial": 1.0}}],  # unscaled, as the reference
                         ids=["clip", "gas2", "delayed", "fp16"])
@pytest.mark.parametrize("param,optim", [("cpu", "cpu"), ("nvme", "nvme")])
def test_parameters_without_gradients_in_every_step_path(tmp_path, param, optim, extra):
    """The same skipping on the paths beside overlap_step: the step after backward (clipping, fp16 with
    its loss scale), accumulation windows, and the delayed update; exact against the kernel reference."""
    extra = dict(extra)
    train_sometimes_exactly(tmp_path, param, optim, extra.pop("precision", "bf16"), extra, steps=6)


def train_sometimes_exactly(tmp_path, param, optim, precision, extra, steps, check_engine=None) -> None:
    """SometimesMLP trained by the engine (config `extra`) and by the kernel reference with the same
    semantics: every loss and the final state equal bit for bit. check_engine(eng) runs before close."""
    torch.manual_seed(0)
    model = SometimesMLP()
    gas = extra.get("gradient_accumulation_steps", 1)
    cfg = config(tmp_path, param, optim, precision, optimizer={"weight_decay": 0.1}, **extra)
    ref = Reference(model, precision, lr=1e-2, weight_decay=0.1, clip=extra.get("gradient_clipping", 0.0),
                    gas=gas, kernel=True, delayed=extra.get("delayed_update", False))
    ref.model.calls = 0
    batches = mlp_batches(steps * gas)
    with offload.initialize(model, cfg) as eng:
        for s in range(steps):
            for m in range(gas):
                loss = eng(*batches[s * gas + m])
                eng.backward(loss)
                eng.step()
                assert loss.item() == ref.micro_step(*batches[s * gas + m])
            ref.step()
        eng.flush()
        ref.flush()
        sd = eng.full_state_dict()
        if check_engine is not None:
            check_engine(eng)
    assert max_state_err(sd, ref.state()) == 0.0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_exact_parity_with_the_torch_fallback(tmp_path, monkeypatch, precision):
    """Machines without a compiler step with torch's fused Adam ([Note: a position-independent
    fallback]): the engine's flat units and the reference's single parameters still agree bit for bit."""
    from offload.kernels import cpu_adam

    monkeypatch.setattr(cpu_adam, "_auto_backend", "torch")
    torch.manual_seed(0)
    out = train_delayed(MLP(), config(tmp_path, "nvme", "nvme", precision), mlp_batches(4), steps=4)
    check(*out[:4])
    torch.manual_seed(0)
    out = train_both(MLP(), config(tmp_path / "b", "cpu", "nvme", precision), mlp_batches(4), steps=4)
    check(*out[:4])


@pytest.mark.parametrize("chunk_bytes", [8 << 10, 24 << 10, 32 << 20], ids=["smaller", "not-dividing", "default"])
@pytest.mark.parametrize("param,optim", [("nvme", "nvme"), ("cpu", "nvme"), ("nvme", "cpu"), ("cpu", "cpu")])
@pytest.mark.parametrize("extra", [{}, {"gradient_accumulation_steps": 2}, {"gradient_clipping": 1.0},
                                   {"delayed_update": True}], ids=["overlap", "gas2", "clip", "delayed"])
def test_chunk_sizes_change_no_number(tmp_path, monkeypatch, chunk_bytes, param, optim, extra):
    """Chunks are the grain of movement only: a chunk smaller than a unit (8 KiB: 2048 fp32 elements),
    one that does not divide the units (24 KiB), and one larger than all of them train bit for bit like the
    kernel reference, on every step path, with copy delays injected (a missing wait shows up as a number)."""
    monkeypatch.setenv("OFFLOAD_TEST_COPY_DELAY_S", "0.002")

    def check(eng):
        assert max(len(st.chunks) for st in eng.states if st is not None) > (chunk_bytes < 1 << 20)
        assert eng.staging.lent == 0  # every chunk went back to the pool

    train_sometimes_exactly(tmp_path, param, optim, "bf16", {"chunk_bytes": chunk_bytes, **extra}, steps=4,
                            check_engine=check)
