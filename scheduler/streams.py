"""Copy streams: where transfers run beside compute.

[Note: one copy stream per direction]
On CUDA, host-to-device fetches and device-to-host gradient copies each get a dedicated stream, created
once, so a fetch for the next unit never queues behind this unit's gradients (and compute never waits on
either unless it needs the data). On a CPU-only machine the "accelerator" is host memory and each stream
is one worker thread doing the same copies for real, so the engine's waits are exercised by CI. A test
may inject a random delay before each copy (`delay_s`): a missing wait then shows up as a wrong number.
"""

from __future__ import annotations

import concurrent.futures
import random
import time
from typing import Callable

import torch


class Completion:
    """A transfer in flight. `wait()` blocks the host until it finished; `wait_on_compute()` only makes the
    compute stream wait (CUDA), which is all a consumer on the accelerator needs."""

    def __init__(self, future: concurrent.futures.Future | None = None, event=None):
        self._future, self._event = future, event

    def done(self) -> bool:
        if self._future is not None:
            return self._future.done()
        return self._event is None or self._event.query()

    def wait(self) -> None:
        if self._future is not None:
            self._future.result()
        elif self._event is not None:
            self._event.synchronize()

    def wait_on_compute(self) -> None:
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        else:
            self.wait()


DONE = Completion()


class Worker:
    """One host thread running jobs in order, on every backend (the nvme reads of chunked fetches: a job
    waits on I/O tickets and copies, which must not block the compute thread). Test delays as CopyStream."""

    def __init__(self, name: str, delay_s: float = 0.0):
        self.delay_s = delay_s
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"offload-{name}")

    def submit(self, fn: Callable, *args) -> Completion:
        return Completion(future=self._pool.submit(_delayed, self.delay_s, fn, args))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _delayed(delay_s: float, fn: Callable, args) -> None:
    if delay_s:
        time.sleep(random.uniform(0, delay_s))
    fn(*args)


class CopyStream:
    """Runs copies in order, beside compute: a CUDA stream, or one worker thread on the CPU backend."""

    def __init__(self, name: str, device: torch.device, delay_s: float = 0.0):
        self.name, self.device, self.delay_s = name, device, delay_s
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)  # dedicated: see the note above
            self._pool = None
        else:
            self._stream = None
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"offload-{name}")

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Completion:
        """dst.copy_(src) on this stream. The caller keeps both alive until the completion is done."""
        if self._stream is None:
            return self.submit(dst.copy_, src)
        self._stream.wait_stream(torch.cuda.current_stream())  # src/dst were produced on the compute stream
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            for t in (dst, src):
                if t.is_cuda:
                    t.record_stream(self._stream)  # the allocator must not reuse them before the copy ran
            event = torch.cuda.Event()
            event.record(self._stream)
        return Completion(event=event)

    def submit(self, fn: Callable, *args) -> Completion:
        """Host work on this stream's thread (CPU backend), in order with its copies."""
        if self._pool is None:
            fn(*args)
            return DONE
        return Completion(future=self._pool.submit(_delayed, self.delay_s, fn, args))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
