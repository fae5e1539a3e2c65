"""Where the inputs the engine's activation checkpoints keep wait for their backward: in hbm where the forward
made them, or in dram, or on nvme (config offload_activations).
"""

from __future__ import annotations

import enum
import threading
import time
import weakref

import torch

from offload.state.runtime import Runtime

# [Note: kept inputs in a tier]
# UnitInputs (offload.step.activations) is the one saved-tensor hook through which every checkpointed unit's inputs
# are saved. With offload_activations "cpu" or "nvme" its pack hands each input worth moving to InputTier.pack,
# which leaves autograd a record (KeptInput) in the tensor's place:
# - out, as the forward makes it: a dram tensor from the tiers (pinned on CUDA, charged to dram) receives the
#   copy on the d2h copy stream; the record holds the source until that copy completed (on CUDA: its event
#   passed; nothing in the forward waits for it, the next pack finds it done), then the hbm tensor is the
#   forward's alone to free. "nvme": once in dram, the bytes go to the run's swap store, written straight from
#   that dram tensor (no chunk of the pool), which is released when the write completed. So dram holds the
#   inputs whose copy or write is in flight; where the dram budget has no room for one more, pack waits for the
#   oldest write first.
# - back, in the reverse order of their packing (the order of the backward that needs them): when
#   engine.backward begins (ahead_of_backward) and when a unit's inputs are unpacked (its recompute starts the
#   unit's backward), the inputs of the next `ahead` units in that order are fetched, as long as hbm has room:
#   nvme -> a fresh dram tensor -> hbm on the h2d copy stream, charged to hbm. unpack fetches its own if it was
#   not, and waits for it (a stall: the compute waits; on CUDA only the compute stream waits for the last copy).
# - freed when autograd lets go of the record (after the unit's backward, or with a graph dropped without a
#   backward): a finalizer queues it, and the next pack, unpack, backward or stats() settles its transfers and
#   returns its bytes (dram, the hbm charge, its swap extent). drop_all() frees every record at once (a failed
#   backward, close()); a dropped record's unpack raises.
# What stays in hbm, as without a tier: an input under MOVE_MIN_BYTES (one page, the swap store's grain), a
# non-contiguous one (a contiguous copy would change its strides, so the recompute's kernels), one not in hbm,
# and one whose storage an input of another unit still holds (the rotary tables every layer takes: moving it
# frees nothing). An input sharing its storage with a tensor alive elsewhere (the batch, the residual stream a
# layer norm outside the units saves too) is moved all the same: correct, only it frees no hbm.
# A dram buffer an input no longer needs (its write to nvme or its copy back to hbm completed) is kept, still
# charged to dram, for the next input of its size (`spare`): on CUDA a page-locked buffer costs a registration
# and on the CPU a fresh one its page faults, every input of every step. The spare buffers hold at most the most
# bytes the moved inputs held in dram at once (the oldest go first); drop_all() of everything returns them.
# One lock serializes the hooks (the compute thread; on CUDA autograd's device thread in the backward) and
# stats() (a sampler thread of `offload train`); finalizers, which run on whatever thread collects, only queue.

MOVE_MIN_BYTES = 4096  # an input smaller than a page stays where it was made (module note)
TIERS = {"cpu": "dram", "nvme": "nvme"}  # offload_activations.device -> the tier the inputs wait in


class S(enum.Enum):
    OUT = "hbm -> dram"          # the d2h copy in flight (the source held)
    DRAM = "dram"
    TO_NVME = "dram -> nvme"     # the swap write in flight
    NVME = "nvme"
    FROM_NVME = "nvme -> dram"   # the swap read in flight
    IN = "dram -> hbm"           # the h2d copy in flight
    HBM = "hbm"                  # back, for its backward
    DROPPED = "dropped"


class KeptInput:
    """One moved input: where it is (`state`), the transfer in flight (`done`) and what holds its bytes."""

    __slots__ = ("seq", "unit", "shape", "dtype", "nbytes", "state", "done", "src", "dram", "hbm", "on_disk", "t0",
                 "error")

    def __init__(self, seq: int, unit: int, t: torch.Tensor):
        self.seq, self.unit, self.shape, self.dtype = seq, unit, t.shape, t.dtype
        self.nbytes = t.numel() * t.element_size()
        self.state, self.done, self.t0 = S.OUT, None, time.perf_counter()
        self.src = self.dram = self.hbm = None
        self.on_disk = False
        self.error: BaseException | None = None  # its transfer failed: raised again by its unpack

    @property
    def key(self) -> str:
        return f"activations/{self.seq}"


