"""SwapStore round trips on both I/O backends, with O_DIRECT (disk) and buffered (/dev/shm) I/O."""

import os
import pathlib
import shutil
import uuid

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from offload.swap import ALIGN_BYTES, SwapStore, aligned_empty

BACKENDS = ["threads", "libaio"]  # libaio: marked below (tests/conftest.py)
SHM = pathlib.Path("/dev/shm")
DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.complex64]


def _modes():
    modes = [("disk", True)]
    if SHM.is_dir() and os.access(SHM, os.W_OK):
        modes.append(("shm", False))  # the buffered fallback, on a tmpfs
    return modes


@pytest.fixture(params=[pytest.param((e, fs, d), id=f"{e}-{fs}", marks=[pytest.mark.libaio] if e == "libaio" else [])
                        for e in BACKENDS for fs, d in _modes()])
def store(request, tmp_path):
    backend, fs, direct = request.param
    base = tmp_path if fs == "disk" else SHM / f"offload-test-{uuid.uuid4().hex[:8]}"
    s = SwapStore(base, backend=backend, block_bytes=256 << 10, queue_depth=8, threads=3, checksum=True,
                  direct=direct)
    assert s.direct is direct
    yield s
    s.close()
    if fs == "shm":
        shutil.rmtree(base, ignore_errors=True)


def _random(numel, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8, generator=g)
    return raw.view(dtype) if dtype != torch.bool else (raw % 2).view(torch.bool)


def _same(a, b):
    """Bitwise equality (random bytes include NaNs, which torch.equal calls unequal)."""
    as_bytes = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


SIZES = st.one_of(st.integers(0, 3 * ALIGN_BYTES), st.integers(0, 4 << 20),
                  st.sampled_from([4095, 4096, 4097, (256 << 10) + 1, 64 << 20]))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(nbytes=SIZES, dtype=st.sampled_from(DTYPES), aligned=st.booleans(), seed=st.integers(0, 2**31))
@example(nbytes=(64 << 20) + 3, dtype=torch.uint8, aligned=True, seed=0)  # the largest, odd size, every run
def test_round_trip_any_size_and_dtype(store, nbytes, dtype, aligned, seed):
    numel = nbytes // torch.empty((), dtype=dtype).element_size()
    src = _random(numel, dtype, seed)
    if aligned:
        src = aligned_empty(numel, dtype).copy_(src)
    key = f"k-{dtype}-{numel}"
    store.write(key, src).wait()
    assert key in store and store.nbytes(key) == src.nbytes
    out = aligned_empty(numel, dtype) if not aligned else torch.empty(numel + 1, dtype=dtype)[1:]
    store.read(key, out).wait()
    assert _same(out, src)


def test_many_concurrent_keys_shapes_and_overwrites(store):
    tensors = {f"unit.{i}": _random(n, torch.bfloat16, i).view(-1, 1) for i, n in
               enumerate([0, 1, 7, 2048, 2049, 100_000, 300_000, 1 << 20] * 4)}
    tickets = [store.write(k, v) for k, v in tensors.items()]
    for t in tickets:
        t.wait()
    assert len(store.keys()) == len(tensors)
    # overwrite half with new values (same size: in place; doubled size: a new extent)
    for i, k in enumerate(list(tensors)[::2]):
        n = tensors[k].numel() * (2 if i % 2 else 1)
        tensors[k] = _random(n, torch.bfloat16, 1000 + i)
    tickets = [store.write(k, v) for k, v in list(tensors.items())[::2]]
    outs = {k: torch.empty_like(v) for k, v in tensors.items()}
    reads = [store.read(k, outs[k]) for k in tensors]  # reads wait for pending writes of their key
    for t in tickets + reads:
        t.wait()
    for k, v in tensors.items():
        assert _same(outs[k], v), k


def test_noncontiguous_write_and_dtype_changing_read(store):
    x = torch.arange(12_000, dtype=torch.float32).view(100, 120).t()  # non-contiguous
    store.write("x", x).wait()
    raw = torch.empty(x.nbytes, dtype=torch.uint8)
    store.read("x", raw).wait()
    assert torch.equal(raw.view(torch.float32).view(120, 100), x)


def test_read_into_a_view_never_touches_its_neighbours(store):
    flat = aligned_empty(3 * ALIGN_BYTES, torch.uint8).fill_(0xAB)
    store.write("a", torch.full((ALIGN_BYTES + 10,), 7, dtype=torch.uint8)).wait()
    store.read("a", flat[: ALIGN_BYTES + 10]).wait()
    assert bool((flat[: ALIGN_BYTES + 10] == 7).all()) and bool((flat[ALIGN_BYTES + 10:] == 0xAB).all())


def test_delete_frees_space_for_reuse(store):
    store.write("a", torch.ones(1 << 18)).wait()
    end = store._extents.end_bytes
    store.delete("a")
    assert "a" not in store
    with pytest.raises(KeyError):
        store.read("a", torch.empty(1 << 18))
    store.write("b", torch.ones(1 << 18)).wait()
    assert store._extents.end_bytes == end


