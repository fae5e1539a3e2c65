"""Engine behaviour beyond parity: memory budgets, the meta device, fp16, schedules, errors, cleanup."""

import os

import pytest
import torch

import offload
from offload.plan.placement import PlacementError
from offload.state.residency import R
from tests.engine_util import MLP, Reference, max_state_err, mlp_batches
from tests.unprivileged import unwritable_dir


def cfg(tmp_path, param="nvme", optim="nvme", **extra):
    return {"precision": "fp32", "offload_param": {"device": param}, "offload_optimizer": {"device": optim},
            "nvme_path": str(tmp_path / "swap"), "units": {"min_numel": 512}, **extra}


@pytest.mark.parametrize("delayed", [False, True])
def test_hbm_budget_of_two_units_holds(tmp_path, monkeypatch, delayed):
    torch.manual_seed(0)
    model = MLP(d=64, n_blocks=6)
    probe = offload.initialize(MLP(d=64, n_blocks=6), cfg(tmp_path / "probe"))
    unit_bytes = max(w.nbytes for w in probe.weights if w.home == "nvme")
    resident_bytes = sum(w.nbytes for w in probe.weights if w.home == "hbm")
    probe.close()
    grad_bytes = unit_bytes * 2  # one unit's gradients, in flight to dram
    budget = resident_bytes + 2 * unit_bytes + grad_bytes
    eng = offload.initialize(model, cfg(tmp_path, prefetch_units=1, budgets={"hbm_bytes": budget},
                                       delayed_update=delayed))
    most_fetched = 0
    original = eng.prefetcher.fetch_for_use

    def counting(unit, backward=False):
        nonlocal most_fetched
        original(unit, backward)
        fetched = sum(w.state in (R.HBM, R.DRAM_TO_HBM) and w.home == "nvme" for w in eng.weights)
        most_fetched = max(most_fetched, fetched)

    monkeypatch.setattr(eng.prefetcher, "fetch_for_use", counting)
    for x, y in mlp_batches(4):
        eng.backward(eng(x, y))
        eng.step()
    st = eng.stats()
    assert most_fetched <= 2
    assert st["tiers"]["hbm"]["peak_bytes"] <= budget
    # dram holds only the chunk pool the placement planned, never the model: 3 optimizer windows (one
    # stepped, two read ahead) x (4 fp32 states + 1 chunk of new weights); on the CPU backend a fetch reads
    # straight into hbm (on CUDA: 2 more)
    planned = eng.placement.need["dram"]
    assert planned == eng.placement.pool_chunks * eng.placement.chunk_bytes == 15 * eng.placement.chunk_bytes
    assert eng.placement.chunk_bytes < eng.cfg.chunk_bytes  # capped at the largest unit's fp32 buffer
    assert st["tiers"]["dram"]["peak_bytes"] == planned
    eng.close()


def test_meta_model_larger_than_dram_budget(tmp_path):
    n_blocks, d = 64, 128
    torch.manual_seed(7)
    cpu_model = MLP(d=d, n_blocks=n_blocks)
    fp32_bytes = sum(p.numel() * 4 for p in cpu_model.parameters())
    budget = 4 << 20
    assert fp32_bytes > 4 * budget
    ref = Reference(cpu_model, "fp32", lr=1e-3)
    with torch.device("meta"):
        meta_model = MLP(d=d, n_blocks=n_blocks)
    c = cfg(tmp_path, seed=7, prefetch_units=1, optimizer={"lr": 1e-3}, budgets={"dram_bytes": budget},
            chunk_bytes=256 << 10)  # the pool: 12 chunks of 256 KiB
    with offload.initialize(meta_model, c) as eng:
        assert not any(p.is_meta for p in meta_model.parameters())
        losses, ref_losses = [], []
        for x, y in mlp_batches(3):
            loss = eng(x, y)
            eng.backward(loss)
            eng.step()
            losses.append(loss.item())
            ref_losses.append(ref.micro_step(x, y))
            ref.step()
        st = eng.stats()
        assert st["tiers"]["dram"]["peak_bytes"] <= budget
        assert st["tiers"]["nvme"]["used_bytes"] >= 3 * fp32_bytes  # master + moments live on nvme
    assert losses[0] == ref_losses[0]  # same seed, same initial weights
    assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_fp16_overflow_skips_step_and_halves_scale(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    c = cfg(tmp_path, "cpu", "cpu", precision="fp16", loss_scale={"initial": 2.0**15})
    with offload.initialize(model, c) as eng:
        before = {k: v.clone() for k, v in eng.full_state_dict().items()}
        x, y = mlp_batches(1)[0]
        eng.backward(eng(x, y * 3e4))  # squared error ~1e9 x 2^15 overflows fp16 gradients
        assert eng.step() is False
        assert eng.loss_scale == 2.0**14 and eng.skipped_steps == 1
        after = eng.full_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)  # a skipped step touches nothing
        eng.backward(eng(x, y))
        assert eng.step() is True
        assert eng.stats()["step"] == 1


