"""Optimizer states per unit, in windows of one chunk each.

Each trainable unit has four fp32 flats over its trainable prefix: master, exp_avg, exp_avg_sq and the
gradient accumulator. Their home is hbm, dram or nvme. The step runs over windows of chunk_numel
elements (offload.plan.chunks): resident states are viewed in place; nvme states are staged window by window
through pool chunks (one swap key per kind and chunk), the step reading window j+1 ahead while CPU Adam
updates window j and window j-1 is written back, so the optimizer's dram is a few chunks at any model size.
With optimizer.states "int8" ([Note: int8 optimizer states] in offload/kernels/quant8.py) a window's
moments are codes and scales instead: exp_avg and exp_avg_sq one byte an element, "absmax" the fp32 scales
of both (m's blocks, then v's), and "small_m", "small_v" the fp32 m and v of the elements of small parameters in it
(layout(i) says what window i holds); they are read, stepped and written as such in every tier. With
optimizer.master "split" ([Note: split master] in offload/kernels/split.py) the master kind holds each
element's record (uint8, split.record_bytes), the fp32 master being the working weight joined with it.
What fills the accumulator (and over ranks reduce-scatters into it) is the gradient path's:
offload.step.accumulator; what checks the swap digests of a step is the step's: offload.step.windows.
"""

from __future__ import annotations

import time

import torch

from offload.kernels.quant8 import BLOCK
from offload.kernels.split import record_bytes
from offload.plan.chunks import chunk_key, chunk_spans, copy_spans, packed
from offload.plan.units import Unit
from offload.state import moments
from offload.state.residency import R, _Handle
from offload.state.runtime import Runtime

KINDS = ("master", "exp_avg", "exp_avg_sq", "grad")
STATES = KINDS[:3]  # what a read-ahead loads: the gradient may not be final yet
INT8_KINDS = ("master", "exp_avg", "exp_avg_sq", "absmax", "small_m", "small_v")  # a window's states, int8 moments


class StagedWindow(_Handle):
    """One chunk of an nvme unit's states in dram: its pool chunks per kind and the I/O in flight. Its
    transitions are named: reading (nvme -> dram), to_dram, writing (dram -> nvme), and drop (home again)."""

    def __init__(self, name: str):
        super().__init__(name, "nvme")
        self.t: dict[str, torch.Tensor] = {}
        self.tickets: list = []
        self.nbytes = 0                         # bytes of the reads in flight
        self.t0 = 0.0
        self.unverified: set[str] = set()       # kinds read without the store's check, until the step's
        self.base: torch.Tensor | None = None   # int8 moments: the one chunk their codes and scales share
        self.digests: dict[str, tuple] = {}     # kind -> block digests of the updated state, for store()

    def reading(self) -> None:
        self.t0 = time.perf_counter()
        self._set(R.NVME_TO_DRAM, R.NVME)

    def to_dram(self) -> None:
        self.tickets = []
        self._set(R.DRAM, R.NVME_TO_DRAM)

    def writing(self) -> None:
        self.t0 = time.perf_counter()
        self._set(R.DRAM_TO_NVME, R.DRAM)

    def checked(self, digests: dict[str, tuple]) -> None:
        """The step checked what was read unverified; `digests` (kind -> block digests of the updated
        state) go with the write-back."""
        self.unverified.clear()
        self.digests.update(digests)

    def drop(self, staging) -> None:
        """Settles the window's I/O and returns its chunks to `staging` (the pool); the window is at home
        (nvme) again."""
        for t in self.tickets:
            try:
                t.wait()
            except Exception:  # reported by whoever waited first (an interrupt is not held back)
                pass
        self.tickets = []
        for kind in list(self.t):
            self.release(kind, staging)
        if self.base is not None:  # taken before any of its views was (a load that failed at its start)
            staging.release(self.base)
            self.base = None
        self.unverified.clear()
        self.digests.clear()
        self.to_home()

    def release(self, kind: str, staging) -> None:
        """`kind`'s chunk back to `staging`; the codes and scales sharing one go back with the last of them."""
        t = self.t.pop(kind)
        if self.base is None or kind not in moments.SHARED:
            staging.release(t)
        elif not any(k in self.t for k in moments.SHARED):
            staging.release(self.base)
            self.base = None


