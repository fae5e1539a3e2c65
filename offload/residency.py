"""Residency: where a unit's weights and optimizer states are, as one enum and one transition table.

Each handle owns its state. Transition methods are named for the target, assert the source state, do
the work and set the new state last; an illegal transition raises. In-flight states keep their
completion (copy event or I/O ticket) together with the buffer it reads or writes, so the buffer cannot
be freed while a transfer still uses it.
"""

from __future__ import annotations

import enum
import threading
import time

import torch

from offload.tiers import Tiers
from offload.units import Unit


class Residency(enum.Enum):
    NVME = "nvme"
    NVME_TO_DRAM = "nvme->dram"
    DRAM = "dram"
    DRAM_TO_HBM = "dram->hbm"
    HBM = "hbm"
    DRAM_TO_NVME = "dram->nvme"


R = Residency
TRANSITIONS = {
    (R.NVME, R.NVME_TO_DRAM), (R.NVME_TO_DRAM, R.DRAM),
    (R.DRAM, R.DRAM_TO_HBM), (R.DRAM_TO_HBM, R.HBM),
    (R.HBM, R.DRAM), (R.HBM, R.NVME),          # release: drop the hbm copy, the home copy stays
    (R.DRAM, R.DRAM_TO_NVME), (R.DRAM_TO_NVME, R.NVME),
}
HOME_STATE = {"hbm": R.HBM, "dram": R.DRAM, "nvme": R.NVME}


class IllegalTransition(RuntimeError):
    pass


class _Handle:
    def __init__(self, name: str, home: str):
        self.name, self.home = name, home
        self.state = HOME_STATE[home]

    def _set(self, target: Residency, expect: Residency) -> None:
        if self.state is not expect or (expect, target) not in TRANSITIONS:
            raise IllegalTransition(f"{self.name}: {self.state.value} -> {target.value} (expected from {expect.value})")
        self.state = target