def test_fp16_trains_like_reference(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    ref = Reference(model, "fp16", lr=1e-2, kernel=True)
    c = cfg(tmp_path, "nvme", "nvme", precision="fp16", loss_scale={"initial": 1.0}, optimizer={"lr": 1e-2})
    with offload.initialize(model, c) as eng:
        for x, y in mlp_batches(3):
            loss = eng(x, y)
            eng.backward(loss)
            eng.step()
            assert loss.item() == ref.micro_step(x, y)
            ref.step()


def test_lr_schedule_warmup_then_cosine(tmp_path):
    from offload.plan.config import LRScheduleConfig
    from offload.step.scale import lr_factor

    s = LRScheduleConfig(type="cosine", warmup_steps=2, total_steps=6, min_ratio=0.1)
    f = [lr_factor(s, i) for i in range(7)]
    assert f[:2] == [0.5, 1.0] and f[2] == pytest.approx(1.0) and f[6] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[2:], f[3:]))
    c = cfg(tmp_path, "cpu", "cpu", optimizer={"lr": 0.1}, lr_schedule={"type": "linear", "warmup_steps": 1, "total_steps": 3})
    with offload.initialize(MLP(), c) as eng:
        seen = []
        for x, y in mlp_batches(3):
            seen.append(eng.lr)
            eng.backward(eng(x, y))
            eng.step()
        assert seen == pytest.approx([0.1, 0.1, 0.05])


@pytest.mark.parametrize("clip", [0.0, 1.0])  # 0: units stepped during backward (overlap_step); 1: in step()
def test_lr_set_from_outside_replaces_the_schedule(tmp_path, clip):
    """engine.lr = x (a scheduler outside the engine: Trainer's) is the lr of the next steps, schedule or not."""
    c = cfg(tmp_path, "cpu", "cpu", optimizer={"lr": 0.1}, gradient_clipping=clip,
            lr_schedule={"type": "linear", "warmup_steps": 1, "total_steps": 3})
    with offload.initialize(MLP(), c) as eng:
        before = eng.full_state_dict()
        eng.lr = 0.0
        for x, y in mlp_batches(2):
            eng.backward(eng(x, y))
            eng.step()
        assert eng.lr == 0.0 and eng.step_count == 2
        assert all(torch.equal(before[n], t) for n, t in eng.full_state_dict().items())
        with pytest.raises(ValueError, match="lr=-1: must be a finite number >= 0"):
            eng.lr = -1


def test_close_removes_swap_files_and_is_idempotent(tmp_path):
    eng = offload.initialize(MLP(), cfg(tmp_path))
    x, y = mlp_batches(1)[0]
    eng.backward(eng(x, y))
    eng.step()
    files = [f for _, _, fs in os.walk(tmp_path / "swap") for f in fs]
    assert files
    eng.close()
    eng.close()
    assert not [f for _, _, fs in os.walk(tmp_path / "swap") for f in fs]
    assert eng.stats()["tiers"]["dram"]["used_bytes"] == 0


