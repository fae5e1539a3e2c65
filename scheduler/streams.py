"""Copy streams: where transfers run beside compute."""

from __future__ import annotations

import collections
import random
import threading
import time
from typing import Callable

import torch

from offload.swap.pending import Pending, fail_all, io_timeout_s, start_thread

# [Note: one copy stream per direction]
# Each direction (h2d fetches, d2h gradients) is one worker thread, on every backend, running host jobs
# in order: the gradient accumulation and the CPU Adam step that follows it run there, never on the
# compute thread. On CUDA each also has a dedicated CUDA stream, created once, so a fetch for the next
# unit never queues behind this unit's gradients: `copy` enqueues on it and returns an event, which the
# compute stream waits on (`wait_on_compute`: no host synchronize on the compute path); `submit` records
# an event on the compute stream, and the job runs on the worker with this stream current, made to wait
# on that event, so its device reads (the gradient's copy to the host) follow the kernels that produced
# them and not the ones queued after. The backends differ only in that copy primitive; on a CPU-only
# machine the "accelerator" is host memory, so the same jobs and waits are exercised by CI. A test may
# inject a random delay before each job (`delay_s`): a missing wait then shows up as a wrong number.
#
# [Note: what a copy waits for]
# A host-to-device copy writes memory the compute stream allocated (a fetched unit's hbm buffer, reused
# from memory earlier kernels read) and reads a source something produced: it must follow those, and
# nothing else, or it cannot overlap compute. `copy` called on a thread outside any job (the compute
# thread, in a fetch) waits for that thread's current stream: everything it queued so far, the allocation
# included. `copy` called inside a job of a JobThread (the nvme reader copying a chunk up after its read,
# the d2h thread copying new weights up after a step) waits for an event its submitter recorded on its
# own current stream when it submitted the job: what was queued before the job was issued, which includes
# the allocation of the buffer the job writes. It does not wait for that thread's current stream: on the
# reader thread that is the default stream, i.e. every kernel the compute thread queued while the drive
# read, the very compute the fetch should overlap (tests/test_stream_ordering.py records the waits with a
# fake of the stream API). A source in accelerator memory is produced on the calling thread's current
# stream: then the copy waits for that too.
#
# Host jobs never hang their waiters ([Note: no wait without an end] in swap/pending.py): a job's error
# is raised by `wait()`, a job thread that dies fails every job it still owed, and a wait ends after the
# I/O timeout with an error naming the job. (A CUDA event's synchronize has no timeout.)

_this_job = threading.local()  # .issued: on a JobThread, while a job runs, the event its submitter recorded


def _issued_mark():
    """An event recorded on the calling thread's current CUDA stream (the position of all it has queued),
    or None where CUDA is not in use ([Note: what a copy waits for])."""
    if not torch.cuda.is_initialized():
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    return event


class Completion:
    """A transfer in flight. `wait()` blocks the host until it finished; `wait_on_compute()` only makes the
    compute stream wait (CUDA), which is all a consumer on the accelerator needs."""

    def __init__(self, job: Pending | None = None, event=None, ended: list | None = None):
        self._job, self._event = job, event
        self._ended = ended  # a job's device work: [the event the job recorded on its stream as it ended]

    def done(self) -> bool:
        if self._job is not None:
            return self._job.done()
        return self._event is None or self._event.query()

    def wait(self) -> None:
        if self._job is not None:
            self._job.wait()
            if self._ended:
                self._ended[0].synchronize()
        elif self._event is not None:
            self._event.synchronize()

    def wait_on_compute(self) -> None:
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        elif self._ended is not None:
            self._job.wait()  # the job ran (it enqueued its device work): the compute stream waits for that work
            torch.cuda.current_stream().wait_event(self._ended[0])
        else:
            self.wait()


