"""The new weights the optimizer writes into a unit's weight home, and the weights read back from there to
send to other ranks ([Note: updates beside residency], [Note: a fetched copy kept for the step])."""

# [Note: updates beside residency]
# The optimizer writes a unit's new weights to its home copy while the hbm copy may still be attached (the
# unit's backward is over once its gradients are final, but units are released when backward() ends, and a
# step outside backward first releases every fetched copy, kept ones included: see Prefetcher.release_all in
# offload.step.prefetch). So an update never changes the residency state: dram homes and the CPU backend's
# hbm are written in place (the trainable prefix only; frozen weights are never written), an nvme home
# chunk by chunk through pool chunks written behind, which the next fetch waits for (wait_for_write).
# Where the step needs what an nvme home chunk holds (a split master's high halves, frozen weights sharing
# the chunk), the chunk is read ahead with the window's states (read_ahead): the window's own chunk of the
# plan's optimizer windows, so the step does not wait for the read.
#
# [Note: a fetched copy kept for the step]
# Better than reading a split master's weights again: a step in backward takes the unit's fetched copy. Once
# the unit's gradient job is queued (expect_step), its release hands the copy's memory to the writer (keep)
# instead of the pool, still charged to hbm; the step writes each window's new weights into that copy and home
# from there, and the job gives the memory back when the unit's writes have landed (end_step). The kept bytes
# are the job's until then, and fetches wait for jobs (make_room) as for gradients. Where no copy is kept (a
# unit released before its job was queued, a step after backward, over ranks, on CUDA: memory that cannot be
# moved), the step reads the weights as above.

from __future__ import annotations

import threading
import time
from typing import Callable, Protocol

import torch

from offload.plan.chunks import chunk_key
from offload.plan.units import Unit
from offload.scheduler.streams import CopyStream
from offload.scheduler.telemetry import Telemetry
from offload.state.tiers import ChunkPool
from offload.swap import SwapStore


class WeightHome(Protocol):
    """What the writer reads of a unit's weight handle (offload.state.residency.WeightHandle)."""
    unit: Unit
    home: str                  # hbm, dram or nvme
    key: str                   # the swap key of an nvme home's chunks (chunk_key(key, i))
    chunks: list[tuple[int, int]]
    dtype: torch.dtype
    hbm: torch.Tensor
    dram: torch.Tensor | None

    def span(self, i: int, begin: int | None = None, end: int | None = None) -> slice: ...


