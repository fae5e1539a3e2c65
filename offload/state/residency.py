"""Residency: where a unit's weights and optimizer states are, as one enum and one transition table.

Each handle owns its state. Transition methods are named for the target, assert the source state, do
the work and set the new state last; an illegal transition raises. In-flight states keep their
completion (copy event or I/O ticket) together with the buffer it reads or writes, so the buffer cannot
be freed while a transfer still uses it.
"""

from __future__ import annotations

import collections
import enum
import threading
import time

import torch

from offload.plan.chunks import chunk_key, packed, weight_chunks
from offload.plan.memory import READ_AHEAD  # chunks of one fetch in flight: one read while the previous is copied up
from offload.state.tiers import Tiers
from offload.plan.units import Unit


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
    """

    def __init__(self, unit: Unit, home: str, dtype: torch.dtype, rt):
        owner = rt.placement.weight_owners.get(unit.index)
        # zero_stage 3 with weights in hbm: the rank's shard lives in the hbm tier and moves as a dram home's
        # weights do (fetched into the whole unit's hbm copy, released after use)
        self.shard_tier = "hbm" if home == "hbm" else "dram"
        if owner is not None and home == "hbm":
            home = "dram"
        super().__init__(f"{unit.name}/weight", home)
        self.unit, self.dtype, self.rt = unit, dtype, rt
        self.key = unit.key(f"weight.{str(dtype).removeprefix('torch.')}")
        self.chunks = weight_chunks(unit.numel, unit.trainable_numel, rt.chunk_numel)
        # [Note: partitioned weights] zero_stage 3 over several ranks: a fetched unit's home holds only the
        # chunks this rank owns (placement.weight_owners; dram: back to back, nvme: their keys), and a fetch
        # copies those into hbm, then each chunk is broadcast from its owner. With zero_gather_ahead (the
        # default) the fetch queues that gather on the gather thread (rt.gather) behind its own reads, so it
        # runs ahead of the unit's use, beside the compute of the units before it; every rank issues the same
        # fetches in the same order, since the prefetcher's room is one all ranks share (offload.step.prefetch).
        # Without it the gather runs on the compute thread when the unit is used. The time the compute thread
        # waits on a gather (after the unit's own shard arrived) is the collective's `exposed_s`. With
        # offload_param none the shard stays in the hbm tier (shard_tier) and is handled as a dram home.
        self.partitioned = owner is not None
        self.owner = owner or [rt.rank] * len(self.chunks)
        self.held = [i for i, r in enumerate(self.owner) if r == rt.rank]  # the chunks at this rank's home
        self._local, local_numel = packed(self.chunks, self.held)
        tiers: Tiers = rt.tiers
        self.nbytes = unit.numel * dtype.itemsize
        self.hbm = tiers.empty("hbm", unit.numel, dtype, f"{unit.name} weights")
        self.dram = tiers.empty(self.shard_tier, local_numel, dtype, f"{unit.name} weights") if home == "dram" else None
        self._pending = None       # completion of the transfer in flight (partitioned, ahead: the gather's)
        self._t0 = 0.0
        self._ready_at = None      # partitioned, gathered ahead: when this rank's shard was in hbm
        self._placeholder = torch.empty(0, dtype=dtype, device=self.hbm.device)
        self.shaped = False        # released parameters hold their shapes for a backward (shape_only)
        self._write_lock = threading.Lock()
        self._writes: list = []    # (ticket, chunk buffer, t0) of new weights written behind to nvme
        self.update = None         # completion of this unit's deferred step, which the next fetch waits for ([Note: split step])
        self._accumulators = None  # the parameters' AccumulateGrad nodes, held (refs())
        self._lent = None          # the pool buffer under the hbm copy ([Note: reused host memory for hbm] in offload.state.tiers)
        if home != "hbm":
            self._free_hbm()
            self._detach()

    # -- parameters ---------------------------------------------------------------------------------
    def _attach(self) -> None:
        for s in self.unit.slots:
            s.attach(self.hbm)
        self.shaped = False

    def _detach(self) -> None:
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
        if self.partitioned and self.rt.gather is not None:  # [Note: partitioned weights]: queued behind the reads
            self._ready_at = None
            self._pending = self.rt.gather.submit(self._gather_ahead, self._pending, tensors=(self.hbm,),
                                                  device_work=True)

    def _gather_ahead(self, shard) -> None:
        """On the gather thread: once this rank's shard is in hbm, the gather."""
        shard.wait_on_compute()  # CUDA: the gather stream waits for the shard's copy, not the host
        self._ready_at = time.perf_counter()
        self._gather(self.rt.ranks.gather)

    def _read_chunks(self, update=None) -> None:
        """On the reader thread: nvme -> pool chunk -> hbm, chunk by chunk, the next chunk's read in flight
        while the previous one is copied up (READ_AHEAD chunks of the pool at most). Where hbm is host memory
        (the CPU backend) every chunk is read straight into the hbm copy at once: no pool chunk, no copy.
        The reads are urgent ([Note: urgent blocks] in swap/engines.py): the compute waits for them, while
        the optimizer's queued window I/O can wait."""
        if update is not None:
            update.wait()
        self.wait_for_write()  # new weights written behind land before they are read back
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
                _settle(ticket)
                if not direct:
                    pool.release(buf)

    def advance(self) -> None:
        """Moves an in-flight fetch one step on if its transfer (and gather) finished; never blocks. A gather
        that runs when the unit is used (zero_gather_ahead off) waits for that use."""
        if (self.state in (R.NVME_TO_HBM, R.DRAM_TO_HBM) and self._pending.done()
                and (not self.partitioned or self.rt.gather is not None)):
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
        ahead = self.partitioned and self.rt.gather is not None
        if self.state is R.DRAM_TO_HBM:
            held = sum(self.chunks[i][1] - self.chunks[i][0] for i in self.held)
            end = self._ready_at if ahead else time.perf_counter()
            self.rt.telemetry.link("dram_to_hbm", held * self.dtype.itemsize, end - self._t0)
        if ahead:  # the compute thread's wait from when the shard was in hbm: [Note: partitioned weights]
            self.rt.telemetry.exposed("all_gather", max(0.0, time.perf_counter() - max(t0, self._ready_at)))
        elif self.partitioned:  # on use: the compute thread runs the whole gather
            self.rt.telemetry.exposed("all_gather", self._gather(self.rt.ranks.compute))
        self._attach()
        self._set(R.HBM, self.state)

    def _gather(self, group) -> float:
        """[Note: partitioned weights] Each chunk from its owner into every rank's hbm copy (as bytes); returns
        the seconds it took."""
        import torch.distributed as dist

        t0, ranks = time.perf_counter(), self.rt.ranks
        for (b, e), owner in zip(self.chunks, self.owner):
            ranks.run("all_gather (a broadcast per chunk)", self.unit.name,
                      lambda: dist.broadcast(self.hbm[b:e].view(torch.uint8), src=owner, group=group))
        seconds = time.perf_counter() - t0
        self.rt.telemetry.collective("all_gather", self.nbytes, seconds)
        return seconds

    # -- release: hbm -> home -------------------------------------------------------------------------
    def release(self) -> None:
        """Drops the hbm copy (the home copy is current); a no-op for hbm-resident weights."""
        if self.home == "hbm":
            return
        if self.state in (R.NVME_TO_HBM, R.DRAM_TO_HBM):
            self.wait_for_fetch()
        if self.state is R.HBM:
            self._detach()
            self._free_hbm()
            self._set(HOME_STATE[self.home], R.HBM)

    def reset(self) -> None:
        """After a failure: a fetch in flight is settled (its error, if any, was reported) and dropped,
        a fetched copy released; the weights are at home."""
        if self.state in (R.NVME_TO_HBM, R.DRAM_TO_HBM):
            _settle(self._pending)
            self._pending = None
            self._free_hbm()
            self._set(HOME_STATE[self.home], self.state)
        else:
            self.release()
        if self.shaped:
            self._detach()

    # -- new weights from the optimizer (on the d2h thread when the step overlaps backward) ------------
    # [Note: updates beside residency]
    # The optimizer writes a unit's new weights to its home copy while the hbm copy may still be attached
    # (the unit's backward is over once its gradients are final, but units are released when backward()
    # ends, and a step outside backward first releases every fetched copy, kept ones included: see
    # Prefetcher.release_all in offload.step.prefetch). So an update never changes the residency state: dram homes and the CPU
    # backend's hbm are written in place (the trainable prefix only; frozen weights are never written),
    # an nvme home chunk by chunk through pool chunks written behind, which the next fetch waits for.
    def new_weights(self, i: int, begin: int, end: int) -> torch.Tensor:
        """The buffer the optimizer writes the new weights of elements [begin, end) (state window i) into,
        at its start; then call `commit(i, begin, end, buf)`."""
        if self.home == "dram":
            return self.dram[self.span(i, begin, end)]
        if self.home == "hbm" and self.hbm.device.type == "cpu":
            return self.hbm[begin:end]
        cb, ce = self.chunks[i]
        buf = self.rt.staging.acquire(ce - cb, self.dtype, f"{self.unit.name} new weights")
        if self.home == "nvme" and end < ce:  # frozen weights share this chunk: written back unchanged
            try:
                self.rt.store.read(chunk_key(self.key, i), into=buf).wait()
            except BaseException:
                self.rt.staging.release(buf)
                raise
        return buf

    def commit(self, i: int, begin: int, end: int, buf: torch.Tensor) -> None:
        """After the optimizer filled `new_weights(i, ...)`: nvme chunks are written behind;
        accelerator-resident weights are copied up (the window only)."""
        if self.home == "dram" or (self.home == "hbm" and self.hbm.device.type == "cpu"):
            return
        if self.home == "nvme":
            try:
                ticket = self.rt.store.write(chunk_key(self.key, i), buf)
            except BaseException:
                self.rt.staging.release(buf)
                raise
            with self._write_lock:
                self._writes.append((ticket, buf, time.perf_counter()))
            return
        try:
            self.rt.h2d.copy(self.hbm[begin:end], buf[:end - begin]).wait()
        finally:
            self.rt.staging.release(buf)

    def window(self, i: int, begin: int, end: int):
        """(tensor of elements [begin, end) as at home, release()): a view of a resident home, or chunk i read
        from nvme into a pool chunk that release() returns. For sending a window's weights to other ranks
        (offload.step.pipeline.share_new_weights)."""
        if self.home != "nvme":
            return (self.dram[self.span(i, begin, end)] if self.home == "dram" else self.hbm[begin:end]), lambda: None
        cb, ce = self.chunks[i]  # the chunk whole: frozen weights may share it
        chunk = self.rt.staging.acquire(ce - cb, self.dtype, f"{self.unit.name} weights to share")
        try:
            self.rt.store.read(chunk_key(self.key, i), into=chunk).wait()
        except BaseException:
            self.rt.staging.release(chunk)
            raise
        return chunk[begin - cb:end - cb], lambda: self.rt.staging.release(chunk)

    def discard(self, buf: torch.Tensor) -> None:
        """A `new_weights` buffer that will not be committed (the step failed) goes back unwritten."""
        if not (self.home == "dram" or (self.home == "hbm" and self.hbm.device.type == "cpu")):
            self.rt.staging.release(buf)

    def wait_for_write(self) -> None:
        with self._write_lock:
            writes, self._writes = self._writes, []
        error = None
        for ticket, buf, t0 in writes:
            try:
                ticket.wait()
                self.rt.telemetry.link("dram_to_nvme", buf.numel() * buf.element_size(), time.perf_counter() - t0)
            except BaseException as e:  # every chunk is settled and returned before the first error is raised
                error = error or e
                _settle(ticket)
            self.rt.staging.release(buf)
        if error is not None:
            raise error

    def close(self) -> None:
        """Settles the transfers in flight and returns every byte charged for these weights (hbm-home
        weights stay the module's parameters; the engine only stops counting them)."""
        if self.state in (R.NVME_TO_HBM, R.DRAM_TO_HBM):
            _settle(self._pending)  # a failed fetch: its error was raised to the forward that waited
        try:
            self.wait_for_write()
        finally:
            if self.hbm.untyped_storage().nbytes():  # charged while it has storage (_alloc_hbm, _free_hbm)
                if self.home == "hbm":
                    self.rt.tiers.acct["hbm"].refund(self.nbytes)
                else:
                    self._detach()
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


def _settle(completion) -> None:
    """Waits for a transfer whose result no longer matters (its error was or will be reported elsewhere)."""
    try:
        completion.wait()
    except Exception:  # an interrupt (Ctrl-C, offload.Stopped) is not held back
        pass
