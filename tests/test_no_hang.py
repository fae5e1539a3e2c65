"""I/O never hangs ([Note: no wait without an end] in swap/pending.py): a completion callback that raises,
a dead libaio reaper or job thread, or a transfer that never completes make the waiter raise within
seconds; close() and interpreter exit end too, and remove the swap files."""

import errno
import faulthandler
import os
import subprocess
import sys
import threading

import pytest
import torch

from offload import swap
from offload.scheduler.streams import CopyStream, JobThread, Worker
from offload.swap import SwapIOError, SwapStore, open_backend
from offload.swap.pending import PendingTimeout, io_timeout_s

BACKENDS = ["threads", pytest.param("libaio", marks=pytest.mark.libaio)]  # libaio: tests/conftest.py
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def no_hang():
    """A regression fails with every thread's stack instead of hanging CI."""
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def within(seconds: float, fn):
    """Runs fn() on a thread and returns what it raised (None if nothing); fails if it is still blocked
    after `seconds`."""
    box = {}

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} still blocked after {seconds} s"
    return box.get("error")


class SilentBackend:
    """Takes blocks and never completes them: a drive that stopped answering, or a lost completion."""

    name, serial_completions = "silent", False

    def __init__(self):
        self.blocks = []

    def submit(self, blocks):
        self.blocks += blocks

    def close(self):
        pass


