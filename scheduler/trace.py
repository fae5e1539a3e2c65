"""Execution trace: the order in which units are fetched in one step, recorded once and replayed.

The engine reports each fetch (`observe(unit)`); while the order matches the recorded one, `observe`
returns the units due next, which the engine prefetches. On a divergence (dynamic control flow) the
rest of the step runs on demand, the step is recorded again, and a warning is logged at most once per
`warn_every` steps.

Over ranks whose collectives follow the trace (zero_stage 3: a unit released after a use is gathered at
its next), `agree` makes the ranks replay the same trace: at the end of each step they agree whether
any of them recorded anew, and if so all keep the new recording when every rank recorded the same order,
else all record again (offload.state.ranks, [Note: collective order]).
"""

from __future__ import annotations

import logging
import zlib
from typing import Callable

log = logging.getLogger("offload")


class ExecutionTrace:
    def __init__(self, lookahead: int, warn_every: int = 1000,
                 agree: Callable[[list[float], str], list[float]] | None = None):
        self.lookahead, self.warn_every = lookahead, warn_every
        self.agree = agree  # (values, "max") -> the values reduced over the ranks; None: one rank's own trace
        self.recorded: list[int] | None = None
        self._current: list[int] = []
        self._last = None  # (unit, backward) of the last event
        self._pos = 0
        self._diverged = self._abandoned = False
        self._steps = 0
        self._last_warning = None

    def begin_step(self) -> None:
        self._current, self._pos, self._diverged, self._abandoned = [], 0, False, False
        self._last = None

    def abandon_step(self) -> None:
        """The step was rolled back (an error): what it fetched is not recorded; fetching is on demand
        until the next begin_step."""
        self._current, self._pos, self._diverged, self._abandoned = [], 0, True, True
        self._last = None

    def observe(self, unit: int, backward: bool = False) -> list[int]:
        """Records a fetch of `unit` (for its forward or its backward); returns the units expected next
        (empty when not replaying)."""
        if self._last == (unit, backward):
            return []  # the same use asked for twice in a row (a backward per output): one event
        self._last = (unit, backward)
        self._current.append(unit)
        if self.recorded is None or self._diverged:
            return []
        if self._pos < len(self.recorded) and self.recorded[self._pos] == unit:
            self._pos += 1
            return self.recorded[self._pos:self._pos + self.lookahead]
        self._diverged = True
        if self._last_warning is None or self._steps - self._last_warning >= self.warn_every:
            self._last_warning = self._steps
            expected = self.recorded[self._pos] if self._pos < len(self.recorded) else "the end of the step"
            log.warning("offload: unit order differs from the recorded trace (step %d, use %d: unit %d, recorded "
                        "%s); fetching on demand and recording again", self._steps, self._pos, unit, expected)
        return []

    def next_use_distance(self, unit: int) -> int | None:
        """Events until `unit` is fetched again in this step (0: the very next one); None when unknown
        (recording, diverged, or not used again)."""
        if not self.replaying:
            return None
        try:
            return self.recorded.index(unit, self._pos) - self._pos
        except ValueError:
            return None

    def end_step(self) -> None:
        if self._abandoned:
            return
        changed = self.recorded is None or self._diverged or self._pos != len(self.recorded)
        if self.agree is None:
            if changed:
                self.recorded = self._current
        else:
            self._agreed_end(changed)
        self._steps += 1

    def _agreed_end(self, changed: bool) -> None:
        """The ranks agree: a new recording is kept by all when all recorded the same order, else none."""
        digest, n = zlib.crc32(repr(self._current).encode()), len(self._current)
        anyone, hi, lo, n_hi, n_lo = self.agree([float(changed), digest, -digest, n, -n], "max")
        if not anyone:
            return
        if hi == -lo and n_hi == -n_lo:
            self.recorded = self._current
            return
        self.recorded = None
        log.warning("offload: the ranks used their units in different orders in step %d; fetching on demand and "
                    "recording again (with zero_stage 3 every rank must run the same units in the same order)",
                    self._steps)

    @property
    def replaying(self) -> bool:
        return self.recorded is not None and not self._diverged


class CyclicTrace(ExecutionTrace):
    """A trace whose steps repeat one order: the units due next, and a unit's next use, run on into the next step
    ([Note: generation] in offload.step.generation)."""

    def observe(self, unit: int, backward: bool = False) -> list[int]:
        repeat = self._last == (unit, backward)
        ahead = super().observe(unit, backward)
        if repeat or not self.replaying or len(ahead) >= self.lookahead:
            return ahead
        return ahead + self.recorded[:self.lookahead - len(ahead)]

    def next_use_distance(self, unit: int) -> int | None:
        """As ExecutionTrace's, on into the next step; while recording (the first forward, or one that diverged):
        the events recorded so far, as the next step uses the unit again after about as many."""
        if not self.replaying:
            return len(self._current)
        distance = super().next_use_distance(unit)
        if distance is None and unit in self.recorded:
            return len(self.recorded) - self._pos + self.recorded.index(unit)
        return distance
