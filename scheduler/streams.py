"""Copy streams: where transfers run beside compute.

[Note: one copy stream per direction]
Each direction (h2d fetches, d2h gradients) is one worker thread, on every backend, running host jobs
in order: the gradient accumulation and the CPU Adam step that follows it run there, never on the
compute thread. On CUDA each also has a dedicated CUDA stream, created once, so a fetch for the next
unit never queues behind this unit's gradients: `copy` enqueues on it and returns an event, which the
compute stream waits on (`wait_on_compute`: no host synchronize on the compute path); `submit` records
an event on the compute stream, and the job runs on the worker with this stream current, made to wait
on that event, so its device reads (the gradient's copy to the host) follow the kernels that produced
them and not the ones queued after. The backends differ only in that copy primitive; on a CPU-only
machine the "accelerator" is host memory, so the same jobs and waits are exercised by CI. A test may
inject a random delay before each job (`delay_s`): a missing wait then shows up as a wrong number.
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
    """Runs copies and host jobs in order, beside compute: one worker thread, plus a CUDA stream on CUDA."""

    def __init__(self, name: str, device: torch.device, delay_s: float = 0.0):
        self.name, self.device, self.delay_s = name, device, delay_s
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # dedicated: see the note
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"offload-{name}")

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Completion:
        """dst.copy_(src) on this stream. The caller keeps both alive until the completion is done."""
        if self._stream is None:
            return self.submit(dst.copy_, src)
        self._stream.wait_stream(torch.cuda.current_stream())  # src/dst were produced on the current stream
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            for t in (dst, src):
                if t.is_cuda:
                    t.record_stream(self._stream)  # the allocator must not reuse them before the copy ran
            event = torch.cuda.Event()
            event.record(self._stream)
        return Completion(event=event)

    def submit(self, fn: Callable, *args, tensors=()) -> Completion:
        """Host work on this stream's thread, in order with its other jobs. On CUDA the job runs with this
        stream current, after the work the calling stream has enqueued so far; `tensors` (accelerator
        memory the job reads) are not reused by the allocator before this stream is done with them."""
        if self._stream is None:
            return Completion(future=self._pool.submit(_delayed, self.delay_s, fn, args))
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream())
        for t in tensors:
            t.record_stream(self._stream)
        return Completion(future=self._pool.submit(self._on_stream, ready, fn, args))

    def _on_stream(self, ready, fn: Callable, args) -> None:
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            _delayed(self.delay_s, fn, args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