class WeightWriter:
    """Writes one unit's new weights into its home ([Note: updates beside residency]): on the d2h thread
    when the step overlaps backward. Chunks of an nvme home are written behind; `wait_for_write` waits for
    them (the next fetch does, before it reads them back)."""

    def __init__(self, weights: WeightHome, pool: ChunkPool, store: SwapStore | None, h2d: CopyStream,
                 telemetry: Telemetry):
        self.weights, self.pool, self.store, self.h2d, self.telemetry = weights, pool, store, h2d, telemetry
        self._lock = threading.Lock()
        self._writes: list = []    # (ticket, chunk buffer, t0) of new weights written behind to nvme
        self._ahead: dict = {}     # chunk index -> (ticket, chunk buffer, t0) of an nvme home chunk read ahead
        self._keep = False         # the unit's step is queued and needs its weights as they are (expect_step)
        self._kept = None          # (the fetched copy, give_back) kept from the unit's release for its step
        self._unpooled: set = set()  # data_ptr of the kept copy's chunks handed out by new_weights

    @property
    def in_place(self) -> bool:
        """Whether new weights are written straight into the home (a dram home, or the CPU backend's hbm)."""
        w = self.weights
        return w.home == "dram" or (w.home == "hbm" and w.hbm.device.type == "cpu")

    def _at_home(self, i: int, begin: int, end: int) -> torch.Tensor:
        """Elements [begin, end) of chunk i in a resident home: the dram flat, or the hbm copy."""
        w = self.weights
        return w.dram[w.span(i, begin, end)] if w.home == "dram" else w.hbm[begin:end]

    def _acquire(self, i: int, what: str, ahead: bool = False) -> tuple[torch.Tensor, int]:
        """A pool chunk for chunk i whole, holding what the nvme home holds; and the chunk's first element.
        ahead: the one read_ahead(i) started, if any."""
        w = self.weights
        with self._lock:
            started = self._ahead.pop(i, None) if ahead else None
        if started is None:
            started = self._read(i, what)
        ticket, buf, t0 = started
        try:
            ticket.wait()
        except BaseException:
            settle(ticket)
            self.pool.release(buf)
            raise
        self.telemetry.link("nvme_to_dram", buf.numel() * buf.element_size(), time.perf_counter() - t0)
        return buf, w.chunks[i][0]

    def _read(self, i: int, what: str) -> tuple:
        """(ticket, pool chunk, t0): chunk i of the nvme home being read into a pool chunk."""
        w = self.weights
        cb, ce = w.chunks[i]
        buf = self.pool.acquire(ce - cb, w.dtype, f"{w.unit.name} {what}")
        try:
            return self.store.read(chunk_key(w.key, i), into=buf), buf, time.perf_counter()
        except BaseException:
            self.pool.release(buf)
            raise

    def _needs_home(self, i: int, end: int, current: bool) -> bool:
        """Whether new_weights(i, ..., end, current) starts from what the nvme home chunk holds."""
        return self.weights.home == "nvme" and (end < self.weights.chunks[i][1] or current)

    def read_ahead(self, i: int, end: int, current: bool = False, keepable: bool = False) -> None:
        """Starts reading chunk i of an nvme home into a pool chunk now, where new_weights(i, begin, end,
        current) will need it (a window read ahead); a no-op where it will not, where it was started, or where
        the unit's fetched copy will be kept for the step (keepable: the copy is fetched and could be)."""
        if current and (self._kept is not None or keepable):
            return
        if self._needs_home(i, end, current) and i not in self._ahead:
            started = self._read(i, "weights read ahead")
            with self._lock:
                self._ahead[i] = started

    def drop_ahead(self, i: int | None = None) -> None:
        """Chunks read ahead and not used (a step that failed, or ended before their window; i: that chunk's,
        the kept copy holding it) go back."""
        with self._lock:
            if i is None:
                ahead, self._ahead = list(self._ahead.values()), {}
            else:
                ahead = [self._ahead.pop(i)] if i in self._ahead else []
        for ticket, buf, _ in ahead:
            settle(ticket)
            self.pool.release(buf)

    def expect_step(self, split: bool) -> None:
        """The unit's gradient job is queued, which steps it (compute thread): a split master's step may take
        the fetched copy at its release (keep) where the home is nvme."""
        if split and self.weights.home == "nvme":
            with self._lock:
                self._keep = True

    def keep(self, take: Callable[[], tuple]) -> bool:
        """At the unit's release (compute thread): where its step is expected and nothing is kept yet, take()
        moves the fetched copy's memory out of the hbm tensor and returns (copy, give_back); False: not taken."""
        with self._lock:
            if not self._keep or self._kept is not None:
                return False
            self._kept = take()
            return True

    def end_step(self, quiet: bool = False) -> None:
        """The unit's gradient job ends: its writes land (quiet: after a failure, settled and not raised),
        then the kept copy's memory goes back to the hbm tier."""
        with self._lock:
            self._keep = False
            kept, self._kept = self._kept, None
        if kept is None:
            return
        try:
            self.wait_for_write()
        except Exception:
            if not quiet:
                raise
        finally:
            self._unpooled.clear()
            kept[1]()

    def new_weights(self, i: int, begin: int, end: int, current: bool = False) -> torch.Tensor:
        """The buffer the optimizer writes the new weights of elements [begin, end) (state window i) into,
        at its start; then call `commit(i, begin, end, buf)`. current: it holds the weights before the step
        (a split master's high halves), as a resident home always does."""
        w = self.weights
        if self.in_place:
            return self._at_home(i, begin, end)
        cb, ce = w.chunks[i]
        if self._needs_home(i, end, current):  # frozen weights share this chunk: written back unchanged
            with self._lock:
                kept = self._kept[0][cb:ce] if self._kept is not None and current else None
            if kept is None:
                return self._acquire(i, "new weights", ahead=True)[0]
            self.drop_ahead(i)
            self._unpooled.add(kept.data_ptr())
            return kept
        buf = self.pool.acquire(ce - cb, w.dtype, f"{w.unit.name} new weights")
        if current and w.home == "hbm":
            try:
                buf[:end - begin].copy_(w.hbm[begin:end])
            except BaseException:
                self.pool.release(buf)
                raise
        return buf

    def commit(self, i: int, begin: int, end: int, buf: torch.Tensor) -> None:
        """After the optimizer filled `new_weights(i, ...)`: nvme chunks are written behind;
        accelerator-resident weights are copied up (the window only)."""
        if self.in_place:
            return
        if self.weights.home == "nvme":
            try:
                ticket = self.store.write(chunk_key(self.weights.key, i), buf)
            except BaseException:
                self._give_back(buf)
                raise
            with self._lock:
                self._writes.append((ticket, buf, time.perf_counter()))
            return
        try:
            self.h2d.copy(self.weights.hbm[begin:end], buf[:end - begin]).wait()
        finally:
            self.pool.release(buf)

    def discard(self, buf: torch.Tensor) -> None:
        """A `new_weights` buffer that will not be committed (the step failed) goes back unwritten."""
        if not self.in_place:
            self._give_back(buf)

    def _give_back(self, buf: torch.Tensor) -> None:
        """A new-weights buffer back to the pool, unless it is a chunk of the kept copy."""
        if buf.data_ptr() not in self._unpooled:
            self.pool.release(buf)

    def home_weights(self, i: int, begin: int, end: int) -> tuple[torch.Tensor, Callable[[], None]]:
        """(the weights of elements [begin, end) as at home, release()): a view of a resident home, or chunk i
        read from nvme into a pool chunk that release() returns. For sending a window's weights to other
        ranks (offload.step.pipeline.share_new_weights)."""
        if self.weights.home != "nvme":
            return self._at_home(i, begin, end), lambda: None
        chunk, cb = self._acquire(i, "weights to share")  # the chunk whole: frozen weights may share it
        return chunk[begin - cb:end - cb], lambda: self.pool.release(chunk)

    def wait_for_write(self) -> None:
        """Waits for the chunks written behind; each is settled and returned to the pool before the first
        error is raised."""
        with self._lock:
            writes, self._writes = self._writes, []
        error = None
        for ticket, buf, t0 in writes:
            try:
                ticket.wait()
                self.telemetry.link("dram_to_nvme", buf.numel() * buf.element_size(), time.perf_counter() - t0)
            except BaseException as e:  # every chunk is settled and returned before the first error is raised
                error = error or e
                settle(ticket)
            self._give_back(buf)
        if error is not None:
            raise error


def settle(completion) -> None:
    """Waits for a transfer whose result no longer matters (its error was or will be reported elsewhere)."""
    try:
        completion.wait()
    except Exception:  # an interrupt (Ctrl-C, offload.Stopped) is not held back
        pass
