"""Optimizer states per unit, in windows of one chunk each.

Each trainable unit has four fp32 flats over its trainable prefix: master, exp_avg, exp_avg_sq and the
gradient accumulator. Their home is hbm, dram or nvme. The step runs over windows of chunk_numel
elements (offload.plan.chunks): resident states are viewed in place; nvme states are staged window by window
through pool chunks (one swap key per kind and chunk), the step reading window j+1 ahead while CPU Adam
updates window j and window j-1 is written back, so the optimizer's dram is a few chunks at any model size.
"""

from __future__ import annotations

import time
import weakref

import torch

from offload.plan.chunks import chunk_key, gather, packed, rounds, windows
from offload.kernels.cpu_adam import grad_sq_sum
from offload.state.ranks import reduced
from offload.state.residency import HOME_STATE, R, _Handle
from offload.plan.units import Unit
from offload.swap.integrity import tensor_digests

KINDS = ("master", "exp_avg", "exp_avg_sq", "grad")
STATES = KINDS[:3]  # what a read-ahead loads: the gradient may not be final yet
# False: gradients go by the per-window reduce even where the backend has a reduce-scatter (a backend
# without one; tests cover both paths with it). Set it alike on every rank (the ranks agree on it anyway).
USE_REDUCE_SCATTER = True


class StagedWindow(_Handle):
    """One chunk of an nvme unit's states in dram: its pool chunks per kind and the I/O in flight."""

    def __init__(self, name: str):
        super().__init__(name, "nvme")
        self.t: dict[str, torch.Tensor] = {}
        self.tickets: list = []
        self.nbytes = 0                         # bytes of the reads in flight
        self.t0 = 0.0
        self.unverified: set[str] = set()       # kinds read without the store's check, until the step's
        self.digests: dict[str, tuple] = {}     # kind -> block digests of the updated state, for store()