def test_released_parameters_are_empty_not_dangling(tmp_path):
    model = MLP()
    with offload.initialize(model, cfg(tmp_path, "cpu", "cpu")):
        assert model.blocks[0].fc1.weight.numel() == 0  # offloaded: an empty placeholder
        assert model.norm.weight.shape == (64,)          # resident rest unit


# --- errors -----------------------------------------------------------------------------------------

def test_unknown_config_key_names_the_nearest():
    with pytest.raises(ValueError, match=r"offload_optimiser: unknown config key; did you mean 'offload_optimizer'"):
        offload.initialize(MLP(), {"offload_optimiser": {"device": "cpu"}})
    with pytest.raises(ValueError, match=r"optimizer.betas2: unknown config key; did you mean 'betas'"):
        offload.load_config({"optimizer": {"betas2": [0.9, 0.99]}})


def test_bad_values_say_how_to_fix():
    with pytest.raises(ValueError, match=r"precision='bf32'.*use \"bf16\""):
        offload.load_config({"precision": "bf32"})
    with pytest.raises(ValueError, match="nvme_path=None: required"):
        offload.load_config({"offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}})
    with pytest.raises(ValueError, match=r"nvme_path=\['/a', 3\]: expected a directory, or a non-empty list"):
        offload.load_config({"nvme_path": ["/a", 3]})


def test_byte_keys_take_size_strings(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("budgets: {hbm_bytes: 2.5G, dram_bytes: 8GiB}\nchunk_bytes: 16M\naio: {block_bytes: 1M}\n")
    cfg = offload.load_config(path)
    assert (cfg.budgets.hbm_bytes, cfg.budgets.dram_bytes) == (int(2.5 * 2**30), 8 << 30)
    assert (cfg.chunk_bytes, cfg.aio.block_bytes) == (16 << 20, 1 << 20)
    with pytest.raises(ValueError, match=r"^budgets.dram_bytes='8 gigs': not a size; write a byte count or a size "
                                         r"such as \"2.5G\""):
        offload.load_config({"budgets": {"dram_bytes": "8 gigs"}})
    with pytest.raises(ValueError, match=r"^zero_stage='two': expected int; write it as an int$"):
        offload.load_config({"zero_stage": "two"})  # a key that is not a size takes no size string


def test_several_swap_directories_take_turns_by_local_rank(monkeypatch):
    cfg = offload.load_config({"nvme_path": ["/d0", "/d1", "/d2"]})
    assert [cfg.swap_dir(r) for r in range(4)] == ["/d0", "/d1", "/d2", "/d0"]
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun: the node's rank, whatever the global one
    assert cfg.swap_dir(7) == "/d1"
    assert offload.load_config({"nvme_path": "/one"}).swap_dir(3) == "/one"
    parser = offload.add_arguments(__import__("argparse").ArgumentParser())
    assert offload.config_from_args(parser.parse_args(["--nvme-path", "/d0,/d1"])).nvme_path == ["/d0", "/d1"]


def test_unwritable_nvme_path(tmp_path):
    with unwritable_dir(tmp_path) as ro:  # as root (CI): a directory that refuses root too
        with pytest.raises(OSError, match=str(ro / "swap")):
            offload.initialize(MLP(), cfg(tmp_path, nvme_path=str(ro / "swap")))


def test_nvme_path_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OSError):
        offload.initialize(MLP(), {**cfg(tmp_path), "nvme_path": str(f / "swap")})


def test_budgets_too_small_fail_before_training(tmp_path):
    with pytest.raises(PlacementError, match=r"hbm needs \d+ bytes .* budget"):
        offload.initialize(MLP(), cfg(tmp_path, "none", "none", budgets={"hbm_bytes": 4096}))
    with pytest.raises(PlacementError, match="dram needs"):
        offload.initialize(MLP(), cfg(tmp_path, "cpu", "cpu", budgets={"dram_bytes": 4096}))


def test_model_without_parameters():
    with pytest.raises(ValueError, match="model: has no parameters"):
        offload.initialize(torch.nn.ReLU())


def test_a_model_an_engine_took_over_is_refused_but_a_failed_start_leaves_it_usable(tmp_path):
    """A second initialize of the same module (after close()) met its placeholders in the forward ("mat2
    must be a matrix, got 1-D tensor"); now it is refused by name. A start that failed before the
    parameters moved (budgets too small) leaves the model as it was, so trying again works."""
    model = MLP()
    with pytest.raises(PlacementError):
        offload.initialize(model, cfg(tmp_path, "cpu", "cpu", budgets={"dram_bytes": 4096}))
    sd = None
    with offload.initialize(model, cfg(tmp_path, "cpu", "cpu")) as eng:
        sd = eng.state_dict()
    with pytest.raises(ValueError, match=r"already wrapped by an offload engine .* load_state_dict\(sd\)"):
        offload.initialize(model, cfg(tmp_path, "cpu", "cpu"))
    with offload.initialize(MLP(), cfg(tmp_path, "cpu", "cpu")) as eng:
        eng.load_state_dict(sd)
        assert all(torch.equal(v, sd[k]) for k, v in eng.state_dict().items())


def test_step_before_backward(tmp_path):
    with offload.initialize(MLP(), cfg(tmp_path, "cpu", "cpu")) as eng:
        with pytest.raises(RuntimeError, match=r"step\(\) called before backward\(\)"):
            eng.step()


def test_batch_on_the_wrong_device(tmp_path):
    with offload.initialize(MLP(), cfg(tmp_path, "cpu", "cpu")) as eng:
        x = torch.empty(8, 16, device="meta")
        with pytest.raises(ValueError, match=r"batch tensor on meta.*\.to\(engine.device\)"):
            eng(x, x)


def test_weights_source_fills_a_meta_model(tmp_path):
    torch.manual_seed(3)
    cpu_model = MLP()
    values = {n: p.detach().clone() for n, p in cpu_model.named_parameters()}
    with torch.device("meta"):
        meta_model = MLP()
    with offload.initialize(meta_model, cfg(tmp_path), weights=values.__getitem__) as eng:
        sd = eng.full_state_dict()
    assert all(torch.equal(sd[n], values[n]) for n in values)
    with pytest.raises(ValueError, match=r"weights\['inp.weight'\]: shape \(2, 2\)"):
        with torch.device("meta"):
            m = MLP()
        offload.initialize(m, cfg(tmp_path), weights=lambda n: torch.zeros(2, 2))


@pytest.mark.parametrize("param", ["nvme", "cpu"])
def test_trace_has_every_track_and_agrees_with_stall_seconds(tmp_path, param):
    import json

    torch.manual_seed(0)
    with offload.initialize(MLP(), cfg(tmp_path, param, prefetch_units=0)) as eng:
        eng.start_trace()
        for x, y in mlp_batches(2):
            eng.backward(eng(x, y))
            eng.step()
        eng.save_trace(str(tmp_path / "trace.json"))
        st = eng.stats()
    trace = json.loads((tmp_path / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    tracks = {e["cat"] for e in spans}
    # on the CPU backend an nvme fetch reads straight into hbm: the h2d copy stream moves dram homes only
    assert {"compute", "d2h", "nvme", "cpu_adam"} | ({"h2d"} if param == "cpu" else set()) <= tracks
    stall_us = sum(e["dur"] for e in spans if e["name"].startswith("stall"))
    assert stall_us / 1e6 == pytest.approx(st["stall_seconds"], rel=1e-6)
    assert st["stall_seconds"] > 0  # on-demand fetches: compute waited
    assert 0.0 <= st["overlap_fraction"] <= 1.0


def test_ignored_loss_scale_warns(tmp_path, caplog):
    import logging

    caplog.set_level(logging.WARNING, logger="offload")
    with offload.initialize(MLP(), cfg(tmp_path, "cpu", "cpu", precision="bf16", loss_scale={"initial": 8.0})):
        pass
    assert any("loss_scale is ignored with precision=bf16" in r.getMessage() for r in caplog.records)


def test_fp16_with_delayed_update(tmp_path):
    """fp16 pipelines under delayed_update (overlap_step cannot: it needs the overflow check first):
    same numbers as the reference with the same semantics; an overflowing step is skipped whole, after
    the previous step's update landed during its backward."""
    torch.manual_seed(0)
    model = MLP()
    ref = Reference(model, "fp16", lr=1e-2, kernel=True, delayed=True)
    c = cfg(tmp_path, "nvme", "nvme", precision="fp16", loss_scale={"initial": 1.0}, optimizer={"lr": 1e-2},
            delayed_update=True)
    with offload.initialize(model, c) as eng:
        batches = mlp_batches(3)
        for x, y in batches:
            loss = eng(x, y)
            eng.backward(loss)
            assert eng.step() is True
            assert loss.item() == ref.micro_step(x, y)
            ref.step()
        eng.flush()
        ref.flush()
        assert max_state_err(eng.full_state_dict(), ref.state()) == 0.0
        x, y = batches[0]
        eng.backward(eng(x, y))
        assert eng.step() is True                 # its update is pending
        before = eng.full_state_dict()
        eng.backward(eng(x, y * 3e4))             # the pending update lands; these gradients overflow
        after = eng.full_state_dict()
        assert max_state_err(after, before) > 0
        assert eng.step() is False and eng.skipped_steps == 1
        eng.flush()                               # nothing pending: the overflowing step was skipped
        assert max_state_err(eng.full_state_dict(), after) == 0.0


@pytest.mark.parametrize("param", ["cpu", "nvme"])
@pytest.mark.parametrize("clip", [0.0, 1.0])  # overlap_step (the step on the d2h thread), and after backward
def test_corrupted_optimizer_state_raises_and_keeps_what_was_written(tmp_path, param, clip):
    """Optimizer states on nvme are verified by the step that hashes them ([Note: swap digests in the
    step]): a flipped byte raises SwapCorruptionError, and that unit's weights and swap entries stay as
    they were (nothing computed from the bad bytes is kept)."""
    from offload.step.windows import WindowCheck
    from offload.swap import SwapCorruptionError

    model = MLP()
    eng = offload.initialize(model, cfg(tmp_path, param, "nvme", precision="bf16", gradient_clipping=clip,
                                        aio={"block_bytes": 8192}))
    (x, y), batch2 = mlp_batches(2)
    eng.backward(eng(x, y))
    eng.step()
    unit = next(u for u in eng.units if u.name == "blocks.1")
    st, w = eng.states[unit.index], eng.weights[unit.index]
    assert len(WindowCheck(st, 0).bounds) > 3  # several 8 KiB blocks: the step's per-block digests are exercised
    key = st.key("exp_avg_sq", 0)
    entry = eng.store._index[key]
    with open(eng.store.fd_path, "r+b") as f:  # flip one byte in the middle of its third block
        f.seek(entry.offset + 2 * 8192 + 100)
        b = f.read(1)
        f.seek(entry.offset + 2 * 8192 + 100)
        f.write(bytes([b[0] ^ 0x10]))
    def entries():  # the unit's states and weights (its gradient accumulator is this step's to write)
        return {k: v for k, v in eng.store._index.items() if k.startswith(unit.name + "/") and "/grad" not in k}

    before = entries()
    weights = w.dram.clone() if param == "cpu" else None
    with pytest.raises(SwapCorruptionError, match="exp_avg_sq") as e:
        eng.backward(eng(*batch2))
        eng.step()
    assert e.value.offset == entry.offset + 2 * 8192
    assert entries() == before and len(before) == 3 + (param == "nvme")
    assert eng.staging.lent == 0  # the failed window, its read-ahead and write-behind returned their chunks
    if weights is not None:
        assert torch.equal(w.dram, weights)
    eng.close()


@pytest.mark.parametrize("param", ["nvme", "cpu"])
def test_kept_weights_take_the_same_pooled_buffers_every_step(tmp_path, monkeypatch, param):
    """[Note: reused host memory for hbm] A model whose blocks all stay in hbm from forward to backward
    (reuse_bytes covers them) gives their buffers back during the backward; they stay cached across the
    step, so the next forward's fetches take them again: once warm the pool maps no memory."""
    from offload.swap import buffers

    mapped = []
    monkeypatch.setattr(buffers, "aligned_empty", lambda *a, original=buffers.aligned_empty, **k:
                        mapped.append(a[0]) or original(*a, **k))
    torch.manual_seed(0)
    model = MLP(d=64, n_blocks=6)
    with offload.initialize(model, cfg(tmp_path, param, prefetch_units=1, reuse_bytes=1 << 30)) as eng:
        blocks = [w for w in eng.weights if w.nbytes in eng.placement.shared_sizes]
        assert len(blocks) == 6 and eng.placement.reuse_bytes >= sum(w.nbytes for w in blocks)
        per_step = []
        for x, y in mlp_batches(4):
            mapped.clear()
            eng.backward(eng(x, y))
            eng.step()
            per_step.append(len(mapped))
        assert sum(per_step[:2]) >= len(blocks) and per_step[2:] == [0, 0], per_step  # warm after two


@pytest.mark.parametrize("param", ["nvme", "cpu"])
def test_fetched_copies_reuse_pooled_host_memory(tmp_path, monkeypatch, param):
    """[Note: reused host memory for hbm] On the CPU backend each fetch's hbm copy of a block (a size several
    units share) is a reused, aligned pool buffer under the unit's own storage (nvme reads land in it
    directly); the pool holds at most the planned peak of those; a torch without storage swaps resizes as
    before, to the same numbers."""
    import torch

    from offload.state import tiers

    runs = {}
    for swap in (True, False):
        monkeypatch.setattr(tiers, "STORAGE_SWAP", swap)
        torch.manual_seed(0)
        with offload.initialize(MLP(), cfg(tmp_path / str(swap), param, prefetch_units=0)) as eng:
            pool = eng.rt.tiers.hbm_pool
            assert (pool is not None) == swap
            seen = []
            fetched = [w for u, w in zip(eng.units, eng.weights) if not u.persistent]
            w = next(w for w in fetched if w.nbytes in eng.placement.shared_sizes)  # a block: its size recurs
            alone = [w for w in fetched if w.nbytes not in eng.placement.shared_sizes]  # the input layer
            for x, y in mlp_batches(3):
                eng.backward(eng(x, y))
                eng.step()
                if swap:  # what waits cached between steps is bounded
                    assert pool._cached_bytes <= max(2 * max(eng.placement.shared_sizes), eng.placement.reuse_bytes)
                for _ in range(2):
                    w.fetch()
                    w.wait_for_fetch()
                    seen.append(w.hbm.data_ptr())
                    w.release()
            if swap:
                assert all(p % 4096 == 0 for p in seen)
                assert all(a == b for a, b in zip(seen[::2], seen[1::2]))  # the buffer just given back, again
                assert alone and eng.placement.shared_sizes
                staged = []  # per nvme read: did it go through a staging buffer (an unaligned destination)?
                from offload.swap import store as swap_store

                def destination(into, nbytes, original=swap_store._destination):
                    dst, was_staged = original(into, nbytes)
                    staged.append(was_staged)
                    return dst, was_staged

                monkeypatch.setattr(swap_store, "_destination", destination)
                alone[0].fetch()
                alone[0].wait_for_fetch()
                buf, faulted = alone[0]._lent  # a size no other unit has: fresh memory, not held between uses,
                assert faulted is not None and alone[0].hbm.data_ptr() % 4096 == 0  # but aligned: reads land in it
                assert not any(staged) and bool(staged) == (param == "nvme")
                alone[0].release()
                assert alone[0]._lent is None and alone[0].hbm.untyped_storage().nbytes() == 0
                assert 0 < pool.peak_bytes <= eng.placement.fetched_peak + 4096 * len(eng.units)
                assert pool.used_bytes == 0 and w.hbm.untyped_storage().nbytes() == 0  # all given back
            runs[swap] = eng.full_state_dict()
    assert all(torch.equal(runs[True][k], runs[False][k]) for k in runs[True])


def test_units_of_two_near_sizes_keep_taking_pooled_memory():
    """[Note: reused host memory for hbm] bench-200m's first and last units are a decoder layer plus the
    embedding or the head: a size two units share, a little above the layers'. A layer's fetch that takes one
    of their cached buffers (SLACK_RATIO) holds more than the plan counts for it; without headroom for that the
    pool refused the third unit in flight, which then mapped fresh memory (faulted in at kernel speed) on
    every generated token: a third of the reads of a batch-1 decode."""
    import torch

    from offload.state import tiers

    if not tiers.STORAGE_SWAP:
        pytest.skip("this torch lacks UntypedStorage._swap_data_ptr_: hbm storages are resized")
    layer, edge = 50 * 4096, 52 * 4096
    t = tiers.Tiers(torch.device("cpu"), 1 << 30, 1 << 30, 1 << 30, pin=False, hbm_pool_bytes=3 * layer,
                    hbm_pool_sizes=frozenset({layer, edge}))
    sizes = [edge, layer, layer, layer, edge]  # a forward's units, in order; the next forward follows
    fresh, in_flight = [], []
    for k in range(4 * len(sizes)):  # four forwards, three units in flight (the one in use and two ahead)
        h = torch.empty(0, dtype=torch.uint8)
        lent = t.give_hbm_memory(h, sizes[k % len(sizes)])
        fresh.append(lent[1] is not None)
        in_flight.append((h, lent))
        if len(in_flight) == 3:
            t.take_hbm_memory(*in_flight.pop(0))
    assert not any(fresh[2 * len(sizes):]), fresh  # warm after two forwards
    t.close()


def test_fresh_hbm_memory_faults_in_while_the_reader_is_busy(tmp_path):
    """[Note: reused host memory for hbm] A fetch's fresh hbm copy (a size the pool does not serve) starts
    faulting in when the fetch is issued, on a thread of its own: not behind the reader thread's earlier jobs
    (the 3b preset's tied head waited there behind the last deferred step, the drive idle). The fetch's
    reads still wait for it, and land the unit's weights."""
    import threading

    from tests.memory_util import resident_pages

    with offload.initialize(MLP(), cfg(tmp_path, "nvme", prefetch_units=0)) as eng:
        if not eng.rt.tiers.reusable:
            pytest.skip("this torch lacks UntypedStorage._swap_data_ptr_: hbm storages are resized")
        fetched = [w for u, w in zip(eng.units, eng.weights) if not u.persistent]
        alone = next(w for w in fetched if w.nbytes not in eng.placement.shared_sizes)
        home = eng.full_state_dict()
        gate = threading.Event()
        busy = eng.rt.reader.submit(gate.wait, 30)  # the reader thread is held, as by a deferred step
        try:
            alone.fetch()
            buf, faulted = alone._lent
            assert faulted is not None  # fresh memory, not a pool buffer
            faulted.wait(10)  # faulted in while the reader is still held
            assert not busy.done() and alone.state is R.NVME_TO_HBM
            resident, pages = resident_pages(alone.hbm)
            assert resident == pages
        finally:
            gate.set()
        alone.wait_for_fetch()
        for s in alone.unit.slots:
            assert torch.equal(s.param.data, home[s.name].to(s.param.dtype))
        alone.release()
        assert alone._lent is None


@pytest.mark.parametrize("tied", [True, False])
def test_embedding_backward_fetches_no_weights(tmp_path, monkeypatch, tied):
    """[Note: backward without weights] in offload.step.hooks: the embedding lookup's backward is not preceded by
    a fetch of its unit (the tied head's backward still is), and training gives the same numbers as with
    every backward fetched (a torch that cannot count references)."""
    from tests.engine_util import LlamaLoss, llama, llama_batches

    def run(path, count_refs: bool):
        if not count_refs:
            monkeypatch.setattr("offload.state.residency.WeightHandle.refs", lambda self: None)
        eng = offload.initialize(LlamaLoss(llama(tied=tied)), cfg(path, units={"min_numel": 512}, reuse_bytes=0))
        embed = next(u.index for u in eng.units if isinstance(u.module, torch.nn.Embedding))
        fetches = []
        original = eng.prefetcher.fetch_for_use
        monkeypatch.setattr(eng.prefetcher, "fetch_for_use", lambda unit, backward=False: (
            fetches.append((unit.index, backward)), original(unit, backward))[-1])
        losses = []
        for ids, labels in llama_batches(3):
            loss = eng(ids, labels)
            eng.backward(loss)
            eng.step()
            losses.append(loss.item())
        sd = {k: v.clone() for k, v in eng.full_state_dict().items()}
        eng.close()
        monkeypatch.undo()
        return losses, sd, fetches.count((embed, True))

    losses, sd, backward_fetches = run(tmp_path / "a", True)
    ref_losses, ref_sd, ref_fetches = run(tmp_path / "b", False)
    assert losses == ref_losses and all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)
    assert ref_fetches == (2 if tied else 1) * 3  # every use's backward fetched
    assert backward_fetches == (1 if tied else 0) * 3  # the head's only


def test_a_unit_is_fetched_before_its_prefetches(tmp_path, monkeypatch):
    """The unit about to run is fetched first, the units fetched ahead after it (their reads queue behind)."""
    from offload.state.residency import WeightHandle

    eng = offload.initialize(MLP(d=64, n_blocks=4), cfg(tmp_path, prefetch_units=2))
    batches = mlp_batches(2)
    eng.backward(eng(*batches[0]))  # the first step records the trace the prefetches follow
    eng.step()
    order = []
    original = WeightHandle.fetch
    monkeypatch.setattr(WeightHandle, "fetch", lambda self: (
        order.append(self.unit.index) if self.state in (R.NVME, R.DRAM) else None, original(self))[-1])
    first = []
    monkeypatch.setattr(eng.prefetcher, "fetch_for_use", lambda unit, backward=False, f=eng.prefetcher.fetch_for_use: (
        first.append(unit.index) if not first else None, f(unit, backward))[-1])
    eng.backward(eng(*batches[1]))
    eng.step()
    eng.close()
    assert order[0] == first[0] and len(set(order[:3])) == 3  # the unit, then two fetched ahead of it


def test_optimizer_reads_windows_ahead(tmp_path, monkeypatch):
    """The window pipeline (offload.step.windows) steps a window with OPTIMIZER_READ_AHEAD windows loaded ahead of
    it (nvme states), never more: the pool's optimizer share."""
    import offload.step.windows as step_mod
    from offload.plan.memory import OPTIMIZER_READ_AHEAD

    eng = offload.initialize(MLP(d=64, n_blocks=3), cfg(tmp_path, chunk_bytes=8192))
    loaded = []
    original = step_mod.step_window

    def counting(rt, state, w, unit, i, **kw):
        loaded.append(sum(st.loaded(j) for st in eng.states if st is not None for j in range(len(st.chunks))))
        return original(rt, state, w, unit, i, **kw)

    monkeypatch.setattr(step_mod, "step_window", counting)
    x, y = mlp_batches(1)[0]
    eng.backward(eng(x, y))
    eng.step()
    eng.close()
    assert len(loaded) > 2 * (1 + OPTIMIZER_READ_AHEAD) and max(loaded) == 1 + OPTIMIZER_READ_AHEAD
