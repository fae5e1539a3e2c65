"""One memory model: the bytes the runtime itself holds per tier, on top of the model states.

The placement's preflight, its printout and `offload estimate` all call `runtime_parts`, so the plan a
user reads is the plan the engine checks; measured peaks stay at or below it (tests/test_memory_model.py).
"""

from __future__ import annotations

import collections
import dataclasses

from offload.scheduler.policy import ResidencyPolicy
from offload.scheduler.trace import ExecutionTrace

# [Note: the working set]
# hbm (weights not resident): the fetched units (the one in use, `prefetch_units` ahead and up to
# `reuse_distance` kept for a use that comes next: the sum of the largest that many units), weights kept for their next use in the step (`reuse_bytes`,
# never more than all fetched weights), and the gradients on their way to dram (the largest
# `grad_units` trainable units in the compute dtype). dram: one pool of equal chunks (offload.plan.chunks):
# a fetch from nvme streams through READ_AHEAD chunks (on CUDA; on the CPU backend it reads straight into
# hbm, which is host memory); the optimizer pipeline holds 1 + OPTIMIZER_READ_AHEAD windows (one
# stepped, two read ahead, the one written behind landing before another read starts) of four fp32 chunks (master, exp_avg, exp_avg_sq, gradient)
# for nvme states plus one chunk of new weights where they cannot be written in place (nvme weights,
# hbm on a GPU, or a dram copy not to be touched before nvme states are checked). Activations are not included: they depend on batch and sequence length.
#
# [Note: shrinking to a budget]
# Prefetch depth, kept weights, the optimizer's read-ahead and the second gradient in flight only make
# training faster. Under a budget below the default working set they are given up in that order, and
# only a budget below the minimum (the largest unit's weights and gradient, one window of the pipeline,
# one chunk per fetch) is refused, with that minimum in bytes.

TIERS = ("hbm", "dram", "nvme")
OFFLOAD_TIER = {"none": "hbm", "cpu": "dram", "nvme": "nvme"}  # offload_param/offload_optimizer device -> tier
STATE_KINDS = 4    # fp32 master, exp_avg, exp_avg_sq, gradient (of a unit, or one chunk of each in a window)
BLOCK = 256        # int8 moments: elements a block with one fp32 absmax ([Note: int8 optimizer states])
PAGE = 4096        # the pool rounds each buffer up to it (offload.swap.buffers)
SWAP_SLACK_BYTES = 64 << 10  # beside the swap data: the run directory's owner file, allocation granularity
READ_AHEAD = 2     # chunks of one nvme fetch in flight (offload.state.residency)
OPTIMIZER_READ_AHEAD = 2  # windows the optimizer pipeline reads ahead of the one it steps (offload.step.windows)


@dataclasses.dataclass(frozen=True)
class Knobs:
    """What the working set depends on besides the model; the optional parts shrink to fit budgets."""
    prefetch_units: int = 2     # units fetched ahead of use
    reuse_distance: int = 1     # units kept because the trace uses them again within this many fetches
    reuse_bytes: int = 0        # weights kept in hbm until their next use in the step
    read_ahead: bool = True     # optimizer: a window read ahead / written behind; fetch: a chunk in flight
    grad_units: int = 2         # units' gradients in hbm on their way to dram
    held: frozenset = frozenset()  # units kept from a forward use to their next use: free_holds


MINIMUM = Knobs(prefetch_units=0, reuse_distance=0, reuse_bytes=0, read_ahead=False, grad_units=1)


