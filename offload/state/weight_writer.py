"""The new weights the optimizer writes into a unit's weight home, and the weights read back from there to
send to other ranks.

[Note: updates beside residency]
The optimizer writes a unit's new weights to its home copy while the hbm copy may still be attached (the
unit's backward is over once its gradients are final, but units are released when backward() ends, and a
step outside backward first releases every fetched copy, kept ones included: see Prefetcher.release_all in
offload.step.prefetch). So an update never changes the residency state: dram homes and the CPU backend's
hbm are written in place (the trainable prefix only; frozen weights are never written), an nvme home
chunk by chunk through pool chunks written behind, which the next fetch waits for (wait_for_write).
Where the step needs what an nvme home chunk holds (a split master's high halves, frozen weights sharing
the chunk), the chunk is read ahead with the window's states (read_ahead): the window's own chunk of the
plan's optimizer windows, so the step does not wait for the read.
"""

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

    def read_ahead(self, i: int, end: int, current: bool = False) -> None:
        """Starts reading chunk i of an nvme home into a pool chunk now, where new_weights(i, begin, end,
        current) will need it (a window read ahead); a no-op where it will not, or it was started."""
        if self._needs_home(i, end, current) and i not in self._ahead:
            started = self._read(i, "weights read ahead")
            with self._lock:
                self._ahead[i] = started

    def drop_ahead(self) -> None:
        """Chunks read ahead and not used (a step that failed, or ended before their window) go back."""
        with self._lock:
            ahead, self._ahead = list(self._ahead.values()), {}
        for ticket, buf, _ in ahead:
            settle(ticket)
            self.pool.release(buf)

    def new_weights(self, i: int, begin: int, end: int, current: bool = False) -> torch.Tensor:
        """The buffer the optimizer writes the new weights of elements [begin, end) (state window i) into,
        at its start; then call `commit(i, begin, end, buf)`. current: it holds the weights before the step
        (a split master's high halves), as a resident home always does."""
        w = self.weights
        if self.in_place:
            return self._at_home(i, begin, end)
        cb, ce = w.chunks[i]
        if self._needs_home(i, end, current):  # frozen weights share this chunk: written back unchanged
            return self._acquire(i, "new weights", ahead=True)[0]
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
                self.pool.release(buf)
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
            self.pool.release(buf)
        if error is not None:
            raise error


def settle(completion) -> None:
    """Waits for a transfer whose result no longer matters (its error was or will be reported elsewhere)."""
    try:
        completion.wait()
    except Exception:  # an interrupt (Ctrl-C, offload.Stopped) is not held back
        pass