def test_io_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("OFFLOAD_IO_TIMEOUT_S", raising=False)
    assert io_timeout_s() == 600.0
    monkeypatch.setenv("OFFLOAD_IO_TIMEOUT_S", "2.5")
    assert io_timeout_s() == 2.5
    monkeypatch.setenv("OFFLOAD_IO_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="OFFLOAD_IO_TIMEOUT_S='soon': must be a positive number"):
        io_timeout_s()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failing_completion_callback_fails_the_ticket(tmp_path, monkeypatch, backend):
    """block_digest raising inside the per-block callback (on the backend's or a digest thread) reaches the
    waiter; the store stays usable and closes."""
    x = torch.arange(50_000, dtype=torch.float32)

    def broken(addr, nbytes):
        raise MemoryError("injected in a completion callback")

    with SwapStore(tmp_path, backend=backend, block_bytes=64 << 10, checksum=True) as store:
        store.write("x", x).wait()
        real = swap.integrity.block_digest
        monkeypatch.setattr(swap.integrity, "block_digest", broken)
        err = within(10, lambda: store.read("x", torch.empty_like(x)).wait())
        assert isinstance(err, MemoryError) and "injected" in str(err)
        err = within(10, lambda: store.write("y", x).wait())
        assert isinstance(err, MemoryError) and "y" not in store  # a failed write leaves the key missing
        monkeypatch.setattr(swap.integrity, "block_digest", real)
        out = torch.empty_like(x)
        store.read("x", out).wait()
        assert torch.equal(out, x)
    assert not store.run_dir.exists()


def test_a_dead_threads_worker_fails_what_was_queued_and_every_later_block(tmp_path, monkeypatch, caplog):
    from offload.swap import backends

    with SwapStore(tmp_path, backend="threads", threads=1, block_bytes=64 << 10) as store:
        store.write("a", torch.ones(1000)).wait()

        def broken(self):
            raise RuntimeError("injected queue failure")

        monkeypatch.setattr(backends._Queue, "pop", broken)
        err = within(10, lambda: store.write("b", torch.ones(100_000)).wait())
        assert isinstance(err, SwapIOError) and err.errno == errno.EIO
        assert "worker thread died" in str(err) and "injected queue failure" in str(err)
        monkeypatch.undo()
        err = within(10, lambda: store.read("a", torch.empty(1000)).wait())  # submitted after its death
        assert isinstance(err, SwapIOError) and "worker thread died" in str(err)
        assert any("thread died" in r.message for r in caplog.records)
        assert within(10, store.close) is None
    assert not store.run_dir.exists()


@pytest.mark.libaio
def test_a_dead_libaio_reaper_fails_what_it_owed_and_every_later_block(tmp_path, monkeypatch, caplog):
    from libaio import libaio as aio

    def broken(*args):
        raise OSError(errno.EINVAL, "injected io_getevents failure")

    with SwapStore(tmp_path, backend="libaio", block_bytes=64 << 10) as store:
        store.write("a", torch.ones(1000)).wait()
        monkeypatch.setattr(aio, "io_getevents", broken)
        err = within(10, lambda: store.write("b", torch.ones(100_000)).wait())
        assert isinstance(err, SwapIOError) and err.errno == errno.EIO
        assert "reaper thread died" in str(err) and "injected io_getevents failure" in str(err)
        assert "b" not in store
        err = within(10, lambda: store.read("a", torch.empty(1000)).wait())  # submitted after its death
        assert isinstance(err, SwapIOError) and "reaper thread died" in str(err)
        assert not store.backend._reaper.is_alive()
        assert any("thread died" in r.message for r in caplog.records)
        assert within(10, store.close) is None
    assert not store.run_dir.exists()


@pytest.mark.parametrize("backend", BACKENDS)
def test_submit_after_close_fails_the_blocks(backend):
    from offload.swap import ALIGN_BYTES, Block, aligned_empty

    eng = open_backend(backend)
    eng.close()
    got = []
    buf = aligned_empty(ALIGN_BYTES)
    eng.submit([Block(False, 0, 0, buf.data_ptr(), ALIGN_BYTES, lambda b, r: got.append((r, b.error)))])
    assert len(got) == 1 and got[0][0] == -errno.EIO and isinstance(got[0][1], RuntimeError)


def test_a_transfer_that_never_completes_times_out_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_IO_TIMEOUT_S", "0.5")
    backend = SilentBackend()
    store = SwapStore(tmp_path, backend=backend, block_bytes=64 << 10)
    ticket = store.write("layers.3/bf16#0", torch.ones(100_000))
    err = within(10, ticket.wait)
    assert isinstance(err, PendingTimeout) and isinstance(err, TimeoutError)
    msg = str(err)
    assert msg.startswith("swap write of 'layers.3/bf16#0' (400000 bytes), 8 of 8 blocks outstanding: not done "
                          "after 0.5 s;") and "OFFLOAD_IO_TIMEOUT_S" in msg
    err = within(10, lambda: store.read("layers.3/bf16#0", torch.empty(100_000)))  # waits for the write first
    assert isinstance(err, PendingTimeout)
    assert within(10, store.close) is None  # gives up on the stuck write, and still removes the files
    assert not store.run_dir.exists()


_EXIT_CHILD = """
import sys, torch
from offload.swap import SwapStore
class Silent:
    name, serial_completions = "silent", False
    def submit(self, blocks): pass
    def close(self): pass
s = SwapStore(sys.argv[1], backend=Silent())
s.write("stuck", torch.ones(1000))
print(s.run_dir, flush=True)
"""


def test_interpreter_exit_with_a_stuck_transfer_ends_and_removes_files(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, OFFLOAD_IO_TIMEOUT_S="1")
    proc = subprocess.run([sys.executable, "-c", _EXIT_CHILD, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "I/O still pending" in proc.stderr and "swap write of 'stuck'" in proc.stderr
    assert not os.path.exists(proc.stdout.strip())


# --- job threads (scheduler.streams) ----------------------------------------------------------------


@pytest.mark.parametrize("make", [lambda: Worker("w"), lambda: CopyStream("c", torch.device("cpu"))])
def test_a_jobs_error_reaches_its_waiter_and_the_thread_goes_on(make):
    stream = make()

    def bad():
        raise ValueError("injected job failure")

    failed, after = stream.submit(bad), stream.submit(lambda: None)
    err = within(10, failed.wait)
    assert isinstance(err, ValueError) and "injected" in str(err)
    assert within(10, after.wait) is None
    assert within(10, stream.close) is None


def test_a_dead_job_thread_fails_the_queued_jobs_and_later_ones():
    jobs = JobThread("dying")
    gate = threading.Event()
    first = jobs.submit(gate.wait, 10)
    real = jobs._run_one

    def dies_after_the_first(work):  # the loop itself fails, outside any job
        if work[0] is not first:
            raise RuntimeError("injected thread death")
        real(work)

    jobs._run_one = dies_after_the_first
    queued = [jobs.submit(lambda: None) for _ in range(3)]
    gate.set()
    assert within(10, first.wait) is None
    for job in queued:
        err = within(10, job.wait)
        assert isinstance(err, RuntimeError) and "offload-dying: its thread died" in str(err)
        assert "injected thread death" in str(err)
    err = within(10, jobs.submit(lambda: None).wait)  # submitted after its death: fails at once
    assert isinstance(err, RuntimeError) and "thread died" in str(err)
    assert within(10, jobs.close) is None


def test_a_job_that_never_ends_times_out_naming_it(monkeypatch):
    monkeypatch.setenv("OFFLOAD_IO_TIMEOUT_S", "0.5")
    worker = Worker("nvme-read")
    gate = threading.Event()

    def read_chunks():
        gate.wait(30)

    stuck = worker.submit(read_chunks)
    err = within(10, stuck.wait)
    assert isinstance(err, PendingTimeout) and "offload-nvme-read job" in str(err) and "read_chunks" in str(err)
    gate.set()
    assert within(10, worker.close) is None