def _movable(t: torch.Tensor, hbm: torch.device) -> bool:
    """Worth moving as a tensor: a page or more, contiguous, in hbm (module note)."""
    return t.numel() * t.element_size() >= MOVE_MIN_BYTES and t.is_contiguous() and t.device.type == hbm.type


class StorageHolders:
    """The storages of the inputs asked to move: address -> (unit, a weak reference to the input holding it)."""

    def __init__(self):
        self.by_address: dict[int, tuple[int, weakref.ref]] = {}

    def claim(self, unit: int, t: torch.Tensor) -> bool:
        """Records `t` as its storage's holder; False, recording nothing, where an input of another unit holds
        that storage alive (the rotary tables every layer takes): moving `t` would free nothing."""
        addr = t.untyped_storage().data_ptr()
        held = self.by_address.get(addr)
        other = held[1]() if held is not None else None
        if other is not None and held[0] != unit and other.untyped_storage().data_ptr() == addr:
            return False
        self.by_address = {a: h for a, h in self.by_address.items() if h[1]() is not None}
        self.by_address[addr] = (unit, weakref.ref(t))
        return True


class SpareBuffers:
    """Dram buffers the moved inputs no longer need, by size, kept (still charged to dram) for the next input of
    their size (module note); `tiers` frees them."""

    def __init__(self, tiers):
        self.tiers = tiers
        self.by_size: dict[int, list[torch.Tensor]] = {}  # nbytes -> dram buffers (uint8), the oldest first
        self.total_bytes = 0

    def has(self, nbytes: int) -> bool:
        return bool(self.by_size.get(nbytes))

    def take(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """The newest spare of `nbytes`, viewed as `dtype` (has(nbytes) first)."""
        self.total_bytes -= nbytes
        return self.by_size[nbytes].pop().view(dtype)

    def put(self, buf: torch.Tensor, nbytes: int) -> None:
        self.by_size.setdefault(nbytes, []).append(buf.view(torch.uint8))
        self.total_bytes += nbytes

    def release(self, keep_bytes: int) -> None:
        """Frees spares, the oldest of a size first, until they hold at most `keep_bytes`."""
        while self.total_bytes > max(keep_bytes, 0):
            nbytes = next(n for n, bufs in self.by_size.items() if bufs)
            self.tiers.free("dram", self.by_size[nbytes].pop(0))
            self.total_bytes -= nbytes


class InputTier:
    """The checkpointed units' kept inputs in `device`'s tier ("cpu": dram, "nvme"), on runtime `rt` (tiers,
    copy streams, swap store, telemetry); `ahead`: units whose inputs are fetched ahead of the backward."""

    def __init__(self, rt: Runtime, device: str, ahead: int):
        self.rt, self.where, self.ahead = rt, TIERS[device], max(1, ahead)
        self.live: dict[int, KeptInput] = {}  # seq -> record, in the order of packing
        self._dead: list[KeptInput] = []      # let go by autograd, to free at the next safe point
        self.holders = StorageHolders()       # which unit's input holds each storage asked to move
        self._seq = 0
        self._lock = threading.RLock()
        self.held = {"hbm": 0, "dram": 0, "nvme": 0}  # bytes of moved inputs in each tier now (hbm: source or back)
        self.peak = dict(self.held)
        self.out_bytes = self.in_bytes = 0    # moved out of hbm, and back into it
        self.stayed_bytes = 0                 # kept in hbm, not worth moving (module note)
        self.wait_s = 0.0                     # unpack waiting for its input
        self.spares = SpareBuffers(rt.tiers)  # dram buffers kept for the next inputs of their size

    # -- the saved-tensor hooks' side --------------------------------------------------------------------
    def pack(self, unit: int, t: torch.Tensor) -> KeptInput | None:
        """Starts moving `t` out of hbm; None: it stays (module note)."""
        with self._lock:
            self._collect()
            self._advance_all()
            if not (_movable(t, self.rt.tiers.hbm_device) and self.holders.claim(unit, t)):
                self.stayed_bytes += t.numel() * t.element_size()
                return None
            self._seq += 1
            rec = KeptInput(self._seq, unit, t)
            rec.dram = self._dram(rec, f"kept input of unit {unit}")
            rec.src = t.detach()  # a copy job must not record autograd history
            rec.done = self.rt.d2h.copy(rec.dram.view(rec.shape), rec.src)
            self._hold("hbm", rec.nbytes)
            self.live[rec.seq] = rec
            return rec

    def unpack(self, rec: KeptInput) -> torch.Tensor:
        """`rec`'s input back in hbm, fetching it and the next units' ahead (module note)."""
        with self._lock:
            if rec.error is not None:
                raise RuntimeError(f"offload: a kept input of unit {rec.unit} could not be moved "
                                   f"({type(rec.error).__name__}: {rec.error}); run the forward again") from rec.error
            if rec.state is S.DROPPED:
                raise RuntimeError(f"offload: a kept input of unit {rec.unit} was freed (its backward failed, or the "
                                   "engine was closed); run the forward again")
            self._collect()
            self._advance(rec)
            if rec.state is not S.HBM:
                t0 = time.perf_counter()
                while rec.state is not S.IN:
                    if rec.state in (S.DRAM, S.NVME):
                        self._fetch(rec, urgent=True)
                    else:
                        self._advance(rec, wait=True)
                rec.done.wait_on_compute()
                waited = time.perf_counter() - t0
                self.wait_s += waited
                self.rt.telemetry.stall(waited, f"kept input of unit {rec.unit}")
            self._fetch_ahead(rec)
            self._advance_all()
            return rec.hbm.view(rec.shape)

    def forget(self, rec: KeptInput) -> None:
        """A finalizer's: autograd let go of `rec` (freed at the next safe point, module note)."""
        self._dead.append(rec)

    # -- the engine's side ----------------------------------------------------------------------------
    def ahead_of_backward(self) -> None:
        """A backward begins: the inputs of its first units start back now."""
        with self._lock:
            self._collect()
            self._advance_all()
            self._fetch_ahead(None)

    def drop_all(self, after: int = 0) -> None:
        """Frees every record packed after `after` (mark()'s; all: a failed backward, close()): their transfers
        settled, their bytes returned."""
        with self._lock:
            self._collect()
            for rec in list(self.live.values()):
                if rec.seq > after:
                    self._drop(rec)
            if not after:
                self.spares.release(0)

    def mark(self) -> int:
        """Where the records packed from now on begin (drop_all(after=) frees them: a failed forward)."""
        return self._seq

    def stats(self) -> dict:
        with self._lock:
            self._collect()
            return {"where": self.where, "dram_bytes": self.held["dram"], "dram_peak_bytes": self.peak["dram"],
                    "nvme_bytes": self.held["nvme"], "nvme_peak_bytes": self.peak["nvme"],
                    "moved_out_bytes": self.out_bytes, "moved_in_bytes": self.in_bytes,
                    "stayed_bytes": self.stayed_bytes, "unpack_wait_s": self.wait_s,
                    "dram_spare_bytes": self.spares.total_bytes}

    def _collect(self) -> None:
        """Frees the records autograd let go of."""
        while self._dead:
            self._drop(self._dead.pop())

    def _advance_all(self) -> None:
        """Moves every record along whose transfer completed, without waiting."""
        for rec in list(self.live.values()):
            self._advance(rec)

    # -- the records' transitions ---------------------------------------------------------------------
    def _advance(self, rec: KeptInput, wait: bool = False) -> None:
        """Takes `rec` through its completed transfers (wait: waits for the one in flight first)."""
        while rec.done is not None and (wait or rec.done.done()):
            done, rec.done = rec.done, None
            try:
                done.wait()
                self._completed(rec)  # may start the next transfer, which may fail as it starts
            except BaseException as e:
                rec.error = e  # the record moves no further: its unpack raises it again, _drop frees it
                raise
            wait = False

    def _completed(self, rec: KeptInput) -> None:
        seconds, rec.t0 = time.perf_counter() - rec.t0, time.perf_counter()
        link = self.rt.telemetry.link
        if rec.state is S.OUT:
            rec.src = None  # the forward's tensor is its own to free now
            self._hold("hbm", -rec.nbytes)
            self.out_bytes += rec.nbytes
            link("hbm_to_dram", rec.nbytes, seconds)
            rec.state = S.DRAM
            if self.where == "nvme":
                rec.done, rec.state = self.rt.store.write(rec.key, rec.dram), S.TO_NVME
        elif rec.state is S.TO_NVME:
            rec.on_disk = True
            self._hold("nvme", rec.nbytes)
            self._free_dram(rec)
            link("dram_to_nvme", rec.nbytes, seconds)
            rec.state = S.NVME
        elif rec.state is S.FROM_NVME:
            link("nvme_to_dram", rec.nbytes, seconds)
            self._delete(rec)
            self._to_hbm(rec)
        elif rec.state is S.IN:
            self._free_dram(rec)
            self.in_bytes += rec.nbytes
            link("dram_to_hbm", rec.nbytes, seconds)
            rec.state = S.HBM

    def _fetch_ahead(self, rec: KeptInput | None) -> None:
        """Starts fetching the records packed before `rec` (all: None), its own unit's and the next `ahead`
        units' in backward order, while hbm has room."""
        hbm, dram, units = self.rt.tiers.acct["hbm"], self.rt.tiers.acct["dram"], []
        for other in reversed(list(self.live.values())):
            if rec is not None and other.seq > rec.seq:
                continue
            if (rec is None or other.unit != rec.unit) and other.unit not in units:
                if len(units) == self.ahead:
                    return
                units.append(other.unit)
            room = hbm.fits(other.nbytes) and (other.state is S.DRAM or dram.fits(other.nbytes))
            if other.state in (S.DRAM, S.NVME) and room:
                self._fetch(other)

    def _fetch(self, rec: KeptInput, urgent: bool = False) -> None:
        if rec.state is S.DRAM:
            self._to_hbm(rec)
        else:  # nvme
            rec.dram = self._dram(rec, f"kept input of unit {rec.unit} read back")
            rec.t0 = time.perf_counter()
            rec.done, rec.state = self.rt.store.read(rec.key, rec.dram, urgent=urgent), S.FROM_NVME

    def _to_hbm(self, rec: KeptInput) -> None:
        tiers = self.rt.tiers
        tiers.acct["hbm"].charge(rec.nbytes, f"kept input of unit {rec.unit} back for its backward")
        self._hold("hbm", rec.nbytes)
        rec.hbm = torch.empty(rec.shape, dtype=rec.dtype, device=tiers.hbm_device)
        rec.t0 = time.perf_counter()
        rec.done, rec.state = self.rt.h2d.copy(rec.hbm, rec.dram.view(rec.shape)), S.IN

    def _dram(self, rec: KeptInput, what: str) -> torch.Tensor:
        """A dram tensor for `rec`, a spare of its size if there is one; while the budget has no room for a new
        one, the spares of other sizes are freed, then the oldest transfer of a record holding dram is waited for
        (a write to nvme, or a copy back to hbm, leaves its buffer spare when it completed)."""
        acct = self.rt.tiers.acct["dram"]
        while not self.spares.has(rec.nbytes) and not acct.fits(rec.nbytes):
            moving = [r for r in self.live.values() if r.done is not None and r.dram is not None]
            if self.spares.total_bytes:  # of other sizes
                self.spares.release(0)
            elif moving:
                self._advance(moving[0], wait=True)  # its buffer becomes a spare
            else:
                break  # the tiers' error names the tier, the bytes and the budget
        if self.spares.has(rec.nbytes):
            t = self.spares.take(rec.nbytes, rec.dtype)
        else:
            t = self.rt.tiers.empty("dram", rec.shape.numel(), rec.dtype, what)
        self._hold("dram", rec.nbytes)
        return t

    def _free_dram(self, rec: KeptInput) -> None:
        """`rec`'s dram buffer, its transfers settled, kept as a spare (module note)."""
        self._hold("dram", -rec.nbytes)
        self.spares.release(self.peak["dram"] - rec.nbytes)
        self.spares.put(rec.dram, rec.nbytes)
        rec.dram = None

    def _delete(self, rec: KeptInput) -> None:
        if rec.on_disk:
            rec.on_disk = False
            self._hold("nvme", -rec.nbytes)
            self.rt.store.delete(rec.key)

    def _drop(self, rec: KeptInput) -> None:
        """Settles `rec`'s transfer (its error is not raised here: its waiter's, if any) and frees its bytes."""
        if self.live.pop(rec.seq, None) is None:
            return
        if rec.done is not None:
            try:
                rec.done.wait()
            except Exception:  # noqa: BLE001  (raised to the pack or unpack that waits for it, if any)
                pass
            if rec.state is S.TO_NVME and rec.key in self.rt.store:  # a failed write leaves no key (swap.store)
                rec.on_disk = True
                self._hold("nvme", rec.nbytes)
        if rec.src is not None:
            rec.src = None
            self._hold("hbm", -rec.nbytes)
        if rec.hbm is not None:
            self.rt.tiers.acct["hbm"].refund(rec.nbytes)
            self._hold("hbm", -rec.nbytes)
            rec.hbm = None
        if rec.dram is not None:
            self._free_dram(rec)
        self._delete(rec)
        rec.done, rec.state = None, S.DROPPED

    def _hold(self, tier: str, nbytes: int) -> None:
        self.held[tier] += nbytes
        self.peak[tier] = max(self.peak[tier], self.held[tier])
