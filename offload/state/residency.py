"""Residency: where a unit's weights and optimizer states are, as one enum and one transition table.

Each handle owns its state. Transition methods are named for the target, assert the source state, do
the work and set the new state last; an illegal transition raises. In-flight states keep their
completion (copy event or I/O ticket) together with the buffer it reads or writes, so the buffer cannot
be freed while a transfer still uses it.
"""

from __future__ import annotations

import collections
import enum
import time

import torch

from offload.plan.chunks import chunk_key, packed, weight_chunks
from offload.plan.memory import READ_AHEAD  # chunks of one fetch in flight: one read while the previous is copied up
from offload.plan.units import Unit
from offload.state.gather import ShardGather
from offload.state.runtime import Runtime
from offload.state.tiers import Tiers
from offload.state.weight_writer import WeightWriter, settle


class Residency(enum.Enum):
    NVME = "nvme"
    NVME_TO_DRAM = "nvme->dram"
    NVME_TO_HBM = "nvme->hbm"    # chunk by chunk through the dram pool (weights)
    DRAM = "dram"
    DRAM_TO_HBM = "dram->hbm"
    HBM = "hbm"
    DRAM_TO_NVME = "dram->nvme"


R = Residency
TRANSITIONS = {
    (R.NVME, R.NVME_TO_DRAM), (R.NVME_TO_DRAM, R.DRAM),
    (R.NVME, R.NVME_TO_HBM), (R.NVME_TO_HBM, R.HBM),
    (R.DRAM, R.DRAM_TO_HBM), (R.DRAM_TO_HBM, R.HBM),
    (R.HBM, R.DRAM), (R.HBM, R.NVME),          # release: drop the hbm copy, the home copy stays
    (R.DRAM, R.DRAM_TO_NVME), (R.DRAM_TO_NVME, R.NVME),
    (R.NVME_TO_HBM, R.NVME), (R.DRAM_TO_HBM, R.DRAM),  # a fetch abandoned after a failure (reset)
    (R.DRAM, R.HBM),                           # read in place: the parameters view the home (WeightHandle.in_place)
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

    def to_home(self) -> None:
        """Back at home from any state, past the table: for a handle whose transfers were settled and whose
        buffers went back (an optimizer window dropped after a failure or once written, a closed state)."""
        self.state = HOME_STATE[self.home]


class WeightHandle(_Handle):
    """A unit's weights in the compute dtype. Home is hbm (persistent), dram, or nvme (one swap key per
    chunk: offload.plan.chunks).

    The hbm buffer is one flat tensor whose storage is emptied when released and given memory again when
    fetched (resized; on the CPU backend, reused pool memory: [Note: reused host memory for hbm] in
    offload.state.tiers): autograd saves views of that storage in forward, and sees the refilled bytes in backward.
    Parameters point at views of it while fetched and at an empty placeholder while released, so a user
    touching a released parameter gets an empty tensor, never freed memory (during a backward that needs
    no weights, a zero expanded to each parameter's shape: shape_only).

    Two parts of its own: `gather`, the stage-3 gather of partitioned weights (offload.state.gather, None
    where the unit is not partitioned), and `writer`, which writes the optimizer's new weights into the home
    (offload.state.weight_writer).
    """

    def __init__(self, unit: Unit, home: str, dtype: torch.dtype, rt: Runtime):
        owner = rt.settings.weight_owners.get(unit.index)
        # zero_stage 3 with weights in hbm: the rank's shard lives in the hbm tier and moves as a dram home's
        # weights do (fetched into the whole unit's hbm copy, released after use)
        self.shard_tier = "hbm" if home == "hbm" else "dram"
        if owner is not None and home == "hbm":
            home = "dram"
        super().__init__(f"{unit.name}/weight", home)
        self.unit, self.dtype, self.rt = unit, dtype, rt
        self.key = unit.key(f"weight.{str(dtype).removeprefix('torch.')}")
        self.chunks = weight_chunks(unit.numel, unit.trainable_numel, rt.chunk_numel)
        # zero_stage 3 over several ranks: the home holds only the chunks this rank owns, the rest come by the
        # gather ([Note: partitioned weights] in offload.state.gather)
        self.partitioned = owner is not None
        self.owner = owner or [rt.rank] * len(self.chunks)
        self.held = [i for i, r in enumerate(self.owner) if r == rt.rank]  # the chunks at this rank's home
        self._local, local_numel = packed(self.chunks, self.held)
        tiers: Tiers = rt.tiers
        self.nbytes = unit.numel * dtype.itemsize
        self.hbm = tiers.empty("hbm", unit.numel, dtype, f"{unit.name} weights")
        self.dram = tiers.empty(self.shard_tier, local_numel, dtype, f"{unit.name} weights") if home == "dram" else None
        self.gather = (ShardGather(unit.name, self.chunks, self.owner, self.hbm, rt.ranks, rt.telemetry, rt.gather)
                       if self.partitioned else None)
        self.writer = WeightWriter(self, rt.staging, rt.store, rt.h2d, rt.telemetry)
        self._pending = None       # completion of the transfer in flight (partitioned, ahead: the gather's)
        self._t0 = 0.0
        self._placeholder = torch.empty(0, dtype=dtype, device=self.hbm.device)
        self.shaped = False        # released parameters hold their shapes for a backward (shape_only)
        self.update = None         # completion of this unit's deferred step, which the next fetch waits for ([Note: split step])
        self._accumulators = None  # the parameters' AccumulateGrad nodes, held (refs())
        self._lent = None          # the pool buffer under the hbm copy ([Note: reused host memory for hbm] in offload.state.tiers)
        self.in_place = False      # a fetch points the parameters at the dram home itself (in_place_ok)
        if home != "hbm":
            self._free_hbm()
            self.detach()

    # -- parameters ---------------------------------------------------------------------------------
    def attach(self) -> None:
        for s in self.unit.slots:
            s.attach(self.hbm)
        self.shaped = False

    def detach(self) -> None:
        for s in self.unit.slots:
            s.detach(self._placeholder)
        self.shaped = False

    def shape_only(self) -> None:
        """A backward that needs no weights ([Note: backward without weights] in offload.step.hooks) is about to
        run: released parameters take their shapes (a zero expanded, no memory), as the gradient accumulator
        checks its gradient against them. reset() puts the empty placeholders back. A fetch in flight is not
        waited for (a partitioned one would gather out of turn): its views replace the shapes when it lands."""
        if self.state is not R.HBM and not self.shaped:
            zero = torch.zeros(1, dtype=self.dtype, device=self.hbm.device)
            for s in self.unit.slots:
                if s.record is None:  # a quantized weight is frozen: no accumulator checks it
                    s.param.data = zero.expand(s.shape)
            self.shaped = True

    def _free_hbm(self) -> None:
        """Empties the hbm copy and refunds its charge, once (the copy is charged while it has storage): a stop
        signal's exception may land between this and the state's transition, and the failure path frees again."""
        if not self.hbm.untyped_storage().nbytes():
            return
        lent, self._lent = self._lent, None
        self.rt.tiers.take_hbm_memory(self.hbm, lent)
        self.rt.tiers.acct["hbm"].refund(self.nbytes)

    def _alloc_hbm(self) -> None:
        self.rt.tiers.acct["hbm"].charge(self.nbytes, f"{self.unit.name} weights")
        try:
            self._lent = self.rt.tiers.give_hbm_memory(self.hbm, self.nbytes)
        except BaseException:
            self.rt.tiers.acct["hbm"].refund(self.nbytes)
            raise

    def span(self, i: int, begin: int | None = None, end: int | None = None) -> slice:
        """Where elements [begin, end) of held chunk i (default: all of it) lie in the home flat (dram, or the
        hbm copy of hbm-resident weights: every chunk is held there, in place)."""
        cb, ce = self.chunks[i]
        begin, end = cb if begin is None else begin, ce if end is None else end
        at = self._local[i] - cb
        return slice(at + begin, at + end)

    def refs(self) -> int | None:
        """References to the hbm copy (its storage: views; its parameters: saved as they are), or None where
        torch cannot say ([Note: backward without weights] in offload.step.hooks). Each trainable parameter's
        gradient accumulator is held from the first call, so its creation at the parameter's first use in a
        graph is no new reference."""
        count = getattr(torch._C, "_storage_Use_Count", None)
        params = [s.param for s in self.unit.slots]
        if count is None or not all(hasattr(p, "_use_count") for p in params):
            return None
        if self._accumulators is None:
            with torch.enable_grad():  # a first call under no_grad (eval, generate()) has no grad_fn to follow
                self._accumulators = [p.view_as(p).grad_fn.next_functions[0][0] for p in params if p.requires_grad]
        return count(self.hbm.untyped_storage()._cdata) + sum(p._use_count() for p in params)

    # -- fetch: home -> hbm ---------------------------------------------------------------------------
    def fetch(self) -> None:
        """Starts moving the weights towards hbm (partitioned: this rank's chunks), after the unit's deferred
        step if one is queued (on the reader thread: the caller does not wait); idempotent."""
        if self.state not in (R.NVME, R.DRAM):
            return
        if self.in_place and self.state is R.DRAM and self.update is None:
            self.writer.wait_for_write()
            for s in self.unit.slots:
                s.attach(self.dram)
            self._set(R.HBM, R.DRAM)
            return
        update, self.update = self.update, None
        if self.state is R.NVME:
            self._alloc_hbm()
            self._pending, self._t0 = self.rt.reader.submit(lambda: self._read_chunks(update)), time.perf_counter()
            self._set(R.NVME_TO_HBM, R.NVME)
        else:
            self._alloc_hbm()
            if update is not None:
                self._pending = self.rt.reader.submit(lambda: (update.wait(), self.rt.h2d.copy(self.hbm, self.dram).wait()))
            elif self.partitioned:
                pairs = [(self.hbm[b:e], self.dram[self.span(i)]) for i, (b, e) in
                         ((i, self.chunks[i]) for i in self.held)]
                self._pending = self.rt.h2d.submit(lambda: [dst.copy_(src, non_blocking=True) for dst, src in pairs],
                                                   device_work=True)
            else:
                self._pending = self.rt.h2d.copy(self.hbm, self.dram)
            self._t0 = time.perf_counter()
            self._set(R.DRAM_TO_HBM, R.DRAM)
        if self.gather is not None and self.gather.ahead:  # [Note: partitioned weights]: queued behind the reads
            self._pending = self.gather.submit(self._pending)

    def _read_chunks(self, update=None) -> None:
        """On the reader thread: nvme -> pool chunk -> hbm, chunk by chunk, the next chunk's read in flight
        while the previous one is copied up (READ_AHEAD chunks of the pool at most). Where hbm is host memory
        (the CPU backend) every chunk is read straight into the hbm copy at once: no pool chunk, no copy.
        The reads are urgent ([Note: urgent blocks] in swap/backends.py): the compute waits for them, while
        the optimizer's queued window I/O can wait."""
        if update is not None:
            update.wait()
        self.writer.wait_for_write()  # new weights written behind land before they are read back
        pool, store, tel = self.rt.staging, self.rt.store, self.rt.telemetry
        direct = self.hbm.device.type == "cpu"
        if direct:
            self.rt.tiers.fault_in(self._lent)
        flight: collections.deque = collections.deque()

        def drain() -> None:
            (b, e), buf, ticket, t0 = flight.popleft()
            try:
                ticket.wait()
                tel.link("nvme_to_dram", buf.numel() * buf.element_size(), time.perf_counter() - t0)
                t1 = time.perf_counter()
                if not direct:  # direct: dram_to_hbm still counts what entered hbm, with no time of its own
                    self.rt.h2d.copy(self.hbm[b:e], buf).wait()
                tel.link("dram_to_hbm", buf.numel() * buf.element_size(), time.perf_counter() - t1 if not direct else 0.0)
            finally:
                if not direct:
                    pool.release(buf)

        try:
            for i in self.held:
                b, e = self.chunks[i]
                if direct:
                    buf = self.hbm[b:e]
                    flight.append(((b, e), buf, store.read(chunk_key(self.key, i), into=buf, urgent=True),
                                   time.perf_counter()))
                    continue
                if len(flight) == READ_AHEAD:
                    drain()
                buf = pool.acquire(e - b, self.dtype, f"{self.unit.name} weights")
                flight.append(((b, e), buf, _read(store, chunk_key(self.key, i), buf, pool), time.perf_counter()))
            while flight:
                drain()
        finally:
            for _, buf, ticket, _ in flight:  # after a failure: no read may still write into a lent chunk
                settle(ticket)
                if not direct:
                    pool.release(buf)

    def advance(self) -> None:
        """Moves an in-flight fetch one step on if its transfer (and gather) finished; never blocks. A gather
        that runs when the unit is used (zero_gather_ahead off) waits for that use."""
        if (self.state in (R.NVME_TO_HBM, R.DRAM_TO_HBM) and self._pending.done()
                and (self.gather is None or self.gather.ahead)):
            self._finish_fetch()

    def wait_for_fetch(self) -> None:
        """Blocks until the weights are in hbm and the parameters point at them."""
        if self.state is R.HBM:
            return
        self.fetch()
        t0 = time.perf_counter()
        self._finish_fetch()
        self.rt.telemetry.stall(time.perf_counter() - t0, self.unit.name)

    def _finish_fetch(self) -> None:
        t0 = time.perf_counter()
        self._pending.wait_on_compute()  # on CUDA a copy's event: the compute stream waits, not the host
        self._pending = None
        ahead = self.gather is not None and self.gather.ahead
        if self.state is R.DRAM_TO_HBM:
            held = sum(self.chunks[i][1] - self.chunks[i][0] for i in self.held)
            end = self.gather.ready_at if ahead else time.perf_counter()
            self.rt.telemetry.link("dram_to_hbm", held * self.dtype.itemsize, end - self._t0)
        if self.gather is not None:  # the gather's exposed time: [Note: partitioned weights]
            self.gather.finish(t0)
        self.attach()
        self._set(R.HBM, self.state)

    def in_place_ok(self) -> bool:
        """Whether a fetch may read the home in place rather than copy it: a dram home in host memory (the CPU
        backend) holding the whole unit in the compute dtype, i.e. laid out as the hbm copy would be. Only while
        nothing writes the home ([Note: generation] in offload.step.generation): a step's new weights would
        land under the forward that reads them."""
        return self.home == "dram" and not self.partitioned and self.hbm.device.type == "cpu"

    # -- release: hbm -> home -------------------------------------------------------------------------
    def release(self) -> None:
        """Drops the hbm copy (the home copy is current); a no-op for hbm-resident weights."""
        if self.home == "hbm":
            return
        if self.state in (R.NVME_TO_HBM, R.DRAM_TO_HBM):
            self.wait_for_fetch()
        if self.state is R.HBM:
            self.detach()
            self._free_hbm()
            self._set(HOME_STATE[self.home], R.HBM)

    def reset(self) -> None:
        """After a failure: a fetch in flight is settled (its error, if any, was reported) and dropped,
        a fetched copy released; the weights are at home."""
        if self.state in (R.NVME_TO_HBM, R.DRAM_TO_HBM):
            settle(self._pending)
            self._pending = None
            self._free_hbm()
            self._set(HOME_STATE[self.home], self.state)
        else:
            self.release()
        if self.shaped:
            self.detach()

    def close(self) -> None:
        """Settles the transfers in flight and returns every byte charged for these weights (hbm-home
        weights stay the module's parameters; the engine only stops counting them)."""
        if self.state in (R.NVME_TO_HBM, R.DRAM_TO_HBM):
            settle(self._pending)  # a failed fetch: its error was raised to the forward that waited
        try:
            self.writer.wait_for_write()
        finally:
            if self.hbm.untyped_storage().nbytes():  # charged while it has storage (_alloc_hbm, _free_hbm)
                if self.home == "hbm":
                    self.rt.tiers.acct["hbm"].refund(self.nbytes)
                else:
                    self.detach()
                    self._free_hbm()
            if self.dram is not None:
                self.rt.tiers.free(self.shard_tier, self.dram)
                self.dram = None


def _read(store, key: str, buf: torch.Tensor, pool):
    try:
        return store.read(key, into=buf, urgent=True)
    except BaseException:
        pool.release(buf)
        raise