class WeightHandle(_Handle):
    """A unit's weights in the compute dtype. Home is hbm (persistent), dram, or nvme.

    The hbm buffer is one flat tensor whose storage is resized to zero when released and back when
    fetched: autograd saves views of that storage in forward, and sees the refilled bytes in backward.
    Parameters point at views of it while fetched and at an empty placeholder while released, so a user
    touching a released parameter gets an empty tensor, never freed memory.
    """

    def __init__(self, unit: Unit, home: str, dtype: torch.dtype, engine):
        super().__init__(f"{unit.name}/weight", home)
        self.unit, self.dtype, self.eng = unit, dtype, engine
        self.key = unit.key(f"weight.{str(dtype).removeprefix('torch.')}")
        tiers: Tiers = engine.tiers
        self.nbytes = unit.numel * dtype.itemsize
        self.hbm = tiers.empty("hbm", unit.numel, dtype, f"{unit.name} weights")
        self.dram = tiers.empty("dram", unit.numel, dtype, f"{unit.name} weights") if home == "dram" else None
        self._pending = None       # completion of the transfer in flight
        self._t0 = 0.0
        self._placeholder = torch.empty(0, dtype=dtype, device=self.hbm.device)
        self._write_lock = threading.Lock()
        self._update = None        # staging buffer the optimizer is filling
        self._write = None         # (ticket, buffer, t0) of the update written behind
        if home != "hbm":
            self._free_hbm()
            self._detach()

    # -- parameters ---------------------------------------------------------------------------------
    def _attach(self) -> None:
        for s in self.unit.slots:
            s.param.data = self.hbm[s.offset:s.offset + s.numel].view(s.shape)

    def _detach(self) -> None:
        for s in self.unit.slots:
            s.param.data = self._placeholder

    def _free_hbm(self) -> None:
        self.hbm.untyped_storage().resize_(0)
        self.eng.tiers.acct["hbm"].refund(self.nbytes)

    def _alloc_hbm(self) -> None:
        self.eng.tiers.acct["hbm"].charge(self.nbytes, f"{self.unit.name} weights")
        self.hbm.untyped_storage().resize_(self.nbytes)

    # -- fetch: home -> hbm ---------------------------------------------------------------------------
    def fetch(self) -> None:
        """Starts moving the weights towards hbm; idempotent (fetch_if_needed)."""
        if self.state is R.NVME:
            self._to_nvme_to_dram()
        elif self.state is R.DRAM:
            self._to_dram_to_hbm()

    def advance(self) -> None:
        """Moves an in-flight fetch one step on if its transfer finished (never blocks)."""
        if self.state in (R.NVME_TO_DRAM, R.DRAM_TO_HBM) and self._pending.done():
            self._finish_step()

    def wait_for_fetch(self) -> None:
        """Blocks until the weights are in hbm and the parameters point at them."""
        if self.state is R.HBM:
            return
        self.fetch()
        t0 = time.perf_counter()
        while self.state is not R.HBM:
            self._pending.wait()
            self._finish_step()
        self.eng.telemetry.stall(time.perf_counter() - t0, self.unit.name)

    def _to_nvme_to_dram(self) -> None:
        self.wait_for_write()  # an update written behind lands before it is read back
        self.dram = self.eng.staging.acquire(self.unit.numel, self.dtype, f"{self.unit.name} weights")
        self._pending, self._t0 = self.eng.store.read(self.key, into=self.dram), time.perf_counter()
        self._set(R.NVME_TO_DRAM, R.NVME)

    def _to_dram_to_hbm(self) -> None:
        self._alloc_hbm()
        self._pending, self._t0 = self.eng.h2d.copy(self.hbm, self.dram), time.perf_counter()
        self._set(R.DRAM_TO_HBM, R.DRAM)

    def _finish_step(self) -> None:
        self._pending.wait()
        self._pending = None
        if self.state is R.NVME_TO_DRAM:
            self.eng.telemetry.link("nvme_to_dram", self.nbytes, time.perf_counter() - self._t0)
            self._set(R.DRAM, R.NVME_TO_DRAM)
            self._to_dram_to_hbm()
        else:
            self.eng.telemetry.link("dram_to_hbm", self.nbytes, time.perf_counter() - self._t0)
            if self.home == "nvme":
                self.eng.staging.release(self.dram)
                self.dram = None
            self._attach()
            self._set(R.HBM, R.DRAM_TO_HBM)

    # -- release: hbm -> home -------------------------------------------------------------------------
    def release(self) -> None:
        """Drops the hbm copy (the home copy is current); a no-op for hbm-resident weights."""
        if self.home == "hbm":
            return
        if self.state in (R.NVME_TO_DRAM, R.DRAM_TO_HBM):
            self.wait_for_fetch()
        if self.state is R.HBM:
            self._detach()
            self._free_hbm()
            self._set(HOME_STATE[self.home], R.HBM)

    # -- new weights from the optimizer ----------------------------------------------------------------
    # -- new weights from the optimizer (on the d2h thread when the step overlaps backward) ------------
    # [Note: updates beside residency]
    # The optimizer writes a unit's new weights to its home copy while the hbm copy may still be attached
    # (the unit's backward is over once its gradients are final, but units are released when backward()
    # ends, and a step outside backward first releases every fetched copy, kept ones included: see
    # Engine._release_all). So an update never changes the residency state: dram homes and the CPU backend's hbm are
    # written in place (the trainable prefix only; frozen weights are never written), an nvme home through
    # a staging buffer written behind, which the next fetch waits for before it reads.
    def home_buffer(self) -> torch.Tensor:
        """The flat host buffer the optimizer writes new weights into; then call `commit_home()`."""
        if self.home == "dram":
            return self.dram
        if self.home == "hbm" and self.hbm.device.type == "cpu":
            return self.hbm
        with self._write_lock:
            self._wait_write_locked()
            buf = self.eng.staging.acquire(self.unit.numel, self.dtype, f"{self.unit.name} new weights")
            if self.home == "nvme" and self.unit.trainable_numel < self.unit.numel:
                self.eng.store.read(self.key, into=buf).wait()  # the frozen tail is written back unchanged
            self._update = buf
            return buf

    def commit_home(self) -> None:
        """After the optimizer filled `home_buffer()`: nvme weights are written behind; accelerator-resident
        ones are copied up (the trainable prefix)."""
        with self._write_lock:
            buf, self._update = self._update, None
            if buf is None:
                return
            if self.home == "nvme":
                self._write = (self.eng.store.write(self.key, buf), buf, time.perf_counter())
                return
            n = self.unit.trainable_numel
            self.eng.h2d.copy(self.hbm[:n], buf[:n]).wait()
            self.eng.staging.release(buf)

    def wait_for_write(self) -> None:
        with self._write_lock:
            self._wait_write_locked()

    def _wait_write_locked(self) -> None:
        if self._write is not None:
            ticket, buf, t0 = self._write
            ticket.wait()
            self.eng.telemetry.link("dram_to_nvme", self.nbytes, time.perf_counter() - t0)
            self.eng.staging.release(buf)
            self._write = None

    def close(self) -> None:
        if self.state in (R.NVME_TO_DRAM, R.DRAM_TO_HBM):
            self._pending.wait()
        self.wait_for_write()