def test_bad_arguments_say_what_to_do(store):
    store.write("a", torch.ones(10)).wait()
    with pytest.raises(ValueError, match="has 80 bytes but key 'a' holds 40"):
        store.read("a", torch.empty(10, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        store.read("a", torch.empty(10, 2)[:, 0])
    with pytest.raises(ValueError, match="non-empty string"):
        store.write("", torch.ones(1))
    with pytest.raises(KeyError, match="never written"):
        store.read("missing", torch.empty(1))


def test_block_bytes_must_be_a_multiple_of_4096(tmp_path):
    with pytest.raises(ValueError, match="block_bytes=1000: must be a positive multiple of 4096"):
        SwapStore(tmp_path, block_bytes=1000)
    with pytest.raises(ValueError, match="backend='fast'"):
        SwapStore(tmp_path, backend="fast")


def test_digests_from_the_caller(tmp_path):
    """write(digests=) records the caller's digests; read(verify=False) leaves the check to the caller,
    whose check_digests names the first differing block (its file offset and length)."""
    from offload.swap import SwapCorruptionError
    from offload.swap.integrity import block_digest

    with SwapStore(tmp_path, backend="threads", block_bytes=8192, checksum=True) as store:
        x = torch.randn(5000)  # 20000 bytes: two 8 KiB blocks and a partial last page
        bounds = store.digest_bounds(x.numel(), 4)
        assert bounds == [0, 2048, 4096, 5000]
        digests = [block_digest(x.data_ptr() + 4 * b, 4 * (e - b)) for b, e in zip(bounds, bounds[1:])]
        store.write("x", x, digests=digests).wait()
        store.check_digests("x", digests)
        out = torch.empty_like(x)
        store.read("x", out).wait()  # the store's own check agrees with the caller's digests
        assert torch.equal(out, x)
        entry = store._index["x"]
        with open(store.fd_path, "r+b") as f:  # corrupt the partial last page
            f.seek(entry.offset + 16384 + 7)
            f.write(b"\x55")
        store.read("x", out, verify=False).wait()  # delivered unchecked
        got = [block_digest(out.data_ptr() + 4 * b, 4 * (e - b)) for b, e in zip(bounds, bounds[1:])]
        with pytest.raises(SwapCorruptionError, match="'x'") as e:
            store.check_digests("x", got)
        assert (e.value.offset, e.value.nbytes) == (entry.offset + 16384, 20000 - 16384)
        with pytest.raises(ValueError, match="2 given"):
            store.write("y", x, digests=digests[:2])
        with pytest.raises(ValueError, match="no digests"):
            store.check_digests("missing", got)
    with SwapStore(tmp_path, backend="threads", block_bytes=8192, checksum=False) as plain:
        plain.write("x", x, digests=digests).wait()  # checksums off: nothing to record, nothing to check
        with pytest.raises(ValueError, match="checksums off"):
            plain.check_digests("x", digests)


def test_a_hold_reads_the_bytes_it_held_while_the_keys_are_overwritten(store):
    """[Note: held entries]: writes to held keys go to other extents; the hold reads what was held; a key absent
    when held stays absent from it; released extents are reused before the file grows; one hold at a time."""
    a, b, c = (_random(300_000, torch.float32, seed) for seed in (1, 2, 3))
    store.write("a", a).wait()
    store.write("b", b).wait()
    before = store.disk_bytes
    held = store.hold(["a", "b", "never"])
    assert "a" in held and "b" in held and "never" not in held and held.nbytes == 2 * 1_200_128 == held.growth
    with pytest.raises(RuntimeError, match="held already"):
        store.hold(["a"])
    store.write("a", c).wait()      # elsewhere: the held extent is kept
    store.write("never", c).wait()  # written after the hold: not in it
    store.delete("b")               # deleted: its extent stays until released
    out = torch.empty_like(a)
    store.read("a", into=out).wait()
    assert _same(out, c)
    held.read("a", into=out).wait()
    assert _same(out, a)
    held.read("b", into=out).wait()
    assert _same(out, b)
    with pytest.raises(KeyError, match="never"):
        held.read("never", into=out)
    grown = store.disk_bytes
    assert grown >= before + 1_200_128  # "a" twice and "b", then "never"
    held.close()
    store.write("b", a).wait()      # into an extent the hold let go: the file does not grow
    assert store.disk_bytes == grown
    for key, want in (("a", c), ("b", a), ("never", c)):
        store.read(key, into=out).wait()
        assert _same(out, want), key
    again = store.hold(["a"])       # the next hold: a superseded "a" fits in the other one
    assert again.nbytes == 1_200_128 and again.growth == 0
    store.write("a", b).wait()
    assert store.disk_bytes == grown
    again.read("a", into=out).wait()
    assert _same(out, c)
    again.close()
    store.read("a", into=out).wait()
    assert _same(out, b)