class JobThread:
    """One daemon thread running jobs in submission order; each job is a Pending its waiter waits on.
    close() runs the jobs already queued, then stops the thread."""

    def __init__(self, name: str, delay_s: float = 0.0):
        self.name, self.delay_s = f"offload-{name}", delay_s
        self._cond = threading.Condition()
        self._jobs: collections.deque = collections.deque()  # (Pending, fn, args, issued mark)
        self._running: Pending | None = None
        self._closing = False
        self._dead: BaseException | None = None
        self._thread = start_thread(self._run, self.name, self._died)

    def submit(self, fn: Callable, *args) -> Pending:
        job = Pending(f"{self.name} job {getattr(fn, '__qualname__', fn)}")
        issued = _issued_mark()
        with self._cond:
            if self._closing:
                raise RuntimeError(f"{self.name}: submit after close()")
            if self._dead is None:
                self._jobs.append((job, fn, args, issued))
                self._cond.notify()
                return job
        job.complete(self._dead)
        return job

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closing:
                    self._cond.wait()
                if not self._jobs:
                    return
                work = list(self._jobs.popleft())
                self._running = work[0]
            self._run_one(work)
            self._running = None

    def _run_one(self, work: list) -> None:
        """Runs one job. Its function and arguments are dropped before the waiter wakes: a waiter that counts
        references to a tensor the job used (offload.step.hooks, [Note: backward without weights]) must not see
        them come and go with this thread's timing."""
        job, fn, args, issued = work
        work.clear()
        _this_job.issued = issued
        try:
            if self.delay_s:
                time.sleep(random.uniform(0, self.delay_s))
            fn(*args)
        except BaseException as e:  # noqa: BLE001  (raised by the job's waiter)
            fn = args = None
            job.complete(e)
        else:
            fn = args = None
            job.complete()
        finally:
            _this_job.issued = None

    def _died(self, error: BaseException) -> None:
        dead = RuntimeError(f"{self.name}: its thread died ({error!r}); the job was not run")
        dead.__cause__ = error
        with self._cond:
            self._dead = dead
            owed = [self._running, *(item[0] for item in self._jobs)]
            self._jobs.clear()
        fail_all(owed, dead)

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(io_timeout_s())  # a job stuck past the I/O timeout is left behind (a daemon thread)


class Worker:
    """One host thread running jobs in order, on every backend (the nvme reads of chunked fetches: a job
    waits on I/O tickets and copies, which must not block the compute thread). Test delays as CopyStream."""

    def __init__(self, name: str, delay_s: float = 0.0):
        self.name, self.delay_s = name, delay_s
        self._jobs = JobThread(name, delay_s)

    def submit(self, fn: Callable, *args) -> Completion:
        return Completion(job=self._jobs.submit(fn, *args))

    def close(self) -> None:
        self._jobs.close()


class CopyStream:
    """Runs copies and host jobs in order, beside compute: one worker thread, plus a CUDA stream on CUDA."""

    def __init__(self, name: str, device: torch.device, delay_s: float = 0.0):
        self.name, self.device, self.delay_s = name, device, delay_s
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # dedicated: see the note
        self._pool = JobThread(name, delay_s)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Completion:
        """dst.copy_(src) on this stream. The caller keeps both alive until the completion is done."""
        if self._stream is None:
            return self.submit(dst.copy_, src)
        self._wait_for_inputs(src)
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            for t in (dst, src):
                if t.is_cuda:
                    t.record_stream(self._stream)  # the allocator must not reuse them before the copy ran
            event = torch.cuda.Event()
            event.record(self._stream)
        return Completion(event=event)

    def _wait_for_inputs(self, src: torch.Tensor) -> None:
        """This stream waits for what a copy needs, and no more: [Note: what a copy waits for]."""
        issued = getattr(_this_job, "issued", None)
        if issued is None or src.is_cuda:
            self._stream.wait_stream(torch.cuda.current_stream())
        if issued is not None:
            self._stream.wait_event(issued)

    def submit(self, fn: Callable, *args, tensors=(), device_work: bool = False) -> Completion:
        """Host work on this stream's thread, in order with its other jobs. On CUDA the job runs with this
        stream current, after the work the calling stream has enqueued so far; `tensors` (accelerator
        memory the job reads or writes) are not reused by the allocator before this stream is done with
        them. device_work: the job enqueues device work its consumer needs (a collective into hbm), so the
        completion's `wait_on_compute` makes the compute stream wait for that work, not the host."""
        if self._stream is None:
            return Completion(job=self._pool.submit(fn, *args))
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream())
        for t in tensors:
            t.record_stream(self._stream)
        ended = [] if device_work else None
        return Completion(job=self._pool.submit(self._on_stream, ready, fn, args, ended), ended=ended)

    def _on_stream(self, ready, fn: Callable, args, ended: list | None = None) -> None:
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            fn(*args)
            if ended is not None:
                event = torch.cuda.Event()
                event.record(self._stream)
                ended.append(event)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