def state_bytes(numel: int, states: str = "fp32", small_numel: int = 0, grad: bool = True,
                master: str = "fp32") -> int:
    """Bytes of the optimizer states of `numel` trained elements: the master (fp32, or a split master's
    record of 2 + 1/8 bytes: [Note: split master] in offload/kernels/split.py) and the moments (fp32, or
    int8 codes with a fp32 absmax per block of each; `small_numel` of them, in parameters under 4096
    elements, keep fp32 moments), and with `grad` the fp32 gradient accumulator."""
    record = 2 * numel + numel // 8 if master == "split" else 4 * numel
    if states == "fp32":
        return record + (8 + 4 * grad) * numel
    return record + (2 + 4 * grad) * numel + 8 * (numel // BLOCK) + 8 * small_numel


def window_chunks(states: str, chunk_bytes: int) -> int:
    """Pool chunks one window of nvme states can take: 4 (fp32 master, moments, gradient), or with int8
    moments the master, the gradient, the codes and scales (one chunk where moment_offsets fits them) and at
    worst (small parameters in the window) their fp32 m and v."""
    if states == "fp32":
        return STATE_KINDS
    return 4 + (1 if moment_offsets(chunk_bytes // 4, chunk_bytes) else 3)


def moment_offsets(numel: int, chunk_bytes: int) -> tuple[int, int, int] | None:
    """Byte offsets of a window's int8 codes of m, of v and of their scales in one pool chunk, each at a page
    (the swap reads and writes them in place); None where they do not fit one chunk."""
    page = -(-numel // PAGE) * PAGE
    return (0, page, 2 * page) if 2 * page + 8 * (numel // BLOCK) <= chunk_bytes else None


def pool_chunks(w_home: str, s_home: str, device_type: str, read_ahead: bool,
                hbm_trained: bool | None = None, trains: bool = True, states: str = "fp32",
                chunk_bytes: int = 0, master: str = "fp32") -> tuple[int, str]:
    """Chunks in the dram pool, and the formula. hbm_trained: whether a trained unit's weights live in hbm
    (default: w_home is hbm); the resident rest (final norms) does whatever w_home is. trains: False for a
    model with no trainable parameter (a frozen reference model): nothing is stepped, so no optimizer window."""
    # on the CPU backend an nvme fetch reads straight into the hbm copy (offload.state.residency): no pool chunk
    fetch = (READ_AHEAD if read_ahead else 1) if w_home == "nvme" and device_type != "cpu" else 0
    terms = [f"{fetch} per nvme fetch"] if fetch else []
    if not trains:  # nvme weights are still written (initial values, a checkpoint load): one chunk at a time
        writes = int(w_home == "nvme")
        return fetch + writes, " + ".join(terms + ["1 writing nvme weights (nothing trained: no optimizer "
                                                   "window)"] * writes)
    # New weights go through a chunk where they cannot be written in place, and where nvme states are
    # checked after the step that read them (they stay out of a live dram copy until then).
    hbm_trained = w_home == "hbm" if hbm_trained is None else hbm_trained
    new_w = 1 if s_home == "nvme" or w_home == "nvme" or (hbm_trained and device_type != "cpu") else 0
    per_window = (window_chunks(states, chunk_bytes) if s_home == "nvme" else 0) + new_w
    # nvme states, or a split master's nvme weights (read ahead for its join): the window stepped and those read
    # ahead; else only new weights pass through: the window stepped and the one written behind
    ahead = s_home == "nvme" or (w_home == "nvme" and master == "split")
    windows = (1 + OPTIMIZER_READ_AHEAD if ahead else 2) if read_ahead else 1
    if per_window:
        terms.append(f"{windows} optimizer windows x {per_window}")
    joined = int(master == "split")  # the stepped window's fp32 master, joined from its record
    if joined:
        terms.append("1 joined split master")
    return fetch + windows * per_window + joined, " + ".join(terms)


def _largest(numels: list[int], k: int) -> int:
    return sum(sorted(numels, reverse=True)[:k])


def grad_reserve(trainable_numels: list[int], itemsize: int, knobs: Knobs) -> int:
    """hbm bytes the gradients on their way to dram may hold: the largest `grad_units` units' gradients."""
    return _largest(trainable_numels, knobs.grad_units) * itemsize


def runtime_parts(fetched_numels: list[int], trainable_numels: list[int], itemsize: int, w_home: str,
                  s_home: str, device_type: str, chunk_bytes: int, knobs: Knobs, order: list[int] | None = None,
                  numels: list[int] | None = None, trainables: list[int] | None = None,
                  hbm_trained: bool | None = None, states: str = "fp32", master: str = "fp32") -> list[dict]:
    """The runtime's parts per tier: [{"name", "tier", "bytes", "formula"}].
    fetched_numels: the numel of every unit whose weights are fetched into hbm (none when w_home is hbm);
    trainable_numels: every unit's trainable numel. With the model's units known (`order`: the unit
    indices of a forward, offload.plan.units.forward_order; `numels`, `trainables`: per unit index), hbm's
    working set is the residency policy's peak over that order; without (`offload estimate` from a
    parameter count), every fetched unit counts as large as the largest ones."""
    parts = []

    def add(name, tier, nbytes, formula):
        if nbytes:
            parts.append({"name": name, "tier": tier, "bytes": int(nbytes), "formula": formula})

    reserve = grad_reserve(trainable_numels, itemsize, knobs)
    if w_home != "hbm" and order is not None:
        trains = any(trainables)  # nothing trainable: forwards only (working_set_peak)
        peak = working_set_peak(order, numels, trainables, itemsize, knobs, reserve, trains)
        add("fetched weights and gradients in flight", "hbm", peak,
            f"the peak over one step of the residency policy (scheduler/policy.py) replayed over the "
            f"{len(order)} unit uses of a forward in the model's module order{' and back' if trains else ''}: "
            f"{knobs.prefetch_units} prefetched, reuse_distance {knobs.reuse_distance}, reuse_bytes "
            f"{knobs.reuse_bytes}, each unit's gradients ({itemsize} B/param) in flight until the largest "
            f"{knobs.grad_units} fill the reserve")
        return _pool_parts(parts, add, w_home, s_home, device_type, chunk_bytes, knobs, hbm_trained,
                           any(trainable_numels), states, master)
    if w_home != "hbm":
        near = max(0, knobs.reuse_distance)
        k = 1 + knobs.prefetch_units + near
        window = _largest(fetched_numels, k) * itemsize
        add("fetched weights", "hbm", window, f"the largest {k} units x {itemsize} B (1 in use + "
            f"{knobs.prefetch_units} prefetched + {near} kept by reuse_distance)")
        kept = min(knobs.reuse_bytes, sum(fetched_numels) * itemsize - window)
        add("weights kept for reuse", "hbm", max(0, kept), "reuse_bytes, at most the other fetched weights")
    add("gradients in flight", "hbm", reserve, f"the largest {knobs.grad_units} trainable units x {itemsize} B")
    return _pool_parts(parts, add, w_home, s_home, device_type, chunk_bytes, knobs, hbm_trained,
                           any(trainable_numels), states, master)


def _pool_parts(parts, add, w_home, s_home, device_type, chunk_bytes, knobs, hbm_trained, trains, states,
                master) -> list[dict]:
    count, formula = pool_chunks(w_home, s_home, device_type, knobs.read_ahead, hbm_trained, trains, states, chunk_bytes,
                                 master if trains else "fp32")
    add("chunk pool", "dram", count * chunk_bytes, f"({formula}) chunks x chunk_bytes {chunk_bytes}")
    if w_home == "nvme" or (s_home == "nvme" and trains):
        add("swap run directory", "nvme", SWAP_SLACK_BYTES, "its owner file and the data file's allocation slack")
    return parts


def working_set_peak(order: list[int], numels: list[int], trainables: list[int], itemsize: int, knobs: Knobs,
                     reserve: int, with_backward: bool = True) -> int:
    """The largest hbm bytes of fetched weights plus gradients in flight in one step replayed after the
    step that recorded it: the residency policy over `order` (a forward) then its reverse (the backward),
    each unit's gradients charged after its last use in backward and held until the reserve (or the end
    of backward) forces the oldest out, as the engine's back-pressure does when the d2h copies are slow.
    with_backward: False for a model with nothing trainable (a frozen reference model): forwards only."""
    events = [(u, False) for u in order] + ([(u, True) for u in reversed(order)] if with_backward else [])
    last_bwd = {u: i for i, (u, b) in enumerate(events) if b}
    trace = ExecutionTrace(knobs.prefetch_units)
    nbytes = [n * itemsize for n in numels]
    policy = ResidencyPolicy(trace, nbytes, knobs.reuse_distance, knobs.reuse_bytes, 0, knobs.held)
    peak = 0
    for replay in (False, True):
        trace.begin_step()
        flight: list[int] = []
        for i, (u, backward) in enumerate(events):
            policy.before_use(u, room=1 << 62, backward=backward)
            held = sum(nbytes[r] for r in policy.resident)
            if backward and last_bwd[u] == i and trainables[u]:
                g = trainables[u] * itemsize
                while flight and sum(flight) + g > reserve:
                    flight.pop(0)
                flight.append(g)
            if replay:
                peak = max(peak, held + sum(flight))
            policy.after_use(u)
        trace.end_step()
        policy.release_all()
    # units never fetched (the resident rest: final norms) send their gradients through hbm too
    return peak + sum(trainables[u] for u in range(len(numels)) if u not in last_bwd) * itemsize


def free_holds(order: list[int], numels: list[int], trainables: list[int], itemsize: int, knobs: Knobs,
               reserve: int) -> frozenset:
    """The units that a forward uses more than once (a tied embedding: its lookup, then the output head)
    whose weights can stay in hbm from one use to the next without raising the working set's peak
    (working_set_peak, which replays the holding): released between the two, such a table is read again
    from nvme and its fresh copy faulted in at the head, at the forward's end with the drive idle (the 3b
    preset's tied embedding: bench/RESULTS.md, "free holds for a tied embedding"). Largest first, each kept only if the
    peak with it and those before stays."""
    counts = collections.Counter(order)
    backward = any(trainables)
    peak, held = working_set_peak(order, numels, trainables, itemsize, knobs, reserve, backward), frozenset()
    for u in sorted((u for u, n in counts.items() if n > 1), key=lambda u: -numels[u]):
        trial = dataclasses.replace(knobs, held=held | {u})
        if working_set_peak(order, numels, trainables, itemsize, trial, reserve, backward) <= peak:
            held = trial.held
    return held


def totals(parts: list[dict]) -> dict[str, int]:
    return {t: sum(p["bytes"] for p in parts if p["tier"] == t) for t in ("hbm", "dram", "nvme")}


def describe(parts: list[dict]) -> str:
    return "; ".join(f"{p['tier']} {p['name']} {p['bytes'] / 2**20:.1f} MiB = {p['formula']}" for p in parts)
