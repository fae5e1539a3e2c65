"""The gradient accumulator: a micro-step's gradients into a unit's fp32 accumulator (the "grad" flat or nvme
chunks of its offload.state.optim.OptimState), and over ranks (zero_stage 1-3) into each window's owner by a
reduce-scatter or a reduce ([Note: gradient reduce-scatter]). It runs on the d2h thread, as the gradient path's
job (offload.step.gradients): the state holds the accumulator, this fills it.
"""

from __future__ import annotations

import time
import weakref

import torch

from offload.kernels.cpu_adam import grad_sq_sum
from offload.plan.chunks import copy_spans, rounds
from offload.state.optim import OptimState
from offload.state.ranks import reduced

# False: gradients go by the per-window reduce even where the backend has a reduce-scatter (a backend
# without one; tests cover both paths with it). Set it alike on every rank (the ranks agree on it anyway).
USE_REDUCE_SCATTER = True


def accumulate(st: OptimState, grads: list[tuple[int, torch.Tensor]], first: bool, last: bool,
               keep: bool = False, deferred: bool = False) -> float | None:
    """Adds this micro-step's gradients (offset, flat grad) into the fp32 accumulator of `st`; on the last
    micro-step returns its sum of squares (for the global norm and fp16 overflow detection).
    keep: the step follows at once (overlapped): after a window of one micro-step, nvme states read the
    gradient window by window straight from `grads`, which the caller keeps alive until the step is done
    (after several, from the accumulator on nvme).
    A window of one micro-step in bf16/fp16 (the common case) keeps the gradient in its own dtype
    (in a resident accumulator's first bytes): the step casts it as it reads it (the same fp32 values),
    and the copy's writes, the sum of squares and the step's gradient reads each move half the bytes.
    deferred: the step comes at the unit's next fetch ([Note: split step] in offload.step.pipeline); an nvme
    accumulator of one micro-step then holds the gradient in its own dtype too."""
    rt = st.rt
    if first:
        dtype = grads[0][1].dtype if grads else torch.float32
        resident_cpu = st.home != "nvme" and st.t["grad"].device.type == "cpu"
        own = last and dtype != torch.float32 and (resident_cpu or keep or deferred) and not rt.sharded
        st.grad_dtype = dtype if own else torch.float32
    st.note_gradients([offset for offset, _ in grads], first)
    if rt.sharded:
        return _over_ranks(st, grads, first, last)
    if st.home == "nvme" and keep and first:  # one micro-step: the step reads `grads` itself
        st.hold_gradients(grads)
        return sum(grad_sq_sum(g) if g.device.type == "cpu" else float(g.double().square().sum())
                   for _, g in grads)
    if st.home == "nvme":
        return _into_chunks(st, grads, first, last)
    acc = st.accumulator()
    _add_span(acc, grads, 0, st.numel, first)
    return _sq(acc) if last else None


def _into_chunks(st: OptimState, grads, first: bool, last: bool) -> float | None:
    """An nvme accumulator, window by window: read (after the first micro-step), add, write back."""
    rt, sq = st.rt, 0.0
    for i, (b, e) in enumerate(st.chunks):
        buf = rt.staging.acquire(e - b, st.grad_dtype, f"{st.unit.name} grad")
        try:
            if not first:
                rt.store.read(st.key("grad", i), into=buf).wait()
            _add_span(buf, grads, b, e, first)
            if last:
                sq += _sq(buf)
            t0 = time.perf_counter()
            rt.store.write(st.key("grad", i), buf).wait()
            rt.telemetry.link("dram_to_nvme", buf.numel() * buf.element_size(), time.perf_counter() - t0)
        finally:
            rt.staging.release(buf)
    return sq if last else None


def _over_ranks(st: OptimState, grads, first: bool, last: bool) -> float | None:
    """[Note: windows over ranks] in offload.state.optim: this rank's gradient (fp32, zeros where it has none)
    summed over the ranks into each window's owner, which adds the mean into its accumulator: round by round
    with a reduce-scatter where the ranks agreed on one, else window by window with a reduce ([Note: gradient
    reduce-scatter]). Every rank runs this for every unit in the same order on its d2h thread, which keeps
    the collectives matched. Returns the sum of squares of this rank's windows (the step adds the ranks')."""
    rt, sq = st.rt, 0.0
    scatter = reduce_scatter_agreed(rt.ranks) and rt.chunk_numel >= rt.world
    for round_ in rounds(st.owner, rt.world):
        if scatter and len(round_) >= rt.world - 1:
            sq += _reduce_scatter_round(st, grads, round_, first, last)
        else:
            for i in round_:
                sq += _reduce_window(st, grads, i, first, last)
    return sq if last else None