class OptimState(_Handle):
    """One unit's states (fp32, or int8 moments). Resident (hbm/dram) states are allocated once; nvme ones are
    staged by window."""

    def __init__(self, unit: Unit, home: str, rt: Runtime):
        super().__init__(f"{unit.name}/optim", home)
        self.unit, self.rt = unit, rt
        self.numel = unit.trainable_numel
        self.chunks = chunk_spans(self.numel, rt.chunk_numel)  # [begin, end) elements of each window
        # [Note: windows over ranks] zero_stage 1-3 over several ranks: this rank holds and steps the
        # windows it owns (offload.plan.chunks.window_owners); every rank passes every window's gradient to its
        # owner (offload.step.accumulator) and receives every other window's new weights from it
        # (offload.step.pipeline.share_new_weights). Resident states hold the owned windows back to back.
        self.owner = rt.settings.owners.get(unit.index) or [rt.rank] * len(self.chunks)
        self.mine = [i for i, r in enumerate(self.owner) if r == rt.rank]
        self._local, self.local_numel = packed(self.chunks, self.mine)  # window -> first element in the flats
        self.t: dict[str, torch.Tensor] = {}    # resident homes: the four flats of the owned windows
        self._staged = ([StagedWindow(f"{unit.name}/optim#{i}") for i in range(len(self.chunks))]
                        if home == "nvme" else [])
        self._grads: list | None = None           # nvme, overlapped step: this backward's gradients, read by window
        self.grad_dtype = torch.float32          # what the accumulator holds: see offload.step.accumulator
        # With swap checksums on, the step hashes the states it reads and writes, so they are read unverified
        # and checked after it ([Note: swap digests in the step] in offload/kernels/csrc/cpu_adam.cpp; the
        # check: offload.step.windows.WindowCheck).
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
        self.int8 = rt.settings.optimizer.states == "int8"
        self.split = rt.settings.optimizer.master == "split"
        self.state_kinds = INT8_KINDS if self.int8 else STATES  # a window's states, the gradient aside
        # int8: per window, (begin, end, offset in small_m/small_v) of its small parameters' elements
        self.small = [moments.small_ranges(self.slots, self.numel, b, e, unit.name) if self.int8 else []
                      for b, e in self.chunks]
        self.window_at = {b: i for i, (b, _) in enumerate(self.chunks)}
        self.kspans: dict[str, dict[int, slice]] = {}  # resident homes: kind -> owned window -> where in its flat
        if home != "nvme":
            for kind in (*self.state_kinds, "grad"):
                spans, total, dtype = {}, 0, torch.float32
                for i in self.mine:
                    numel, dtype = self.layout(i).get(kind, (0, dtype))
                    spans[i], total = slice(total, total + numel), total + numel
                self.kspans[kind] = spans
                self.t[kind] = moments.blank(self.int8, kind, rt.tiers.empty(home, total, dtype, f"{unit.name} {kind}"))

    # -- layout -------------------------------------------------------------------------------------
    def layout(self, i: int) -> dict[str, tuple[int, torch.dtype]]:
        """kind -> (numel, dtype) of window i: its states, then its gradient (small_m, small_v only where it has
        small parameters' elements; a split master's record as bytes); none is larger than the window's fp32
        master (a pool chunk)."""
        b, e = self.chunks[i]
        n = e - b
        master = (record_bytes(n), torch.uint8) if self.split else (n, torch.float32)
        if not self.int8:
            return {"master": master, **{k: (n, torch.float32) for k in STATES[1:]}, "grad": (n, self.grad_dtype)}
        side = sum(hi - lo for lo, hi, _ in self.small[i])
        out = {"master": master, "exp_avg": (n, torch.uint8), "exp_avg_sq": (n, torch.uint8),
               "absmax": (2 * (n // BLOCK), torch.float32)}
        if side:
            out["small_m"] = out["small_v"] = (side, torch.float32)
        return {**out, "grad": (n, self.grad_dtype)}

    def key(self, kind: str, i: int) -> str:
        return chunk_key(self.unit.key(kind, self.rt.rank), i)

    # -- windows ------------------------------------------------------------------------------------
    def loaded(self, i: int) -> bool:
        return self.home != "nvme" or self._staged[i].state is not R.NVME

    def staged(self, i: int) -> StagedWindow:
        """Window i of nvme states as staged in dram (its chunks, I/O and digests)."""
        return self._staged[i]

    def span(self, i: int) -> slice:
        """Where owned window i lies in the resident flats of the master and the gradient."""
        b, e = self.chunks[i]
        return slice(self._local[i], self._local[i] + e - b)

    def view(self, i: int) -> dict[str, torch.Tensor]:
        """Window i's states, kind -> tensor (after wait_loaded(i)): master, exp_avg, exp_avg_sq (and with int8
        moments absmax, small_m, small_v)."""
        if self.home != "nvme":
            return {k: self.t[k][self.kspans[k][i]] for k in self.layout(i) if k != "grad"}
        return {k: t for k, t in self._staged[i].t.items() if k != "grad"}

    def grad(self, i: int) -> torch.Tensor:
        """Window i's gradient as the step reads it: the fp32 accumulator, or (one micro-step, low
        precision) the backward's own gradient dtype; for nvme states with an overlapped step, copied
        from this backward's gradients into a pool chunk that store(i) returns."""
        if self.home != "nvme":
            return self.accumulator()[self.span(i)]
        b, e = self.chunks[i]
        w = self._staged[i]
        if "grad" not in w.t:  # read ahead without it: from this backward's gradients, or the accumulator
            buf = w.t["grad"] = self.rt.staging.acquire(e - b, self.grad_dtype, f"{self.unit.name} grad")
            if self._grads is not None:
                copy_spans(self._grads, b, e, buf)
            else:
                self.rt.store.read(self.key("grad", i), into=buf).wait()
        return w.t["grad"]

    def accumulator(self) -> torch.Tensor:
        """A resident home's accumulator flat as the gradient dtype: fp32, or in its first bytes the
        backward's own dtype (offload.step.accumulator)."""
        buf = self.t["grad"]
        return buf if self.grad_dtype == torch.float32 else buf.view(self.grad_dtype)[:buf.numel()]

    def hold_gradients(self, grads: list) -> None:
        """nvme states, one micro-step, overlapped step: the step reads window i's gradient from this backward's
        (offset, flat grad) pieces (grad(i)), which the caller keeps alive until the unit is stepped."""
        self._grads = list(grads)

    def note_gradients(self, offsets, first: bool) -> None:
        """The slots at element `offsets` received a gradient in this accumulation window (first: a new one)."""
        if first:
            self.got_grad = set()
        self.got_grad.update(self._slot_at[offset] for offset in offsets)

    def runs(self, i: int) -> list[tuple[int, int, int]]:
        """(begin, end, step) element ranges of window i (relative to it) to update now, each with the
        1-based step count of its slots; a slot's range runs to the next slot (its padding included)."""
        wb, we = self.chunks[i]
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

    def drop_gradients(self) -> None:
        """A rolled-back micro-step: this backward's gradients are no longer read (the next first
        micro-step overwrites the accumulator)."""
        self._grads = None

    def count_steps(self) -> None:
        """After the update of every window: the slots that had a gradient advanced one step."""
        for k in self.got_grad:
            self.slot_steps[k] += 1
        self._grads = None

    # -- nvme staging -------------------------------------------------------------------------------
    def load(self, i: int, kinds=KINDS) -> None:
        """Starts reading window i's states, and its gradient if "grad" is in `kinds`, into pool chunks
        (missing keys read as zeros)."""
        if self.home != "nvme" or self._staged[i].state is not R.NVME:
            return
        w, layout = self._staged[i], self.layout(i)
        try:
            w.nbytes = 0
            w.base, shared = moments.shared_views(self.rt.staging, layout, self.int8, self.unit.name)
            for kind, (numel, dtype) in layout.items():  # the gradient's dtype: see offload.step.accumulator
                if kind == "grad" and kind not in kinds:
                    continue
                buf = shared.get(kind)  # w.t holds chunks only: a stop signal may land inside acquire
                if buf is None:
                    buf = self.rt.staging.acquire(numel, dtype, f"{self.unit.name} {kind}")
                w.t[kind] = buf
                key = self.key(kind, i)
                if key in self.rt.store:  # the moments start as zeros, unwritten
                    verify = not self.hashed or kind == "grad"
                    w.tickets.append(self.rt.store.read(key, into=buf, verify=verify))
                    w.nbytes += buf.numel() * buf.element_size()
                    if not verify:
                        w.unverified.add(kind)
                else:
                    moments.blank(self.int8, kind, buf)
        except BaseException:
            w.drop(self.rt.staging)
            raise
        w.reading()

    def wait_loaded(self, i: int) -> None:
        if self.home != "nvme" or self._staged[i].state is R.DRAM:
            return
        if self._staged[i].state is R.NVME:
            self.load(i, STATES if self._grads is not None else KINDS)
        w = self._staged[i]
        try:
            for t in w.tickets:
                t.wait()
        except BaseException:
            w.drop(self.rt.staging)
            raise
        self.rt.telemetry.link("nvme_to_dram", w.nbytes, time.perf_counter() - w.t0)
        w.to_dram()

    def store(self, i: int, kinds=None) -> None:
        """Starts writing window i's `kinds` (default: its states) back (write-behind); its other chunks
        return to the pool."""
        if self.home != "nvme":
            return
        kinds = [k for k in self.layout(i) if k != "grad"] if kinds is None else kinds
        w = self._staged[i]
        if w.unverified:  # an invariant, not user input: unchecked bytes must never be written back
            raise RuntimeError(f"{w.name}: {sorted(w.unverified)} read unverified and not checked by a step")
        for kind in [k for k in w.t if k not in kinds]:
            w.release(kind, self.rt.staging)
        w.tickets = []
        w.nbytes = sum(w.t[k].numel() * w.t[k].element_size() for k in kinds)
        for kind in kinds:  # one by one: if a write raises, those already in flight are settled by drop
            w.tickets.append(self.rt.store.write(self.key(kind, i), w.t[kind], digests=w.digests.pop(kind, None)))
        w.writing()

    def wait_stored(self, i: int) -> None:
        if self.home != "nvme" or self._staged[i].state is not R.DRAM_TO_NVME:
            return
        w = self._staged[i]
        try:
            for t in w.tickets:
                t.wait()
            self.rt.telemetry.link("dram_to_nvme", w.nbytes, time.perf_counter() - w.t0)
        finally:
            w.drop(self.rt.staging)

    def discard(self, i: int) -> None:
        """Window i's staged chunks go back to the pool unwritten (after a failed step)."""
        if self.home == "nvme":
            self._staged[i].drop(self.rt.staging)

    def close(self) -> None:
        for w in self._staged:
            w.drop(self.rt.staging)
        self._grads = None
        if self.home != "nvme":
            for kind in list(self.t):
                self.rt.tiers.free(self.home, self.t.pop(kind))
        self.to_home()
