"""Residency policy: what to fetch ahead, what to keep after a use, what to release.

Decisions over unit ids and byte sizes only, no tensors, so the policy is tested alone
(tests/test_policy.py). The engine reports each use of a unit and applies the answers to the weight
handles; the policy keeps its own account of which units' weights it holds in hbm.

- Before a unit runs (`before_use`): the trace's next units are fetched ahead, in order, each only if its
  bytes fit the hbm room left with the gradients' reserve kept free; a unit fetched ahead is reserved
  at that moment (the caller charges it as it starts the fetch).
- After a unit ran (`after_use`): its weights are kept when the trace uses it again within
  `reuse_distance` fetches, or while the kept bytes fit `reuse_bytes` (a forward's units kept for their
  backward), or after a forward use when it is one of the `held` units (offload.plan.memory.free_holds: a
  tied embedding from its lookup to the output head); otherwise released. A forward recomputed inside backward (activation checkpointing) is
  kept: its own backward follows at once.
"""

from __future__ import annotations

from typing import Sequence

from offload.scheduler.trace import ExecutionTrace


class ResidencyPolicy:
    def __init__(self, trace: ExecutionTrace, nbytes: Sequence[int], reuse_distance: int, reuse_bytes: int,
                 grad_reserve: int, held: frozenset = frozenset()):
        self.trace, self.nbytes = trace, nbytes
        self.reuse_distance, self.reuse_bytes, self.grad_reserve = reuse_distance, reuse_bytes, grad_reserve
        self.held = held                  # units kept from a forward use to their next use
        self.resident: set[int] = set()   # units whose weights are in hbm or on their way
        self.kept: dict[int, int] = {}    # units kept within reuse_bytes -> their bytes
        self.backward = False             # the phase of the last use

    def before_use(self, unit: int, room: int, backward: bool = False) -> list[int]:
        """`unit` is about to run (its forward, or its backward), with `room` hbm bytes free: the units to
        fetch ahead, in order."""
        ahead = []
        for nxt in self.trace.observe(unit, backward):
            if nxt in self.resident or nxt == unit:
                continue
            if self.nbytes[nxt] + self.grad_reserve > room:
                break  # in trace order: a later, smaller unit would be fetched before an earlier one
            ahead.append(nxt)
            room -= self.nbytes[nxt]
        self.resident.update(ahead)
        self.resident.add(unit)
        self.backward = backward
        self.kept.pop(unit, None)
        return ahead

    def before_step(self, room: int) -> list[int]:
        """Between steps, with `room` hbm bytes free: the recorded trace's first units that fit, in order, to
        fetch ahead of the next step's first use (held from now, as a prefetch)."""
        ahead = []
        for nxt in (self.trace.recorded or [])[:self.trace.lookahead]:
            if nxt in self.resident or nxt in ahead:
                continue
            if self.nbytes[nxt] + self.grad_reserve > room:
                break
            ahead.append(nxt)
            room -= self.nbytes[nxt]
        self.resident.update(ahead)
        return ahead

    def after_use(self, unit: int, recompute: bool = False) -> bool:
        """`unit` ran: True to release its weights now, False to keep them."""
        if recompute:
            return False
        distance = self.trace.next_use_distance(unit)
        held = unit in self.held and not self.backward
        if distance is not None and (distance <= self.reuse_distance or held or self._keep(unit)):
            return False
        self.resident.discard(unit)
        self.kept.pop(unit, None)
        return True

    def _keep(self, unit: int) -> bool:
        if sum(self.kept.values()) + self.nbytes[unit] > self.reuse_bytes:
            return False
        self.kept[unit] = self.nbytes[unit]
        return True

    def release_all(self) -> None:
        """Every fetched unit, kept ones too, was released (end of backward, before a step, a failure)."""
        self.resident.clear()
        self.kept.clear()
