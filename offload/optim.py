"""Optimizer states per unit and the step over them.

Each trainable unit has four fp32 flats over its trainable prefix: master, exp_avg, exp_avg_sq and the
gradient accumulator. Their home is hbm, dram or nvme. On nvme they are staged through dram buffers:
the step reads unit j+1's states while CPU Adam updates unit j and unit j-1's are written back
(read-ahead / write-behind), and CPU Adam writes the new weights in the compute dtype straight into
the buffer that goes to the weight tier.
"""

from __future__ import annotations

import time

import torch

from offload.cpu_adam import grad_sq_sum
from offload.residency import HOME_STATE, R, _Handle
from offload.units import Unit
from swap.store import tensor_digests

KINDS = ("master", "exp_avg", "exp_avg_sq", "grad")
STATES = KINDS[:3]  # what a read-ahead loads: the gradient may not be final yet


class OptimState(_Handle):
    """One unit's fp32 states. Resident (hbm/dram) states are allocated once; nvme ones are staged."""

    def __init__(self, unit: Unit, home: str, engine):
        super().__init__(f"{unit.name}/optim", home)
        self.unit, self.eng = unit, engine
        self.numel = unit.trainable_numel
        self.t: dict[str, torch.Tensor] = {}
        self._tickets: list = []
        self._t0 = 0.0
        self._grad: torch.Tensor | None = None  # nvme: a final gradient kept in dram for the step
        self.grad_dtype = torch.float32          # what the accumulator holds: see accumulate()
        # [Note: swap digests in the step] (offload/csrc/cpu_adam.cpp): with swap checksums on, the step
        # hashes the states it reads and writes, so they are read unverified and checked after it.
        # [Note: parameters without a gradient]
        # torch's optimizers skip a parameter whose .grad is None: no decay, no moment update, and its own
        # step count (bias correction) does not advance. So each trainable slot counts its steps, the
        # accumulator notes which slots received a gradient in the accumulation window, and the step
        # updates only those (see engine.step_unit); in the common case that is one run over all.
        self.slots = sorted((s for s in unit.slots if s.trainable), key=lambda s: s.offset)
        self.slot_steps = [0] * len(self.slots)
        self._slot_at = {s.offset: i for i, s in enumerate(self.slots)}
        self.got_grad: set[int] = set()           # slot indices with a gradient in this window
        self.digest_bounds = None
        if home == "nvme" and engine.store.checksum:
            self.digest_bounds = engine.store.digest_bounds(self.numel, 4)
        self._unverified: set[str] = set()       # kinds read without the store's check, until the step's
        self._digests: dict[str, tuple] = {}     # kind -> block digests of the updated state, for store()
        if home != "nvme":
            for kind in KINDS:
                self.t[kind] = engine.tiers.empty(home, self.numel, torch.float32, f"{unit.name} {kind}").zero_()

    def key(self, kind: str) -> str:
        return self.unit.key(kind, self.eng.rank)

    # -- nvme staging -------------------------------------------------------------------------------
    def load(self, kinds=KINDS) -> None:
        """Starts reading `kinds` into dram staging buffers (missing keys read as zeros)."""
        if self.home != "nvme" or self.state is not R.NVME:
            return
        for kind in kinds:
            if kind == "grad" and self._grad is not None:
                continue
            buf = self.eng.staging.acquire(self.numel, torch.float32, f"{self.unit.name} {kind}")
            self.t[kind] = buf
            if self.key(kind) in self.eng.store:  # exp_avg/exp_avg_sq start as zeros, unwritten
                verify = self.digest_bounds is None or kind not in STATES
                self._tickets.append(self.eng.store.read(self.key(kind), into=buf, verify=verify))
                if not verify:
                    self._unverified.add(kind)
            else:
                buf.zero_()
        self._t0 = time.perf_counter()
        self._set(R.NVME_TO_DRAM, R.NVME)

    def wait_loaded(self) -> None:
        if self.home != "nvme" or self.state is R.DRAM:
            return
        if self.state is R.NVME:
            self.load()
        for t in self._tickets:
            t.wait()
        self.eng.telemetry.link("nvme_to_dram", 4 * self.numel * len(self._tickets), time.perf_counter() - self._t0)
        self._tickets = []
        if "grad" not in self.t:
            if self._grad is not None:
                self.t["grad"], self._grad = self._grad, None
            else:
                self.t["grad"] = self.eng.staging.acquire(self.numel, torch.float32, f"{self.unit.name} grad")
                self.eng.store.read(self.key("grad"), into=self.t["grad"]).wait()
        self._set(R.DRAM, R.NVME_TO_DRAM)

    def grad(self) -> torch.Tensor:
        """The window's gradient as the step reads it: the fp32 accumulator, or (one micro-step, low
        precision) the backward's own gradient in the first half of its bytes."""
        return self._as_grad(self.t["grad"])

    def _as_grad(self, buf: torch.Tensor) -> torch.Tensor:
        """The fp32 accumulator buffer `buf` as the window's gradient dtype (see accumulate())."""
        return buf if self.grad_dtype == torch.float32 else buf.view(self.grad_dtype)[:self.numel]

    def runs(self) -> list[tuple[int, int, int]]:
        """(begin, end, step) element ranges of the trainable prefix to update now, each with the 1-based
        step count of its slots; a slot's range runs to the next slot (its padding included)."""
        ends = [s.offset for s in self.slots[1:]] + [self.numel]
        out: list[list[int]] = []
        for i, (slot, end) in enumerate(zip(self.slots, ends)):
            if i not in self.got_grad:
                continue
            step = self.slot_steps[i] + 1
            if out and out[-1][1] == slot.offset and out[-1][2] == step:
                out[-1][1] = end
            else:
                out.append([slot.offset, end, step])
        return [tuple(r) for r in out]

    def hash_states(self) -> tuple[tuple[int, ...], ...]:
        """Swap digests of the staged master/exp_avg/exp_avg_sq (when the step cannot hash them itself)."""
        return tuple(tensor_digests(self.t[k], self.digest_bounds) for k in STATES)

    def count_steps(self) -> None:
        """After the update: the slots that had a gradient advanced one step."""
        for i in self.got_grad:
            self.slot_steps[i] += 1

    def check_digests(self, digests) -> None:
        """After the step hashed the states (cpu_adam.StepDigests): raises SwapCorruptionError if what was
        read differs from what was written; keeps the new states' digests for store()."""
        for kind, before, after in zip(STATES, digests.before, digests.after):
            if kind in self._unverified:
                self.eng.store.check_digests(self.key(kind), before)
            self._digests[kind] = after
        self._unverified.clear()

    def store(self, kinds=STATES) -> None:
        """Starts writing `kinds` back (write-behind); the other staged kinds are dropped."""
        if self.home != "nvme":
            return
        if self._unverified:  # an invariant, not user input: unchecked bytes must never be written back
            raise RuntimeError(f"{self.name}: {sorted(self._unverified)} read unverified and not checked by a step")
        for kind in [k for k in self.t if k not in kinds]:
            self.eng.staging.release(self.t.pop(kind))
        self._tickets = [self.eng.store.write(self.key(kind), self.t[kind], digests=self._digests.pop(kind, None))
                         for kind in kinds]
        self._t0 = time.perf_counter()
        self._set(R.DRAM_TO_NVME, R.DRAM)

    def wait_stored(self) -> None:
        if self.home != "nvme" or self.state is not R.DRAM_TO_NVME:
            return
        for t in self._tickets:
            t.wait()
        self.eng.telemetry.link("dram_to_nvme", 4 * self.numel * len(self._tickets), time.perf_counter() - self._t0)
        self._tickets = []
        for kind in list(self.t):
            self.eng.staging.release(self.t.pop(kind))
        self._set(R.NVME, R.DRAM_TO_NVME)

    # -- the gradient accumulator (runs on the d2h copy thread) --------------------------------------
    def accumulate(self, grads: list[tuple[int, torch.Tensor]], first: bool, last: bool,
                   keep: bool = False) -> float | None:
        """Adds this micro-step's gradients (offset, flat grad) into the fp32 accumulator; on the last
        micro-step returns its sum of squares (for the global norm and fp16 overflow detection).
        keep: an nvme accumulator stays in dram for the step that follows at once (no round trip).
        A window of one micro-step in bf16/fp16 (the common case) keeps the gradient in its own dtype in
        the accumulator's first bytes: the step casts it as it reads it (the same fp32 values), and the
        copy's writes, the sum of squares and the step's gradient reads each move half the bytes."""
        if self.home == "nvme":
            buf = self.eng.staging.acquire(self.numel, torch.float32, f"{self.unit.name} grad")
            if not first:
                self.eng.store.read(self.key("grad"), into=buf).wait()
        else:
            buf = self.t["grad"]
        if first:
            dtype = grads[0][1].dtype if grads else torch.float32
            own = last and dtype != torch.float32 and buf.device.type == "cpu" and (self.home != "nvme" or keep)
            self.grad_dtype = dtype if own else torch.float32
        acc = self._as_grad(buf)
        if first:  # the first micro-step's gradients are copied in (a cast); only the gaps are zeroed
            self.got_grad = set()
            end = 0
            for offset, g in sorted(grads, key=lambda og: og[0]):
                acc[end:offset].zero_()
                end = offset + g.numel()
            acc[end:].zero_()
        self.got_grad.update(self._slot_at[offset] for offset, _ in grads)
        for offset, g in grads:
            dst = acc[offset:offset + g.numel()]
            dst.copy_(g) if first else dst.add_(g.to(acc.device))  # blocking: the add reads it next
        sq = None
        if last:
            sq = grad_sq_sum(acc) if acc.device.type == "cpu" else float(acc.double().square().sum())
        if self.home == "nvme" and keep:
            self._grad = buf
        elif self.home == "nvme":
            t0 = time.perf_counter()
            self.eng.store.write(self.key("grad"), buf).wait()
            self.eng.telemetry.link("dram_to_nvme", buf.numel() * 4, time.perf_counter() - t0)
            self.eng.staging.release(buf)
        return sq

    def close(self) -> None:
        for t in self._tickets:
            t.wait()
        self._tickets = []
        self._unverified.clear()
        self._digests.clear()
        if self.home == "nvme":
            for kind in list(self.t):
                self.eng.staging.release(self.t.pop(kind))
            if self._grad is not None:
                self.eng.staging.release(self._grad)
                self._grad = None
        else:
            for kind in list(self.t):
                self.eng.tiers.free(self.home, self.t.pop(kind))
        self.state = HOME_STATE[self.home]