class OptimState(_Handle):
    """One unit's fp32 states. Resident (hbm/dram) states are allocated once; nvme ones are staged by window."""

    def __init__(self, unit: Unit, home: str, rt):
        super().__init__(f"{unit.name}/optim", home)
        self.unit, self.rt = unit, rt
        self.numel = unit.trainable_numel
        self.windows = windows(self.numel, rt.chunk_numel)
        # [Note: windows over ranks] zero_stage 1-3 over several ranks: this rank holds and steps the
        # windows it owns (offload.plan.chunks.window_owners); every rank passes every window's gradient to its
        # owner (_accumulate_sharded) and receives every other window's new weights from it
        # (offload.step.pipeline.share_new_weights). Resident states hold the owned windows back to back.
        self.owner = rt.placement.owners.get(unit.index) or [rt.rank] * len(self.windows)
        self.mine = [i for i, r in enumerate(self.owner) if r == rt.rank]
        self._local, self.local_numel = packed(self.windows, self.mine)  # window -> first element in the flats
        self.t: dict[str, torch.Tensor] = {}    # resident homes: the four flats of the owned windows
        self._win = [StagedWindow(f"{unit.name}/optim#{i}") for i in range(len(self.windows))] if home == "nvme" else []
        self._grads: list | None = None           # nvme, overlapped step: this backward's gradients, read by window
        self.grad_dtype = torch.float32          # what the accumulator holds: see accumulate()
        # With swap checksums on, the step hashes the states it reads and writes, so they are read unverified
        # and checked after it ([Note: swap digests in the step] in offload/kernels/csrc/cpu_adam.cpp).
        # [Note: parameters without a gradient]
        # torch's optimizers skip a parameter whose .grad is None: no decay, no moment update, and its own
        # step count (bias correction) does not advance. So each trainable slot counts its steps, the
        # accumulator notes which slots received a gradient in the accumulation window, and the step
        # updates only those (see offload.step.windows); in the common case that is one run over all.
        self.slots = sorted((s for s in unit.slots if s.trainable), key=lambda s: s.offset)
        self.slot_steps = [0] * len(self.slots)
        self._slot_at = {s.offset: i for i, s in enumerate(self.slots)}
        self.got_grad: set[int] = set()           # slot indices with a gradient in this window
        self.hashed = home == "nvme" and rt.store.checksum
        self._bounds: dict[int, list[int]] = {}
        if home != "nvme":
            for kind in KINDS:
                self.t[kind] = rt.tiers.empty(home, self.local_numel, torch.float32, f"{unit.name} {kind}").zero_()

    def key(self, kind: str, i: int) -> str:
        return chunk_key(self.unit.key(kind, self.rt.rank), i)

    def digest_bounds(self, i: int) -> list[int] | None:
        """Element bounds of window i's swap digests (None without swap checksums)."""
        if not self.hashed:
            return None
        b, e = self.windows[i]
        if e - b not in self._bounds:
            self._bounds[e - b] = self.rt.store.digest_bounds(e - b, 4)
        return self._bounds[e - b]

    # -- windows ------------------------------------------------------------------------------------
    def loaded(self, i: int) -> bool:
        return self.home != "nvme" or self._win[i].state is not R.NVME

    def span(self, i: int) -> slice:
        """Where owned window i lies in the resident flats."""
        b, e = self.windows[i]
        return slice(self._local[i], self._local[i] + e - b)

    def view(self, i: int) -> dict[str, torch.Tensor]:
        """Window i's master/exp_avg/exp_avg_sq (after wait_loaded(i))."""
        if self.home != "nvme":
            return {k: self.t[k][self.span(i)] for k in STATES}
        return self._win[i].t

    def grad(self, i: int) -> torch.Tensor:
        """Window i's gradient as the step reads it: the fp32 accumulator, or (one micro-step, low
        precision) the backward's own gradient dtype; for nvme states with an overlapped step, gathered
        from this backward's gradients into a pool chunk that store(i) returns."""
        if self.home != "nvme":
            return self._as_grad(self.t["grad"])[self.span(i)]
        b, e = self.windows[i]
        w = self._win[i]
        if "grad" not in w.t:  # read ahead without it: from this backward's gradients, or the accumulator
            buf = w.t["grad"] = self.rt.staging.acquire(e - b, self.grad_dtype, f"{self.unit.name} grad")
            if self._grads is not None:
                gather(self._grads, b, e, buf)
            else:
                self.rt.store.read(self.key("grad", i), into=buf).wait()
        return w.t["grad"]

    def _as_grad(self, buf: torch.Tensor) -> torch.Tensor:
        """The fp32 accumulator buffer `buf` as the window's gradient dtype (see accumulate())."""
        return buf if self.grad_dtype == torch.float32 else buf.view(self.grad_dtype)[:buf.numel()]

    def runs(self, i: int) -> list[tuple[int, int, int]]:
        """(begin, end, step) element ranges of window i (relative to it) to update now, each with the
        1-based step count of its slots; a slot's range runs to the next slot (its padding included)."""
        wb, we = self.windows[i]
        ends = [s.offset for s in self.slots[1:]] + [self.numel]
        out: list[list[int]] = []
        for k, (slot, end) in enumerate(zip(self.slots, ends)):
            b, e = max(slot.offset, wb), min(end, we)
            if k not in self.got_grad or b >= e:
                continue
            step = self.slot_steps[k] + 1
            if out and out[-1][1] == b - wb and out[-1][2] == step:
                out[-1][1] = e - wb
            else:
                out.append([b - wb, e - wb, step])
        return [tuple(r) for r in out]

    def hash_states(self, i: int) -> tuple[tuple[int, ...], ...]:
        """Swap digests of window i's staged master/exp_avg/exp_avg_sq (when the step cannot hash them)."""
        return tuple(tensor_digests(self._win[i].t[k], self.digest_bounds(i)) for k in STATES)

    def drop_gradients(self) -> None:
        """A rolled-back micro-step: this backward's gradients are no longer read (accumulate(first=True)
        overwrites the accumulator next time)."""
        self._grads = None

    def count_steps(self) -> None:
        """After the update of every window: the slots that had a gradient advanced one step."""
        for k in self.got_grad:
            self.slot_steps[k] += 1
        self._grads = None

    def check_digests(self, i: int, digests) -> None:
        """After the step hashed window i's states (cpu_adam.StepDigests): raises SwapCorruptionError if
        what was read differs from what was written; keeps the new states' digests for store()."""
        w = self._win[i]
        for kind, before, after in zip(STATES, digests.before, digests.after):
            if kind in w.unverified:
                self.rt.store.check_digests(self.key(kind, i), before)
            w.digests[kind] = after
        w.unverified.clear()

    # -- nvme staging -------------------------------------------------------------------------------
    def load(self, i: int, kinds=KINDS) -> None:
        """Starts reading window i's `kinds` into pool chunks (missing keys read as zeros)."""
        if self.home != "nvme" or self._win[i].state is not R.NVME:
            return
        w, (b, e) = self._win[i], self.windows[i]
        try:
            w.nbytes = 0
            for kind in kinds:
                dtype = self.grad_dtype if kind == "grad" else torch.float32  # see accumulate()
                buf = w.t[kind] = self.rt.staging.acquire(e - b, dtype, f"{self.unit.name} {kind}")
                key = self.key(kind, i)
                if key in self.rt.store:  # exp_avg/exp_avg_sq start as zeros, unwritten
                    verify = not self.hashed or kind not in STATES
                    w.tickets.append(self.rt.store.read(key, into=buf, verify=verify))
                    w.nbytes += buf.numel() * buf.element_size()
                    if not verify:
                        w.unverified.add(kind)
                else:
                    buf.zero_()
        except BaseException:
            self._drop(w)
            raise
        w.t0 = time.perf_counter()
        w._set(R.NVME_TO_DRAM, R.NVME)

    def wait_loaded(self, i: int) -> None:
        if self.home != "nvme" or self._win[i].state is R.DRAM:
            return
        if self._win[i].state is R.NVME:
            self.load(i, STATES if self._grads is not None else KINDS)
        w = self._win[i]
        try:
            for t in w.tickets:
                t.wait()
        except BaseException:
            self._drop(w)
            raise
        self.rt.telemetry.link("nvme_to_dram", w.nbytes, time.perf_counter() - w.t0)
        w.tickets = []
        w._set(R.DRAM, R.NVME_TO_DRAM)

    def store(self, i: int, kinds=STATES) -> None:
        """Starts writing window i's `kinds` back (write-behind); its other chunks return to the pool."""
        if self.home != "nvme":
            return
        w = self._win[i]
        if w.unverified:  # an invariant, not user input: unchecked bytes must never be written back
            raise RuntimeError(f"{w.name}: {sorted(w.unverified)} read unverified and not checked by a step")
        for kind in [k for k in w.t if k not in kinds]:
            self.rt.staging.release(w.t.pop(kind))
        w.tickets = []
        for kind in kinds:  # one by one: if a write raises, those already in flight are settled by _drop
            w.tickets.append(self.rt.store.write(self.key(kind, i), w.t[kind], digests=w.digests.pop(kind, None)))
        w.t0 = time.perf_counter()
        w._set(R.DRAM_TO_NVME, R.DRAM)

    def wait_stored(self, i: int) -> None:
        if self.home != "nvme" or self._win[i].state is not R.DRAM_TO_NVME:
            return
        w = self._win[i]
        try:
            for t in w.tickets:
                t.wait()
            self.rt.telemetry.link("dram_to_nvme", 4 * (self.windows[i][1] - self.windows[i][0]) * len(w.tickets),
                                    time.perf_counter() - w.t0)
        finally:
            self._drop(w)

    def discard(self, i: int) -> None:
        """Window i's staged chunks go back to the pool unwritten (after a failed step)."""
        if self.home == "nvme":
            self._drop(self._win[i])

    def _drop(self, w: StagedWindow) -> None:
        """Settles the window's I/O and returns its chunks; the window is at home (nvme) again."""
        for t in w.tickets:
            try:
                t.wait()
            except Exception:  # reported by whoever waited first (an interrupt is not held back)
                pass
        w.tickets = []
        for kind in list(w.t):
            self.rt.staging.release(w.t.pop(kind))
        w.unverified.clear()
        w.digests.clear()
        w.state = R.NVME

    # -- the gradient accumulator (runs on the d2h copy thread) --------------------------------------
    def accumulate(self, grads: list[tuple[int, torch.Tensor]], first: bool, last: bool,
                   keep: bool = False, deferred: bool = False) -> float | None:
        """Adds this micro-step's gradients (offset, flat grad) into the fp32 accumulator; on the last
        micro-step returns its sum of squares (for the global norm and fp16 overflow detection).
        keep: the step follows at once (overlapped): after a window of one micro-step, nvme states read the
        gradient window by window straight from `grads`, which the caller keeps alive until the step is done
        (after several, from the accumulator on nvme).
        A window of one micro-step in bf16/fp16 (the common case) keeps the gradient in its own dtype
        (in a resident accumulator's first bytes): the step casts it as it reads it (the same fp32 values),
        and the copy's writes, the sum of squares and the step's gradient reads each move half the bytes.
        deferred: the step comes at the unit's next fetch ([Note: split step] in offload.step.pipeline); an nvme
        accumulator of one micro-step then holds the gradient in its own dtype too."""
        if first:
            self.got_grad = set()
            dtype = grads[0][1].dtype if grads else torch.float32
            resident_cpu = self.home != "nvme" and self.t["grad"].device.type == "cpu"
            own = last and dtype != torch.float32 and (resident_cpu or keep or deferred) and not self.rt.sharded
            self.grad_dtype = dtype if own else torch.float32
        self.got_grad.update(self._slot_at[offset] for offset, _ in grads)
        if self.rt.sharded:
            return self._accumulate_sharded(grads, first, last)
        if self.home == "nvme" and keep and first:  # one micro-step: the step reads `grads` itself
            self._grads = list(grads)
            return sum(grad_sq_sum(g) if g.device.type == "cpu" else float(g.double().square().sum())
                       for _, g in grads)
        if self.home == "nvme":
            return self._accumulate_chunks(grads, first, last)
        acc = self._as_grad(self.t["grad"])
        _add_window(acc, grads, 0, self.numel, first)
        return _sq(acc) if last else None

    def _accumulate_chunks(self, grads, first: bool, last: bool) -> float | None:
        """An nvme accumulator, window by window: read (after the first micro-step), add, write back."""
        sq = 0.0
        for i, (b, e) in enumerate(self.windows):
            buf = self.rt.staging.acquire(e - b, self.grad_dtype, f"{self.unit.name} grad")
            try:
                if not first:
                    self.rt.store.read(self.key("grad", i), into=buf).wait()
                _add_window(buf, grads, b, e, first)
                if last:
                    sq += _sq(buf)
                t0 = time.perf_counter()
                self.rt.store.write(self.key("grad", i), buf).wait()
                self.rt.telemetry.link("dram_to_nvme", buf.numel() * buf.element_size(), time.perf_counter() - t0)
            finally:
                self.rt.staging.release(buf)
        return sq if last else None

    def _accumulate_sharded(self, grads, first: bool, last: bool) -> float | None:
        """[Note: windows over ranks] This rank's gradient (fp32, zeros where it has none) summed over the
        ranks into each window's owner, which adds the mean into its accumulator: round by round with a
        reduce-scatter where the ranks agreed on one, else window by window with a reduce ([Note: gradient
        reduce-scatter]). Every rank runs this for every unit in the same order on its d2h thread, which
        keeps the collectives matched. Returns the sum of squares of this rank's windows (the step adds
        the ranks' sums)."""
        rt, sq = self.rt, 0.0
        scatter = reduce_scatter_agreed(rt.ranks) and rt.chunk_numel >= rt.world
        for round_ in rounds(self.owner, rt.world):
            if scatter and len(round_) >= rt.world - 1:
                sq += self._reduce_scatter_round(grads, round_, first, last)
            else:
                for i in round_:
                    sq += self._reduce_window(grads, i, first, last)
        return sq if last else None

    def _reduce_window(self, grads, i: int, first: bool, last: bool) -> float:
        """Window i's gradient summed into its owner (a reduce: gloo's AVG and bf16 sums are missing or slow
        in some torch versions, so fp32, SUM, then divided); the owner's sum of squares if last, else 0."""
        import torch.distributed as dist

        rt, (b, e) = self.rt, self.windows[i]
        buf = rt.staging.acquire(e - b, torch.float32, f"{self.unit.name} grad reduce")
        try:
            gather(grads, b, e, buf)
            t0 = time.perf_counter()
            rt.ranks.run("reduce", f"{self.unit.name} window {i}",
                         lambda: dist.reduce(buf, dst=self.owner[i], group=rt.ranks.grad))
            rt.telemetry.collective("reduce", buf.numel() * 4, time.perf_counter() - t0)
            return self._add_owned(i, buf.div_(rt.world), first, last) if self.owner[i] == rt.rank else 0.0
        finally:
            rt.staging.release(buf)

    def _reduce_scatter_round(self, grads, round_: list[int], first: bool, last: bool) -> float:
        """[Note: gradient reduce-scatter] The windows of one round (distinct owners) summed over the ranks,
        each into its owner: rank r's piece of every collective is its slice of the window r owns (zeros
        past that window's end, or where r owns none). The owner's sum of squares if last, else 0."""
        rt, world = self.rt, self.rt.world
        owned = {self.owner[i]: self.windows[i] for i in round_}  # rank -> (begin, end) of its window here
        longest = max(e - b for b, e in owned.values())
        step = min(rt.chunk_numel // world, longest)  # elements per piece: `world` pieces fill one pool chunk
        what = f"{self.unit.name} windows {round_[0]}-{round_[-1]}"
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
                        gather(grads, lo, hi, pieces[r * n:r * n + hi - lo])
                        pieces[r * n + hi - lo:(r + 1) * n].zero_()
                        real += hi - lo
                    t0 = time.perf_counter()
                    rt.ranks.run("reduce_scatter", what,
                                 lambda: reduce_scatter(total[at:at + n], pieces, world, rt.ranks.grad))
                    rt.telemetry.collective("reduce_scatter", 4 * real, time.perf_counter() - t0)  # no padding
            finally:
                rt.staging.release(flat)
            mine = [i for i in round_ if self.owner[i] == rt.rank]
            if not mine:
                return 0.0
            b, e = self.windows[mine[0]]
            return self._add_owned(mine[0], total[:e - b].div_(world), first, last)
        finally:
            rt.staging.release(total)

    def _add_owned(self, i: int, mean: torch.Tensor, first: bool, last: bool) -> float:
        """Owned window i's accumulator = mean (first micro-step) or += mean; its sum of squares if last."""
        if self.home != "nvme":
            acc = self.t["grad"][self.span(i)]
            acc.copy_(mean) if first else acc.add_(mean)
            return _sq(acc) if last else 0.0
        key = self.key("grad", i)
        if not first:
            acc = self.rt.staging.acquire(mean.numel(), torch.float32, f"{self.unit.name} grad")
            try:
                self.rt.store.read(key, into=acc).wait()
                mean.add_(acc)
            finally:
                self.rt.staging.release(acc)
        t0 = time.perf_counter()
        self.rt.store.write(key, mean).wait()
        self.rt.telemetry.link("dram_to_nvme", mean.numel() * 4, time.perf_counter() - t0)
        return _sq(mean) if last else 0.0

    def close(self) -> None:
        for w in self._win:
            self._drop(w)
        self._grads = None
        if self.home != "nvme":
            for kind in list(self.t):
                self.rt.tiers.free(self.home, self.t.pop(kind))
        self.state = HOME_STATE[self.home]


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


def _add_window(acc: torch.Tensor, grads, begin: int, end: int, first: bool) -> None:
    """acc (elements [begin, end) of the accumulator) = the gradients (first micro-step: a copy, gaps
    zeroed) or += them."""
    if first:
        gather(grads, begin, end, acc)
        return
    for offset, g in grads:
        b, e = max(offset, begin), min(offset + g.numel(), end)
        if b < e:
            acc[b - begin:e - begin].add_(g[b - offset:e - offset].to(acc.device))  # blocking: read next


def _sq(acc: torch.Tensor) -> float:
    return grad_sq_sum(acc) if acc.device.type == "cpu" else float(acc.double().square().sum())
