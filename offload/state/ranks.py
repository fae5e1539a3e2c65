"""What the ranks of the default process group do together: the engine's own process groups, each
collective under a timeout and named when it fails, and the scalars every rank must agree on.
"""

from __future__ import annotations

import datetime
import time
from typing import Callable

import torch

# [Note: collective order]
# Over ranks every collective is a meeting: each rank must enter the same collectives, on the same group,
# in the same order, or the ranks wait for each other forever (gloo) or exchange the wrong tensors. So the
# order of collectives is decided only from facts every rank shares: the model's module order, the
# keep/release decisions of a policy fed the same events on every rank, and a recorded trace the ranks
# agreed on. Never from one rank's own view: its timing (which fetch finished first, how much hbm was free
# at a moment), a reference count another thread may be holding for a moment, or a trace only it
# re-recorded. Where such a local fact must steer a collective, the ranks agree on it first (`agree`):
#   - a unit used by an embedding lookup is fetched for its backward if any rank's forward saved its
#     weights (offload.step.hooks, [Note: backward without weights]);
#   - at the end of each backward the ranks agree on the trace to replay next: all keep the new recording
#     if every rank recorded the same one, else all record again (scheduler.trace).
# Fetches of partitioned weights (zero_stage 3) end in a gather, so their order is decided from shared
# facts too: the prefetcher asks the policy with a room every rank computes alike (the agreed hbm room
# less the bytes of the units the policy holds, offload.step.prefetch), never the bytes free at that moment,
# and the gathers run on the gather thread in the order the fetches were issued.
# Each thread that enters collectives has its own group (the compute thread: agreements, the new
# weights' broadcasts, and gathers when zero_gather_ahead is off; the gather thread: the gathers of
# fetched units; the d2h thread: gradient reduces), so no two threads interleave on one group. Both groups carry `collective_timeout_s`: a rank whose peer never comes raises CollectiveError
# naming the collective, the unit and the step, and a failed rank's exit breaks the connection its peers
# wait on, so they raise too instead of waiting out the timeout. After a failure no further collective is
# entered (the other thread's jobs fail at once); one already waiting ends at its own timeout, and the
# engine's threads are daemons, so none keeps the process alive once the main thread has ended.


class CollectiveError(RuntimeError):
    """A collective that did not complete on this rank: a peer failed, stopped, or entered another one."""


def reduced(values: list[float], op: str = "sum", group=None) -> list[float]:
    """`values` reduced elementwise over the ranks: "sum", "min" or "max" (fp64: integers below 2**53 stay
    exact)."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op],
                    group=group)
    return t.tolist()


def groups_backend() -> str:
    """The backend of the engine's groups: the default group's, with gloo beside a bare NCCL for the
    collectives of host tensors (agreements, the gradients' host buffers, dram homes), which NCCL cannot
    send; torch picks the backend by each tensor's device."""
    import torch.distributed as dist

    backend = str(dist.get_backend())
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


class Ranks:
    """The engine's process groups over the default group's ranks ([Note: collective order]); `step` (set by
    the step pipeline) names the step in errors. One rank (world 1): no groups, and `agree` returns its
    own values."""

    def __init__(self, rank: int, world: int, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.step = 0
        self.failed: str | None = None  # the first collective that failed: no later one is entered
        self.compute = self.grad = self.gather = None
        if world > 1:  # every rank creates them here, in the same order (new_group is a collective)
            import torch.distributed as dist

            timeout, backend = datetime.timedelta(seconds=timeout_s), groups_backend()
            self.compute = dist.new_group(backend=backend, timeout=timeout)
            self.grad = dist.new_group(backend=backend, timeout=timeout)
            self.gather = dist.new_group(backend=backend, timeout=timeout)

    def run(self, what: str, unit: str, fn: Callable[[], object]):
        """fn() (a collective); its failure raised as CollectiveError naming `what`, `unit` and the step."""
        if self.failed is not None:  # the ranks are out of step: another collective would only wait
            raise CollectiveError(f"offload: rank {self.rank}: {what} of {unit} at step {self.step} not entered: "
                                  f"an earlier collective failed ({self.failed})")
        t0 = time.perf_counter()
        try:
            return fn()
        except RuntimeError as e:  # gloo: a timeout or a peer's closed connection; NCCL: DistBackendError
            waited = time.perf_counter() - t0
            self.failed = f"{what} of {unit} at step {self.step}"
            raise CollectiveError(
                f"offload: rank {self.rank} of {self.world}: {what} of {unit} at step {self.step} failed after "
                f"{waited:.1f} s (collective_timeout_s {self.timeout_s:g}): {type(e).__name__}: {e}. The other "
                "ranks did not enter this collective: one failed or stopped (its own error says where), or the "
                "ranks disagree on the order of collectives (a bug: please report it with every rank's error)"
            ) from e

    def agree(self, values: list[float], op: str, what: str) -> list[float]:
        """`values` reduced over the ranks on the compute thread's group (the values themselves when alone)."""
        if self.world == 1:
            return list(values)
        return self.run(what, "the ranks' agreement", lambda: reduced(values, op, self.compute))
