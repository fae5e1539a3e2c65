"""The gradients' reduce-scatter at zero_stage 1-3 ([Note: gradient reduce-scatter] in offload.step.accumulator) and the
bytes each stage moves per step, against the ZeRO paper's volumes, by the collective counters (exact). Run
as a script this file is one rank of those runs (RANK / WORLD_SIZE / MASTER_* set by the test)."""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offload.plan.chunks import rounds, window_owners  # noqa: E402

CHUNK_BYTES = 8192  # 2048 elements a window: the MLP's units have 1 to 17 windows, so rounds of 1 and 2


def test_rounds_deal_every_window_once_with_distinct_owners():
    """window_owners deals a unit's windows in turn, so its rounds are full (`world` windows, one per rank)
    but the last, which holds count % world; every rank still holds its share within one window."""
    for world in (2, 3, 4, 8):
        counts = [1, 17, 4, 5, 2, 8, 3, 1, 1, 9]
        owned = window_owners(counts, world)
        for count, owners in zip(counts, owned):
            rs = rounds(owners, world)
            assert [i for r in rs for i in r] == list(range(count))
            assert [len(r) for r in rs] == [world] * (count // world) + ([count % world] if count % world else [])
            assert all(len({owners[i] for i in r}) == len(r) for r in rs)
        held = [sum(o.count(r) for o in owned) for r in range(world)]
        assert max(held) - min(held) <= 1
    assert rounds([0, 1, 1, 0, 1], 2) == [[0, 1], [2, 3], [4]]  # any map: a round ends where an owner repeats


def run_ranks(world: int, cfg: dict, out: str, steps: int, gas: int, scatter: bool) -> list[dict]:
    """`world` ranks of this file's main(), each training its slice of the MLP's batches; their reports."""
    from tests.ranks_util import run_ranks as launch

    return launch(world, cfg, out, steps, gas, script=os.path.abspath(__file__), extra=(str(int(scatter)),))


def _cfg(tmp_path, stage: int, place: str, precision: str) -> dict:
    cfg = {"zero_stage": stage, "precision": precision, "offload_param": {"device": place},
           "offload_optimizer": {"device": place}, "nvme_path": str(tmp_path / "swap"), "units": {"min_numel": 512},
           "optimizer": {"lr": 1e-2}, "chunk_bytes": CHUNK_BYTES, "gradient_clipping": 0.5}
    if stage == 3:  # every unit released after each use: gathered for forward and again for backward
        cfg.update(reuse_distance=-1, reuse_bytes=0)
    return cfg


@pytest.mark.parametrize("stage,place,precision,gas", [
    (1, "none", "fp32", 1), (2, "nvme", "fp32", 2), pytest.param(2, "cpu", "bf16", 1, marks=pytest.mark.slow),
    pytest.param(3, "cpu", "fp32", 1, marks=pytest.mark.slow),
    (3, "nvme", "bf16", 2)])
def test_each_stage_moves_the_papers_volume_and_both_reduce_paths_train_alike(tmp_path, stage, place, precision,
                                                                            gas):
    """2 ranks. Stages 1-2: each gradient reduce-scattered once per micro-step (fp32: 4 B x trainable), each
    new weight broadcast once per step: 2P per step with one micro-step, P the model's bytes (as DDP's
    all-reduce). Stage 3 adds the gathers, each unit whole for forward and again for backward, and broadcasts
    only the persistent units' new weights: 3P. Counted in gradient bytes, never the rounds' padding (the
    MLP's odd window counts pad a round). The per-window reduce (forced) moves the same bytes under "reduce"
    and trains to the same weights bit for bit (two ranks: one fp32 addition either way)."""
    cfg, steps = {**_cfg(tmp_path, stage, place, precision), "gradient_accumulation_steps": gas}, 3
    runs = {scatter: run_ranks(2, {**cfg, "nvme_path": str(tmp_path / f"swap{scatter}")}, str(tmp_path / f"o{scatter}"),
                               steps, gas, scatter) for scatter in (True, False)}
    itemsize = 4 if precision == "fp32" else 2
    for scatter, ranks in runs.items():
        gradients, other = ("reduce_scatter", "reduce") if scatter else ("reduce", "reduce_scatter")
        for r in ranks:
            c, trainable = r["collectives"], r["trainable"]
            assert r["reduce_scatter_agreed"] == scatter and r["padded_rounds"] > 0
            assert c[gradients]["bytes"] == 4 * trainable * steps * gas and other not in c
            assert c[gradients]["calls"] == (r["collectives_scatter"] if scatter else r["windows"]) * steps * gas
            shared = trainable - r["partitioned_trainable"]  # stage 3: only the persistent units' weights
            assert c.get("broadcast", {"bytes": 0})["bytes"] == itemsize * shared * steps
            assert c["all_reduce"]["bytes"] == 8 * steps  # the squared norm
            gathered = itemsize * r["partitioned"]
            assert (gathered > 0) == (stage == 3)
            if stage == 3:
                # and the next forward's first units, gathered after the last step (tests/zero_worker.py)
                assert r["ahead_bytes"] > 0
                assert c["all_gather"]["bytes"] == 2 * gathered * steps * gas + r["ahead_bytes"]
            if gas == 1 and precision == "fp32":  # the paper's volumes per step, P = 4 B x parameters
                # (stage 3: a persistent unit is broadcast once a step, not gathered twice: 1 P of it, not 2)
                moved = (sum(c[k]["bytes"] for k in (gradients, "broadcast", "all_gather") if k in c)
                         - r["ahead_bytes"]) / steps
                assert r["params"] == trainable and r["partitioned"] == (trainable - r["persistent"]) * (stage == 3)
                assert moved == (2 if stage < 3 else 3) * 4 * trainable - 4 * r["persistent"] * (stage == 3)
    assert [r["losses"] for r in runs[True]] == [r["losses"] for r in runs[False]]
    sd, ref = torch.load(str(tmp_path / "oTrue.pt")), torch.load(str(tmp_path / "oFalse.pt"))
    assert all(torch.equal(sd[k], ref[k]) for k in ref)


def test_four_ranks_reduce_scatter_full_rounds_and_reduce_short_ones(tmp_path):
    """4 ranks, stage 2: a unit's rounds of 3 or 4 windows are reduce-scattered; a last round of 1 or 2
    windows (which would send 3 pieces a rank against its 1-2 windows) keeps the per-window reduce. Together
    4 B per trainable parameter per micro-step, split exactly by that rule."""
    cfg, steps = _cfg(tmp_path, 2, "cpu", "fp32"), 2
    for r in run_ranks(4, cfg, str(tmp_path / "o"), steps, 1, True):
        c = r["collectives"]
        assert r["reduce_scatter_agreed"]
        assert c["reduce_scatter"]["bytes"] == 4 * r["numel_scatter"] * steps
        assert c["reduce"]["bytes"] == 4 * (r["trainable"] - r["numel_scatter"]) * steps > 0


def main() -> None:
    """One rank: trains the MLP on its slice of each global batch, writes what it saw to <out>.rank<r>.json."""
    import datetime

    import torch.distributed as dist

    import offload
    import offload.step.accumulator
    from tests.engine_util import MLP, mlp_batches
    from tests.zero_worker import settled_stats

    cfg, out, steps, gas = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    offload.step.accumulator.USE_REDUCE_SCATTER = sys.argv[5] == "1"
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg["nvme_path"] = os.path.join(cfg["nvme_path"], f"rank{rank}")
    torch.manual_seed(0)
    losses = []
    try:
        with offload.initialize(MLP(), cfg) as eng:
            for x, y in mlp_batches(steps * gas):
                n = x.shape[0] // world
                loss = eng(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
                eng.backward(loss)
                eng.step()
                losses.append(loss.item())
            ahead_bytes, stats = settled_stats(eng)
            report = {"losses": losses, "collectives": stats["collectives"], "ahead_bytes": ahead_bytes,
                      "reduce_scatter_agreed": offload.step.accumulator._AGREED.get(eng.rt.ranks.grad),
                      "params": sum(u.numel for u in eng.units), "trainable": sum(u.trainable_numel for u in eng.units),
                      "partitioned": sum(w.unit.numel for w in eng.weights if w.partitioned),
                      "partitioned_trainable": sum(w.unit.trainable_numel for w in eng.weights if w.partitioned),
                      "persistent": sum(u.numel for u in eng.units if u.persistent), **_rounds_of(eng, world)}
            sd = eng.full_state_dict()
            if rank == 0:
                torch.save(sd, out + ".pt")
        with open(f"{out}.rank{rank}.json", "w") as f:
            json.dump(report, f)
    finally:
        dist.destroy_process_group()


def _rounds_of(eng, world: int) -> dict:
    """The model's windows and rounds, stated apart from the engine's choice: a round is reduce-scattered when
    it holds world - 1 windows or more, one collective per chunk_numel // world elements of its longest."""
    out = {"windows": 0, "collectives_scatter": 0, "numel_scatter": 0, "padded_rounds": 0}
    step = eng.rt.chunk_numel // world
    for st in eng.states:
        if st is None:
            continue
        out["windows"] += len(st.chunks)
        for r in rounds(st.owner, world):
            sizes = [st.chunks[i][1] - st.chunks[i][0] for i in r]
            out["padded_rounds"] += len(r) < world or min(sizes) < max(sizes)
            if len(r) >= world - 1:
                out["collectives_scatter"] += -(-max(sizes) // step)
                out["numel_scatter"] += sum(sizes)
    return out


if __name__ == "__main__":
    main()
