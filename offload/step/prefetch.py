"""The prefetcher: the residency policy's decisions (scheduler/policy.py) carried out on the weight handles.

The module hooks (offload.step.hooks) call it around every use of a unit: `fetch_for_use` before the use starts
the unit's own fetch, then the fetches the policy wants ahead of it, and waits for the unit;
`release_after_use` drops the hbm copy when the policy says it is not kept; `release_all` drops every
fetched copy (before homes are updated outside a backward, and after a failure). With partitioned weights
(zero_stage 3) a fetch ends in a gather, so every rank must fetch, keep and release alike ([Note:
collective order] in offload.state.ranks): the policy's knobs are agreed over the ranks once (`agreed_policy`),
and with the gathers run ahead (zero_gather_ahead) so is the room the policy is asked with: the hbm
bytes every rank has free once the engine is built, less the bytes of the units the policy holds.
That room leaves the gradients' reserve free, as the free bytes do; a prefetch that finds gradients still
in it waits for their jobs (`make_room`) rather than fetching less than the other ranks.
"""

from __future__ import annotations

from torch.profiler import record_function

from offload.plan.units import Unit
from offload.scheduler.policy import ResidencyPolicy
from offload.state.residency import R


class Prefetcher:
    """weights: the units' handles; policy: the residency policy; make_room(nbytes): waits for gradient
    jobs until nbytes fit hbm (offload.step.gradients); before_fetch(): work owed before any fetch (a split
    step's deferred units, [Note: split step] in offload.step.pipeline); in_backward(): whether a backward runs."""

    def __init__(self, weights: list, policy: ResidencyPolicy, hbm, make_room, before_fetch, in_backward,
                 room: int | None = None):
        self.weights, self.policy, self.hbm = weights, policy, hbm
        self.make_room, self.before_fetch, self.in_backward = make_room, before_fetch, in_backward
        self.room = room  # agreed_policy's: the policy's room is this less what it holds; None: the bytes free now
        self.carried: dict[int, int] = {}  # units a generate() left fetched for the next one -> their bytes

    def fetch_for_use(self, unit: Unit, backward: bool = False) -> None:
        """Before `unit` runs: its own fetch first, the prefetches after it, then waits for it."""
        with record_function("offload::fetch"):
            self.before_fetch()
            w = self.weights[unit.index]
            if w.state in (R.NVME, R.DRAM):
                self.make_room(w.nbytes)  # on demand: earlier gradients leave hbm first
            # This unit's own reads first: fetches run in turn on the reader thread and the drive serves urgent
            # reads in the order they came ([Note: urgent blocks] in swap/backends.py), so a unit fetched after
            # its prefetches would wait for their reads.
            if w.update is None:  # a deferred step's unit waits for its step on the reader thread: not before others
                w.fetch()
            for nxt in self.policy.before_use(unit.index, self._room(unit), backward):
                if self.room is not None:
                    self.make_room(self.weights[nxt].nbytes)
                self.weights[nxt].fetch()
            for other in self.weights:
                other.advance()
            w.wait_for_fetch()

    def ahead_of_step(self) -> None:
        """After a step (the homes updated): with partitioned weights gathered ahead, the next forward's first
        units are fetched and gathered now, so that forward does not begin by waiting for them. Only with the
        agreed room: every rank issues the same fetches here, as the next forward does."""
        if self.room is None:
            return
        for nxt in self.policy.before_step(self.room - sum(self.policy.nbytes[u] for u in self.policy.resident)):
            self.make_room(self.weights[nxt].nbytes)
            self.weights[nxt].fetch()

    def _room(self, unit: Unit) -> int:
        if self.room is None:
            return self.hbm.budget_bytes - self.hbm.used_bytes
        held = self.policy.resident | {unit.index}
        return self.room - sum(self.policy.nbytes[u] for u in held)

    def release_after_use(self, unit: Unit, backward: bool) -> None:
        # a forward recomputed inside backward (activation checkpointing): its backward comes right after
        if self.policy.after_use(unit.index, recompute=self.in_backward() and not backward):
            with record_function("offload::release"):
                self.weights[unit.index].release()

    def release_carried(self) -> None:
        """Before a training or eval forward: a generate()'s units are released ([Note: generation]); the
        forward's room is its own."""
        if self.carried:
            self.release_all()

    def release_all(self, carry: dict[int, int] | None = None) -> None:
        """Drops every fetched copy, kept ones too: before homes are updated outside a backward (a step
        after it, flush()), since a forward without backward (eval under no_grad) or a generate() may have
        kept units; and after a failure, when fetches in flight are settled and dropped (WeightHandle.reset).
        carry: {unit: bytes} left fetched for the next generate() ([Note: generation] in
        offload.step.generation), the units `carried` until the next call of this."""
        carry = carry or {}
        for w in self.weights:
            if w is not None and w.unit.index not in carry:
                w.reset()
        self.policy.release_all()  # the buffers they give back stay cached for the next step's fetches
        self.carried = carry


def agreed_policy(placement, hbm, ahead: bool, agree) -> tuple[int, int, int, int, int | None]:
    """(lookahead, reuse_distance, reuse_bytes, grad_reserve, room) of the residency policy. With
    partitioned weights (zero_stage 3) the same on every rank: the placement may shrink each knob to each
    rank's own budgets, and a unit fetched or kept on one rank and not on another would be gathered by one
    and not the other ([Note: partitioned weights] in offload.state.gather); so the smallest of each over the
    ranks, the largest reserve, and with the gathers run ahead the room (module note: the hbm bytes free now,
    the engine built and nothing fetched). Otherwise each rank's own, and room None (its free bytes).
    agree: Ranks.agree."""
    k = placement.knobs
    ours = [k.prefetch_units, k.reuse_distance, placement.reuse_bytes, -placement.grad_reserve,
            hbm.budget_bytes - hbm.used_bytes]
    if not placement.weight_owners:
        return (*ours[:3], -ours[3], None)
    agreed = [int(v) for v in agree([float(v) for v in ours], "min", "all_reduce: the residency policy's knobs")]
    return (*agreed[:3], -agreed[3], agreed[4] if ahead else None)
