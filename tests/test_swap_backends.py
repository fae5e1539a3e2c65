"""The two I/O backends behind one Protocol: every block completes exactly once, errors as -errno."""

import errno
import os
import threading

import pytest
import torch

from offload.swap import ALIGN_BYTES, Block, aligned_empty, libaio_available, open_backend

BACKENDS = ["threads", pytest.param("libaio", marks=pytest.mark.libaio)]  # libaio: tests/conftest.py


def _run(backend, blocks_spec):
    results, lock, all_done = {}, threading.Lock(), threading.Event()

    def done(block, res):
        with lock:
            assert id(block) not in results, "a block completed twice"
            results[id(block)] = res
            if len(results) == len(blocks):
                all_done.set()

    blocks = [Block(w, fd, off, addr, n, done) for w, fd, off, addr, n in blocks_spec]
    backend.submit(blocks)
    assert all_done.wait(30)
    return [results[id(b)] for b in blocks]


@pytest.mark.parametrize("name", BACKENDS)
def test_more_blocks_than_queue_depth_round_trip(tmp_path, name):
    backend = open_backend(name, queue_depth=4, threads=3)
    assert backend.name == name
    n, size = 37, 3 * ALIGN_BYTES
    src = aligned_empty(n * size).random_(0, 256)
    dst = aligned_empty(n * size)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        res = _run(backend, [(True, fd, i * size, src.data_ptr() + i * size, size) for i in range(n)])
        assert res == [size] * n
        res = _run(backend, [(False, fd, i * size, dst.data_ptr() + i * size, size) for i in range(n)])
        assert res == [size] * n and torch.equal(src, dst)
        res = _run(backend, [(False, fd, n * size, dst.data_ptr(), size)])  # past the end of file
        assert res == [0]
    finally:
        os.close(fd)
        backend.close()


@pytest.mark.parametrize("name", BACKENDS)
def test_errors_come_back_as_negative_errno(tmp_path, name):
    backend = open_backend(name, queue_depth=2, threads=2)
    buf = aligned_empty(ALIGN_BYTES)
    fd = os.open(tmp_path / "g", os.O_RDONLY | os.O_CREAT, 0o600)
    good_fd = os.open(tmp_path / "ok", os.O_RDWR | os.O_CREAT, 0o600)
    bad_fd = os.open(tmp_path / "h", os.O_RDONLY | os.O_CREAT, 0o600)
    os.close(bad_fd)  # (opened last, so no later open reuses its number during the test)
    try:
        res = _run(backend, [(True, fd, 0, buf.data_ptr(), ALIGN_BYTES),  # write to a read-only fd
                            (False, bad_fd, 0, buf.data_ptr(), ALIGN_BYTES)])
        assert res == [-errno.EBADF, -errno.EBADF]
        # a refused block in the middle of a batch fails alone; its neighbours still complete
        mixed = [(True, good_fd, 0, buf.data_ptr(), ALIGN_BYTES), (False, bad_fd, 0, buf.data_ptr(), ALIGN_BYTES),
                 (True, good_fd, ALIGN_BYTES, buf.data_ptr(), ALIGN_BYTES)]
        assert _run(backend, mixed) == [ALIGN_BYTES, -errno.EBADF, ALIGN_BYTES]
    finally:
        os.close(fd)
        os.close(good_fd)
        backend.close()


def test_open_backend_validates_and_auto_says_which(caplog, monkeypatch):
    from offload import swap

    monkeypatch.setattr(swap.backends, "_announced", set())
    caplog.set_level("INFO", logger="swap")
    backend = open_backend("auto")
    assert backend.name == ("libaio" if libaio_available() else "threads")
    assert any(f"auto -> {backend.name}" in r.message for r in caplog.records)
    backend.close()
    open_backend("auto").close()
    assert sum("auto ->" in r.message for r in caplog.records) == 1  # once per process
    with pytest.raises(ValueError, match="queue_depth=0"):
        open_backend("libaio", queue_depth=0)
    with pytest.raises(ValueError, match="threads=0"):
        open_backend("threads", threads=0)
    with pytest.raises(ValueError, match="background_bytes=0"):
        open_backend("libaio", background_bytes=0)


