"""Aligned host buffers and the BufferPool: alignment, padding, back-pressure, randomized invariants."""

import os
import sys
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.swap import ALIGN_BYTES, BufferPool, PoolExhaustedError, aligned_empty
from tests.memory_util import resident_pages


@pytest.mark.parametrize("numel", [0, 1, 1000, 4096, (1 << 20) + 3, 3 << 20])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.float64])
def test_aligned_empty_is_aligned_padded_and_usable(numel, dtype):
    t = aligned_empty(numel, dtype)
    assert t.dtype == dtype and t.shape == (numel,) and t.is_contiguous()
    assert t.data_ptr() % ALIGN_BYTES == 0
    storage_bytes = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    # O_DIRECT may move the whole padded size: the storage reaches at least that far
    assert storage_bytes >= max(ALIGN_BYTES, -(-numel * t.element_size() // ALIGN_BYTES) * ALIGN_BYTES)
    t.fill_(1)
    assert bool((t == 1).all())


def test_aligned_empty_memory_outlives_its_mmap_object():
    t = aligned_empty(2 << 20, torch.uint8)  # mmap path
    import gc
    gc.collect()
    t.fill_(7)
    assert int(t[-1]) == 7


def _check_invariants(pool, lent):
    start = lambda t: t.untyped_storage().data_ptr() + t.storage_offset()  # noqa: E731 (0-byte views too)
    spans = sorted((start(t), start(t) + pad) for t, pad, _ in lent)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, "pool handed out overlapping bytes"
    assert pool.used_bytes == sum(pad for _, pad, _ in lent)
    assert pool.used_bytes <= pool.capacity_bytes
    assert pool.peak_bytes >= pool.used_bytes
    for t, _, mark in lent:  # nobody else wrote into a lent buffer
        assert t.numel() == 0 or bool((t == mark).all())


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 300_000), st.integers(0, 10_000)), max_size=40))
def test_pool_random_alloc_free_keeps_invariants(ops):
    pool = BufferPool(1 << 20, timeout_s=0.0)
    lent = []  # (tensor, padded, mark)
    for is_acquire, nbytes, pick in ops:
        if is_acquire or not lent:
            padded = max(-(-nbytes // ALIGN_BYTES) * ALIGN_BYTES, ALIGN_BYTES)
            if pool.used_bytes + padded > pool.capacity_bytes:
                with pytest.raises(PoolExhaustedError):
                    pool.acquire(nbytes)
                continue
            t = pool.acquire(nbytes)
            assert t.dtype == torch.uint8 and t.numel() == nbytes and t.data_ptr() % ALIGN_BYTES == 0
            held = pool._lent[t.untyped_storage().data_ptr()][1]  # a cached buffer up to twice the size
            assert padded <= held <= 2 * padded
            mark = len(lent) % 251
            t.fill_(mark)
            lent.append((t, held, mark))
        else:
            t, _, _ = lent.pop(pick % len(lent))
            pool.release(t)
        _check_invariants(pool, lent)
    for t, _, _ in lent:
        pool.release(t)
    assert pool.used_bytes == 0


def test_pool_timeout_names_capacity_requested_and_used():
    pool = BufferPool(16 * ALIGN_BYTES, timeout_s=0.05)
    held = pool.acquire(12 * ALIGN_BYTES)
    with pytest.raises(PoolExhaustedError) as e:
        pool.acquire(8 * ALIGN_BYTES)
    msg = str(e.value)
    assert "capacity 65536" in msg and str(8 * ALIGN_BYTES) in msg and "in use 49152" in msg
    assert (e.value.capacity_bytes, e.value.requested_bytes, e.value.used_bytes) == (65536, 32768, 49152)
    pool.release(held)


def test_pool_request_larger_than_capacity_fails_at_once():
    pool = BufferPool(ALIGN_BYTES, timeout_s=60)
    with pytest.raises(PoolExhaustedError, match="capacity is 4096"):
        pool.acquire(ALIGN_BYTES + 1)


def test_pool_back_pressure_waits_for_a_release():
    pool = BufferPool(8 * ALIGN_BYTES, timeout_s=30)
    first = pool.acquire(6 * ALIGN_BYTES)
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(4 * ALIGN_BYTES)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got, "acquire must block while the pool is full"
    pool.release(first)
    waiter.join(10)
    assert len(got) == 1 and pool.used_bytes == 6 * ALIGN_BYTES  # the released buffer, taken whole
    assert pool.peak_bytes == 6 * ALIGN_BYTES


def test_pool_rejects_foreign_and_double_release():
    pool = BufferPool(1 << 16)
    t = pool.acquire(100)
    pool.release(t)
    with pytest.raises(ValueError, match="not acquired from this pool"):
        pool.release(t)
    with pytest.raises(ValueError):
        pool.release(torch.empty(10, dtype=torch.uint8))


def test_pool_reuses_released_buffers():
    pool = BufferPool(1 << 16)
    t = pool.acquire(5000)
    ptr = t.data_ptr()
    pool.release(t)
    assert pool.acquire(6000).data_ptr() == ptr  # same padded size class (8 KiB)


@pytest.mark.gpu
def test_pinned_buffers_are_page_locked_and_aligned():
    t = aligned_empty(3 << 20, torch.bfloat16, pin=True)
    assert t.is_pinned() and t.data_ptr() % ALIGN_BYTES == 0
    pool = BufferPool(8 << 20, pin=True)
    assert pool.acquire(5000).is_pinned()


def _mapped(ptr: int) -> bool:
    """Whether address `ptr` lies in one of this process's mappings."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False


class FakeCudart:
    """Records what aligned_empty registers; checks each unregister comes while the memory is still mapped."""

    def __init__(self):
        self.registered, self.unregistered = {}, []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr):
        assert ptr in self.registered and _mapped(ptr)
        self.unregistered.append(ptr)
        return 0


@pytest.mark.parametrize("nbytes", [5000, (40 << 20) + 4096])
def test_pinned_buffers_are_our_own_registered_mappings_of_the_asked_size(monkeypatch, nbytes):
    """[Note: pinned buffers are our own] A pinned buffer holds its size rounded to 4 KiB (torch's pinned
    allocator would hold 64 MiB for 40 MiB), registered whole; unregistered before it is unmapped."""
    import gc

    from offload.swap import buffers

    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(buffers, "_cudart", lambda: fake)
    t = aligned_empty(nbytes, torch.uint8, pin=True)
    ptr = t.data_ptr()
    assert fake.registered == {ptr: -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES} and ptr % ALIGN_BYTES == 0
    t[-1] = 7  # usable up to its end
    pool = BufferPool(1 << 20, pin=True)
    pool.release(pool.acquire(8192))
    assert len(fake.registered) == 2
    del t, pool
    gc.collect()
    assert sorted(fake.unregistered) == sorted(fake.registered)


def test_a_failed_registration_names_the_size(monkeypatch):
    from offload.swap import buffers

    class Refusing(FakeCudart):
        def cudaHostRegister(self, ptr, nbytes, flags):
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(buffers, "_cudart", lambda: Refusing())
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of 8192 bytes .*cudaError 2"):
        aligned_empty(8192, pin=True)


def test_pool_serves_a_request_from_a_cached_buffer_up_to_twice_its_size():
    """A request with no cached buffer of its size takes the smallest cached one of at most twice its
    size (an embedding's fetch served by a decoder layer's buffer) instead of mapping memory afresh;
    used_bytes counts the buffer whole, and it is cached again by its own size when released."""
    pool = BufferPool(1 << 20)
    big, bigger = pool.acquire(64 << 10), pool.acquire(96 << 10)
    pool.release(big)
    pool.release(bigger)
    t = pool.acquire(40 << 10)
    assert t.data_ptr() == big.data_ptr() and t.numel() == 40 << 10  # the smallest that fits
    assert pool.used_bytes == 64 << 10 and pool._cached_bytes == 96 << 10
    pool.release(t)
    assert pool.used_bytes == 0 and pool._cached_bytes == 160 << 10
    small = pool.acquire(20 << 10)  # both cached ones are over twice its size: a new buffer
    assert small.data_ptr() not in (big.data_ptr(), bigger.data_ptr()) and pool.used_bytes == 20 << 10


def test_pool_caches_at_most_max_cached_bytes():
    pool = BufferPool(1 << 20, max_cached_bytes=8192)
    a, b = pool.acquire(8192), pool.acquire(8192)
    pa, pb = a.data_ptr(), b.data_ptr()
    pool.release(a)
    pool.release(b)  # over the cap: dropped, not cached
    assert pool._cached_bytes == 8192 and pool.used_bytes == 0
    assert pool.acquire(8192).data_ptr() == pa  # the cached one is reused


def test_unpopulated_buffer_is_faulted_in_by_populate():
    """aligned_empty(populate=False) maps without touching (a fresh hbm copy on the CPU backend), and
    populate() faults it in (before nvme reads land in it: offload.state.tiers.Tiers.fault_in)."""
    from offload.swap.buffers import populate

    t = aligned_empty(16 << 20, populate=False)
    assert t.data_ptr() % ALIGN_BYTES == 0
    resident, pages = resident_pages(t)
    assert resident < pages // 2
    if not populate(t):
        pytest.skip("the kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert resident_pages(t) == (pages, pages)
    assert resident_pages(aligned_empty(16 << 20)) == (pages, pages)  # the default: populated at once


_HEAP_SCRIPT = """
import ctypes, sys, psutil, torch
from offload.swap.buffers import map_large_allocations
# what glibc does after the first large free of a training step: the mmap threshold raised (to up to
# 32 MB) and the trim threshold with it (twice that)
assert ctypes.CDLL(None).mallopt(-3, 32 << 20) == 1 and ctypes.CDLL(None).mallopt(-1, 64 << 20) == 1
if sys.argv[1] == "mapped":
    assert map_large_allocations()
base = psutil.Process().memory_info().rss
held, pins = [], []
for _ in range(100):  # 4 MiB each, as activations, each followed by a 100 KB heap allocation that stays
    held.append(torch.empty(1 << 20).fill_(1.0))
    pins.append(torch.empty(25000).fill_(1.0))
del held
print((psutil.Process().memory_info().rss - base) >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_allocations_leave_rss_when_freed_once_mapped():
    """swap.buffers.map_large_allocations (set by the engine on the CPU backend): 400 MiB of 4 MiB tensors
    freed leave RSS; with the threshold glibc raises after a large free they stay (heap chunks keep pages)."""
    import subprocess

    def retained(mode: str) -> int:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
        out = subprocess.run([sys.executable, "-c", _HEAP_SCRIPT, mode], capture_output=True, text=True, check=True,
                             env=env)
        return int(out.stdout.strip())

    assert retained("mapped") < 50 and retained("default") > 300