def _reduce_window(st: OptimState, grads, i: int, first: bool, last: bool) -> float:
    """Window i's gradient summed into its owner (a reduce: gloo's AVG and bf16 sums are missing or slow
    in some torch versions, so fp32, SUM, then divided); the owner's sum of squares if last, else 0."""
    import torch.distributed as dist

    rt, (b, e) = st.rt, st.chunks[i]
    buf = rt.staging.acquire(e - b, torch.float32, f"{st.unit.name} grad reduce")
    try:
        copy_spans(grads, b, e, buf)
        t0 = time.perf_counter()
        rt.ranks.run("reduce", f"{st.unit.name} window {i}",
                     lambda: dist.reduce(buf, dst=st.owner[i], group=rt.ranks.grad))
        rt.telemetry.collective("reduce", buf.numel() * 4, time.perf_counter() - t0)
        return _add_owned(st, i, buf.div_(rt.world), first, last) if st.owner[i] == rt.rank else 0.0
    finally:
        rt.staging.release(buf)


def _reduce_scatter_round(st: OptimState, grads, round_: list[int], first: bool, last: bool) -> float:
    """[Note: gradient reduce-scatter] The windows of one round (distinct owners) summed over the ranks,
    each into its owner: rank r's piece of every collective is its slice of the window r owns (zeros
    past that window's end, or where r owns none). The owner's sum of squares if last, else 0."""
    rt, world = st.rt, st.rt.world
    owned = {st.owner[i]: st.chunks[i] for i in round_}  # rank -> (begin, end) of its window here
    longest = max(e - b for b, e in owned.values())
    step = min(rt.chunk_numel // world, longest)  # elements per piece: `world` pieces fill one pool chunk
    what = f"{st.unit.name} windows {round_[0]}-{round_[-1]}"
    total = rt.staging.acquire(longest, torch.float32, f"{what} reduce-scatter output")
    try:
        flat = rt.staging.acquire(world * step, torch.float32, f"{what} reduce-scatter input")
        try:
            for at in range(0, longest, step):
                n = min(step, longest - at)
                pieces, real = flat[:world * n], 0
                for r in range(world):  # piece r: elements [at, at + n) of the window rank r owns
                    b, e = owned.get(r, (0, 0))
                    lo, hi = min(b + at, e), min(b + at + n, e)
                    copy_spans(grads, lo, hi, pieces[r * n:r * n + hi - lo])
                    pieces[r * n + hi - lo:(r + 1) * n].zero_()
                    real += hi - lo
                t0 = time.perf_counter()
                rt.ranks.run("reduce_scatter", what,
                             lambda: reduce_scatter(total[at:at + n], pieces, world, rt.ranks.grad))
                rt.telemetry.collective("reduce_scatter", 4 * real, time.perf_counter() - t0)  # no padding
        finally:
            rt.staging.release(flat)
        mine = [i for i in round_ if st.owner[i] == rt.rank]
        if not mine:
            return 0.0
        b, e = st.chunks[mine[0]]
        return _add_owned(st, mine[0], total[:e - b].div_(world), first, last)
    finally:
        rt.staging.release(total)


def _add_owned(st: OptimState, i: int, mean: torch.Tensor, first: bool, last: bool) -> float:
    """Owned window i's accumulator = mean (first micro-step) or += mean; its sum of squares if last."""
    rt = st.rt
    if st.home != "nvme":
        acc = st.t["grad"][st.span(i)]  # fp32: over ranks the accumulator keeps no other dtype
        acc.copy_(mean) if first else acc.add_(mean)
        return _sq(acc) if last else 0.0
    key = st.key("grad", i)
    if not first:
        acc = rt.staging.acquire(mean.numel(), torch.float32, f"{st.unit.name} grad")
        try:
            rt.store.read(key, into=acc).wait()
            mean.add_(acc)
        finally:
            rt.staging.release(acc)
    t0 = time.perf_counter()
    rt.store.write(key, mean).wait()
    rt.telemetry.link("dram_to_nvme", mean.numel() * 4, time.perf_counter() - t0)
    return _sq(mean) if last else 0.0


# [Note: gradient reduce-scatter]
# Stages 1-3 sum each state window's gradient over the ranks into the window's owner. Where the d2h
# thread's group (ranks.grad) has a reduce-scatter, a unit's windows go in rounds (offload.plan.chunks.rounds:
# consecutive windows, at most one per rank): each rank lays out its gradient of the round as `world`
# equal pieces in rank order, piece r from the window rank r owns, and the reduce-scatter leaves each rank
# the sum of its own piece. Pieces are as long as the round's longest window, zeros past a shorter one's
# end and where a rank owns none; the input is one pool chunk, `world` pieces of chunk_numel // world
# elements, so a round of full windows takes `world` reduce-scatters, as many collectives as its reduces,
# each sending (world-1)/world of its input per rank (ring). Pool chunks: the input, then the owner's sum
# (the two the placement plans for the gradient reduce; the input is returned before the sum is added).
# A round of k < world - 1 windows (a unit's last, count % world) would send world - 1 pieces per rank
# against k reduces' k windows: it keeps the reduces. The counters count gradient bytes only (4 B x the
# windows' elements, never the padding), so "reduce_scatter" plus "reduce" make 4 B per trainable
# parameter per micro-step; with 2 ranks every round is reduce-scattered.
# Whether the group has one is probed (reduce_scatter_agreed), not inferred from a backend name and a torch
# version: gloo has it in torch 2.13 and lacked it in older versions, and the probe also checks the sum.
# A backend without it raises before sending anything, the same on every rank (same backend, same torch);
# the ranks then agree on the outcome (the minimum), so even a rank that differs leaves all on one path.
# It runs on the d2h thread at its first gradient reduce, the same point in every rank's order of
# collectives on that group, once per group and process.
_AGREED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # grad group -> the ranks' agreed answer


def reduce_scatter_agreed(ranks) -> bool:
    """Whether every rank reduce-scatters gradients on `ranks.grad` ([Note: gradient reduce-scatter]):
    USE_REDUCE_SCATTER on every rank and a probe that succeeded on every rank. A collective: call it on
    the thread that owns the group, at the same point on every rank; the answer is cached per group."""
    group = ranks.grad
    if group not in _AGREED:
        what = "the ranks' reduce-scatter probe"
        wanted = ranks.run("all_reduce", what, lambda: reduced([float(USE_REDUCE_SCATTER)], "min", group))[0]
        agreed = wanted and ranks.run("all_reduce", what,
                                      lambda: reduced([float(_probe(group, ranks.world))], "min", group))[0]
        _AGREED[group] = bool(agreed)
    return _AGREED[group]


def _probe(group, world: int) -> bool:
    """One reduce-scatter of `world` ones on every rank: whether the group's backend has it and sums right."""
    out = torch.zeros(1)
    try:
        reduce_scatter(out, torch.ones(world), world, group)
    except (RuntimeError, ValueError):  # not supported (NotImplementedError is a RuntimeError)
        return False
    return out.item() == world


def reduce_scatter(out: torch.Tensor, pieces: torch.Tensor, world: int, group) -> None:
    """out = the sum over the ranks of piece `rank` of `pieces` (world equal pieces, back to back), fp32 SUM."""
    import torch.distributed as dist

    if dist.get_backend(group) == "gloo":  # its list form: the tensor form took 1.35-1.5x as long (docs/zero.md)
        dist.reduce_scatter(out, list(pieces.chunk(world)), group=group)
    else:  # reduce_scatter_single where torch has it (2.13 deprecates reduce_scatter_tensor for it)
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, pieces, group=group)


def _add_span(acc: torch.Tensor, grads, begin: int, end: int, first: bool) -> None:
    """acc (elements [begin, end) of the accumulator) = the gradients (first micro-step: a copy, gaps
    zeroed) or += them."""
    if first:
        copy_spans(grads, begin, end, acc)
        return
    for offset, g in grads:
        b, e = max(offset, begin), min(offset + g.numel(), end)
        if b < e:
            acc[b - begin:e - begin].add_(g[b - offset:e - offset].to(acc.device))  # blocking: read next


def _sq(acc: torch.Tensor) -> float:
    return grad_sq_sum(acc) if acc.device.type == "cpu" else float(acc.double().square().sum())