class HeldFirst:
    """Seven blocks of one page written to a file, the first one's completion held (the only worker or the
    reaper waits in it: the drive busy) until finish(); `order`: the blocks in the order they completed;
    `seen(backend)` runs at each completion."""

    def __init__(self, tmp_path, seen=None):
        self.size, self.seen = ALIGN_BYTES, seen
        self.buf = aligned_empty(8 * self.size).random_(0, 256)
        self.fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        self.order, self.held, self.release, self.all_done = [], *(threading.Event() for _ in range(3))

    def done(self, block, res):
        assert res == self.size
        if self.seen is not None:
            self.seen()
        if not self.order and not self.held.is_set():
            self.held.set()
            assert self.release.wait(30)
        self.order.append(block.offset // self.size)
        if len(self.order) == 7:
            self.all_done.set()

    def block(self, i, urgent=False, idle=False):
        return Block(True, self.fd, i * self.size, self.buf.data_ptr() + i * self.size, self.size, self.done,
                     urgent, idle)

    def start(self, backend):
        """Block 0 submitted and with the drive, its completion held: what comes next queues behind it."""
        backend.submit([self.block(0)])
        assert self.held.wait(30)

    def finish(self, backend):
        """Block 6 submitted, the held completion let go, every block done, the backend and file closed."""
        try:
            backend.submit([self.block(6)])
            self.release.set()
            assert self.all_done.wait(30)
        finally:
            backend.close()
            os.close(self.fd)


@pytest.mark.parametrize("name", BACKENDS)
def test_urgent_blocks_go_ahead_of_queued_ones(tmp_path, name):
    """[Note: urgent blocks]: with the drive busy (one block in flight, its completion held), urgent blocks
    submitted after normal ones are served first, in their own order; nothing is lost."""
    backend = open_backend(name, queue_depth=1, threads=1)
    run = HeldFirst(tmp_path)
    run.start(backend)
    backend.submit([run.block(1), run.block(2), run.block(3)])
    backend.submit([run.block(4, True), run.block(5, True)])
    run.finish(backend)
    # libaio's slot is free again while block 0's completion runs: block 1 went to the drive at once
    in_flight = [0, 1] if name == "libaio" else [0]
    assert run.order == in_flight + [4, 5] + [i for i in (1, 2, 3, 6) if i not in in_flight]


@pytest.mark.skipif(not libaio_available(), reason="libaio.so.1 not installed")
def test_background_bytes_keeps_queued_state_blocks_from_the_drive_while_urgent_ones_pass(tmp_path):
    """[Note: urgent blocks]: with background_bytes one block, only one non-urgent block is with the drive
    at a time (the rest wait in the backend's queue, where urgent ones pass them), and urgent blocks still
    take the free slots at once; with no limit every free slot takes a queued block."""
    for limit in (ALIGN_BYTES, None):
        backend = open_backend("libaio", queue_depth=8, background_bytes=limit)
        seen = []
        run = HeldFirst(tmp_path, lambda: seen.append(backend._background_in_flight))
        run.start(backend)
        backend.submit([run.block(1), run.block(2), run.block(3)])
        in_flight = 8 - len(backend._free_slots)
        backend.submit([run.block(4, True), run.block(5, True)])
        run.finish(backend)
        if limit is None:
            assert in_flight == 3 and sorted(run.order) == list(range(7))
        else:
            assert in_flight == 1  # block 1: blocks 2 and 3 wait for it
            assert set(run.order[1:4]) == {1, 4, 5} and run.order[4:] == [2, 3, 6]
            assert max(seen) <= limit


@pytest.mark.parametrize("name", BACKENDS)
def test_idle_blocks_wait_for_every_other_block_and_go_one_at_a_time(tmp_path, name):
    """[Note: idle blocks]: idle blocks submitted with normal ones are served after them; with libaio only
    while nothing else waits, one in flight at a time, each in the kernel's idle I/O class (which the kernel
    takes: every block completes in full); every byte is written."""
    backend = open_backend(name, queue_depth=8, threads=1)
    idle_seen = []
    run = HeldFirst(tmp_path, lambda: idle_seen.append(getattr(backend, "_idle_in_flight", 0)))
    run.start(backend)
    backend.submit([run.block(1, idle=True), run.block(2, idle=True), run.block(3), run.block(4, idle=True),
                    run.block(5)])
    if name == "libaio":  # block 0's slot is free: 3 and 5 at once, then one idle block, the others wait
        assert 8 - len(backend._free_slots) == 3 and backend._idle_in_flight == 1
        slots = [cb for cb, b in zip(backend._iocbs, backend._slot_block) if b is not None]
        assert sorted(cb.u.c.flags for cb in slots) == [0, 0, 2]  # IOCB_FLAG_IOPRIO
        assert sorted(cb.aio_reqprio for cb in slots) == [0, 0, 3 << 13]  # the idle class
    run.finish(backend)
    if name == "threads":
        assert run.order == [0, 3, 5, 6, 1, 2, 4]
    else:
        assert run.order[0] == 0 and sorted(run.order) == list(range(7)) and max(idle_seen) <= 1
        assert run.order.index(1) < run.order.index(2) < run.order.index(4)  # in their order, each after the last
    with open(tmp_path / "f", "rb") as f:
        assert f.read(7 * run.size) == run.buf[:7 * run.size].numpy().tobytes()
