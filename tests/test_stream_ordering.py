"""What a CUDA copy waits for, checked on the CPU with a recording fake of torch.cuda's stream API.

The fake keeps, per stream, the list of work enqueued on it (a position is its length) and, per thread,
the current stream (the default stream unless `torch.cuda.stream(s)` says otherwise), and records every
wait a stream is made to do: on which stream, up to which position. The question is the one from issue
30: an nvme fetch's host-to-device copy is issued by the nvme-read thread, whose current stream is the
default stream, i.e. all compute queued so far; the copy must wait only for what it needs (compute queued
before the fetch was issued: the allocation of the buffer it writes), not for the compute it should
overlap.
"""

import threading

import torch

from offload.scheduler.streams import CopyStream, Worker
from tests.fake_cuda import cuda  # noqa: F401 (the fixture)


def compute_before(cuda, copy_stream: CopyStream) -> int:
    """How many of the default (compute) stream's items the copy stream's work is ordered after."""
    return copy_stream._stream.after(cuda.default)


def test_a_fetch_from_the_reader_thread_waits_only_for_compute_queued_before_it_was_issued(cuda):
    """The nvme path: the compute thread allocates the unit's hbm buffer and submits the fetch to the
    reader thread; compute goes on (this unit's forward) while the drive reads; then the reader copies
    the chunk up. The copy must follow the allocation, not the forward queued after it."""
    h2d, reader = CopyStream("h2d", torch.device("cuda")), Worker("nvme-read")
    dst, src = torch.zeros(4), torch.ones(4)
    try:
        cuda.default.launch("unit 0 forward")
        allocated = cuda.default.launch("free/alloc: unit 1's hbm buffer")  # the compute thread, in fetch()
        may_read = threading.Event()
        job = reader.submit(lambda: (may_read.wait(5), h2d.copy(dst, src).wait()))
        cuda.default.launch("unit 1 forward")        # queued while the drive reads: the copy must not wait for it
        cuda.default.launch("unit 2 forward")
        may_read.set()
        job.wait()
        assert compute_before(cuda, h2d) == allocated, cuda.log
        assert torch.equal(dst, src)
    finally:
        reader.close()
        h2d.close()


def test_a_copy_issued_by_the_compute_thread_waits_for_its_stream_so_far(cuda):
    """dram -> hbm issued in fetch() right after the allocation: everything queued so far, which is the
    allocation and nothing after it."""
    h2d = CopyStream("h2d", torch.device("cuda"))
    try:
        upto = cuda.default.launch("free/alloc: the hbm buffer")
        h2d.copy(torch.zeros(2), torch.ones(2))
        cuda.default.launch("later compute")
        assert compute_before(cuda, h2d) == upto, cuda.log
    finally:
        h2d.close()


def test_a_copy_inside_a_copy_stream_job_follows_what_that_job_was_submitted_after(cuda):
    """The step's new weights copied up to hbm-resident weights from the d2h thread: the job was submitted
    after the unit's backward (which read those weights); the copy waits for that, not for later compute."""
    h2d, d2h = CopyStream("h2d", torch.device("cuda")), CopyStream("d2h", torch.device("cuda"))
    dst, src = torch.zeros(3), torch.ones(3)
    try:
        backward = cuda.default.launch("unit 3 backward")
        gate = threading.Event()
        job = d2h.submit(lambda: (gate.wait(5), h2d.copy(dst, src).wait()))
        cuda.default.launch("unit 2 backward")
        gate.set()
        job.wait()
        assert compute_before(cuda, h2d) == backward, cuda.log
    finally:
        for s in (h2d, d2h):
            s.close()
