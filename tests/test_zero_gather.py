"""zero_stage 3's gathers run ahead of use on their own thread ([Note: partitioned weights] in
offload.state.gather), issued in one order on every rank ([Note: collective order] in offload.state.ranks), and
train to the same numbers as gathers run when each unit is used."""

import threading

import torch

from offload.scheduler.streams import CopyStream
from offload.state.gather import ShardGather
from tests.fake_cuda import FakeEvent, cuda  # noqa: F401 (cuda: the fixture)
from tests.ranks_util import CHUNK_BYTES, assert_trains_like_one_process, run_ranks, single_in_rank_order

BUDGET = 400_000  # rank 1's hbm bytes: its plan shrinks to them  # rank 1: about what its plan needs


def _gathered(events: list) -> list[str]:
    return [e[1] for e in events if e[0] == "gather"]


def _issued_ahead(events: list) -> int:
    """Fetches issued before their unit's own use began: by a prefetch for another unit."""
    ahead, using = 0, None
    for e in events:
        if e[0] == "use":
            using = e[1]
        elif e[0] == "issue" and e[1] != using:
            ahead += 1
    return ahead


def test_stage3_gathers_run_ahead_on_the_gather_thread_in_one_order_on_every_rank(tmp_path):
    """2 ranks, stage 3, weights and states on nvme, 5 blocks, 4 units prefetched, an evaluation forward
    after each step, and rank 1 with a fraction of rank 0's hbm: its placement shrinks its prefetch and
    keep knobs, so on its own it would fetch (and gather) other units than rank 0 and the ranks would
    wait on each other's gathers (it did, before the knobs and the room were agreed). Every gather runs on
    the gather thread, in the order its fetches were issued, the same on both ranks; some were issued by
    prefetches, and each step() fetched the next forward's first unit; the losses and weights equal
    gathers run on use, bit for bit, and one process's."""
    base = {"zero_stage": 3, "precision": "fp32", "offload_param": {"device": "nvme"},
            "offload_optimizer": {"device": "nvme"}, "units": {"min_numel": 512}, "optimizer": {"lr": 1e-2},
            "chunk_bytes": CHUNK_BYTES, "_trace_gathers": True, "_eval": True,
            "collective_timeout_s": 30, "prefetch_units": 4, "_model": {"n_blocks": 5},
            "_rank_cfg": {"1": {"budgets": {"hbm_bytes": BUDGET}}}}
    steps, gas = 3, 2
    ahead = run_ranks(2, {**base, "nvme_path": str(tmp_path / "a"), "gradient_accumulation_steps": gas},
                      str(tmp_path / "ahead"), steps, gas)
    on_use = run_ranks(2, {**base, "nvme_path": str(tmp_path / "u"), "gradient_accumulation_steps": gas,
                           "zero_gather_ahead": False}, str(tmp_path / "on_use"), steps, gas)
    for r in ahead:
        gathers = [e for e in r["events"] if e[0] == "gather"]
        assert gathers and {e[2] for e in gathers} == {"offload-gather"}
        assert _gathered(r["events"]) == [e[1] for e in r["events"] if e[0] == "issue"]
        assert _issued_ahead(r["events"]) > 0
        # each step() (the first recorded the trace) fetched the next forward's first unit before it began
        stepped = [i for i, e in enumerate(r["events"]) if e == ["stepped"]]
        assert len(stepped) == steps * gas
        for i in stepped[1:]:
            since_use = max(j for j in range(i) if r["events"][j][0] == "use")
            assert ["issue", "inp"] in r["events"][since_use:i], r["events"][since_use:i + 2]
        # the compute thread's waits on gathers ahead were recorded (Telemetry.exposed makes the key); their
        # size is timing (bench/zero.py)
        assert "exposed_s" in r["collectives"]["all_gather"]
    assert _gathered(ahead[0]["events"]) == _gathered(ahead[1]["events"])
    for r in on_use:
        assert {e[2] for e in r["events"] if e[0] == "gather"} == {"MainThread"}
        c = r["collectives"]["all_gather"]
        assert c["exposed_s"] == c["seconds"] > 0  # on use, the compute thread runs the whole gather
    for a, u in zip(ahead, on_use):
        assert a["losses"] == u["losses"] and a["evals"] == u["evals"] and len(a["evals"]) == steps
        # gathered ahead, the next forward's first units are fetched after each step (bytes: test_zero_volume.py)
        assert a["collectives"]["all_gather"]["bytes"] >= u["collectives"]["all_gather"]["bytes"]
    sd_ahead, sd_on_use = torch.load(str(tmp_path / "ahead.pt")), torch.load(str(tmp_path / "on_use.pt"))
    assert all(torch.equal(sd_ahead[k], sd_on_use[k]) for k in sd_ahead)
    cfg = {k: v for k, v in base.items() if not k.startswith("_") or k == "_model"}
    ref_losses, ref_sd = single_in_rank_order({**cfg, "zero_stage": 0, "nvme_path": str(tmp_path / "ref")}, steps,
                                              gas, 2)
    assert_trains_like_one_process(ahead, ref_losses, ref_sd, sd_ahead, "fp32", steps, in_rank_order=True)


def test_a_gather_ahead_waits_for_its_shard_on_the_gather_stream_and_compute_waits_for_the_gather(cuda):
    """The CUDA path, on the recording fake of the stream API: the gather job runs on its own stream, which
    waits for the shard's copy (an event on the h2d stream) and not for compute queued after the fetch was
    issued; the compute stream, in _finish_fetch, waits for the broadcast the job enqueued (an event), and
    the host does not wait for the device."""
    h2d, gather = CopyStream("h2d", torch.device("cuda")), CopyStream("gather", torch.device("cuda"))

    class Unit(ShardGather):  # the broadcasts recorded, not run
        def run(self, group):
            self.broadcast = cuda.current_stream().launch("broadcast")
            self.thread = threading.current_thread().name

    ranks = type("ranks", (), {"gather": "the gather group"})()
    unit = Unit("unit", [], [], torch.zeros(2), ranks, None, gather)
    try:
        cuda.default.launch("free/alloc: the unit's hbm copy")
        shard = h2d.copy(torch.zeros(2), torch.ones(2))  # the shard's copy up, an event on the h2d stream
        may_run = threading.Event()
        done = gather.submit(lambda s: (may_run.wait(5), unit.run_after(s)), shard,
                             device_work=True)
        cuda.default.launch("the previous unit's forward")  # queued after the fetch: the gather must not wait
        may_run.set()
        done.wait_on_compute()
        g = gather._stream
        assert unit.thread == "offload-gather" and unit.ready_at is not None
        assert g.after(h2d._stream) == len(h2d._stream.work)  # after the shard's copy
        assert g.after(cuda.default, g.work.index("broadcast")) == 1  # the allocation, not the forward
        assert cuda.default.after(g) >= g.work.index("broadcast") + 1, cuda.log  # compute after the broadcast
        assert isinstance(done._ended[0], FakeEvent)
    finally:
        gather.close()
        h2d.close()
