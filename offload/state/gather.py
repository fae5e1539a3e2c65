"""The stage-3 gather: a partitioned unit's weights, each chunk broadcast from the rank that owns it into
every rank's hbm copy, ahead of use on the gather thread or on use on the compute thread.

[Note: partitioned weights]
zero_stage 3 over several ranks: a fetched unit's home holds only the chunks this rank owns
(placement.weight_owners; dram: back to back, nvme: their keys), and a fetch copies those into hbm, then
each chunk is broadcast from its owner. With zero_gather_ahead (the default) the fetch queues that gather
on the gather thread (the runtime's `gather` stream) behind its own reads, so it runs ahead of the unit's
use, beside the compute of the units before it; every rank issues the same fetches in the same order,
since the prefetcher's room is one all ranks share (offload.step.prefetch). Without it the gather runs on
the compute thread when the unit is used. The time the compute thread waits on a gather (after the
unit's own shard arrived) is the collective's `exposed_s`. With offload_param none the shard stays in the
hbm tier (WeightHandle.shard_tier) and is handled as a dram home.
"""

from __future__ import annotations

import time

import torch

from offload.scheduler.streams import Completion, CopyStream
from offload.scheduler.telemetry import Telemetry
from offload.state.ranks import Ranks


class ShardGather:
    """The gather of one unit's weights into `hbm` (its whole hbm copy): chunk i, elements chunks[i] of
    the flat, comes from rank owner[i]. `stream`: the gather thread's (zero_gather_ahead), or None to
    gather on use. `name` (the unit's) names the collective when it fails."""

    def __init__(self, name: str, chunks: list[tuple[int, int]], owner: list[int], hbm: torch.Tensor,
                 ranks: Ranks, telemetry: Telemetry, stream: CopyStream | None):
        self.name, self.chunks, self.owner, self.hbm = name, chunks, owner, hbm
        self.ranks, self.telemetry, self.stream = ranks, telemetry, stream
        self.nbytes = hbm.numel() * hbm.element_size()
        self.ready_at: float | None = None  # gathered ahead: when this rank's shard was in hbm

    @property
    def ahead(self) -> bool:
        """Whether a fetch queues the gather on the gather thread (else the compute thread runs it on use)."""
        return self.stream is not None

    def submit(self, shard: Completion) -> Completion:
        """Queues the gather on the gather thread behind `shard` (the copy of this rank's chunks into hbm);
        returns the gather's completion, which the fetch keeps as its own."""
        self.ready_at = None
        return self.stream.submit(self.run_after, shard, tensors=(self.hbm,), device_work=True)

    def run_after(self, shard: Completion) -> None:
        """On the gather thread: once this rank's shard is in hbm, the gather."""
        shard.wait_on_compute()  # CUDA: the gather stream waits for the shard's copy, not the host
        self.ready_at = time.perf_counter()
        self.run(self.ranks.gather)

    def run(self, group) -> float:
        """[Note: partitioned weights] Each chunk from its owner into every rank's hbm copy (as bytes), on
        `group` (the calling thread's); returns the seconds it took."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        for (b, e), owner in zip(self.chunks, self.owner):
            self.ranks.run("all_gather (a broadcast per chunk)", self.name,
                           lambda: dist.broadcast(self.hbm[b:e].view(torch.uint8), src=owner, group=group))
        seconds = time.perf_counter() - t0
        self.telemetry.collective("all_gather", self.nbytes, seconds)
        return seconds

    def finish(self, t0: float) -> None:
        """On the compute thread, as a fetch that began waiting at `t0` ends: gathered ahead, the wait from
        when the shard was in hbm is the gather's exposed time; on use, the compute thread runs the whole
        gather now."""
        if self.ahead:
            self.telemetry.exposed("all_gather", max(0.0, time.perf_counter() - max(t0, self.ready_at)))
        else:
            self.telemetry.exposed("all_gather", self.run(self.ranks.compute))
