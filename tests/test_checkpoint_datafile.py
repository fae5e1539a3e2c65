"""A checkpoint's data file ([Note: direct checkpoint writes]): past the page cache where the file system allows
it, through it where O_DIRECT is refused, the same bytes and ranges either way."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import zlib

import pytest
import torch

from offload.checkpoint import datafile
from offload.checkpoint import format as fmt
from offload.checkpoint.datafile import DataFile

# ranges of odd sizes and dtypes, one larger than the bounce buffer the tests set (64 KiB); none page-aligned in
# memory (the large one starts 4 bytes in), so none is padded to a page of the file
PIECES = [torch.arange(1000, dtype=torch.float32), torch.arange(7, dtype=torch.uint8),
          torch.randn(40_001, generator=torch.Generator().manual_seed(0))[1:], torch.arange(3, dtype=torch.bfloat16),
          torch.empty(0), torch.ones(4096, dtype=torch.int64)[:4095]]


def _write(directory) -> tuple[DataFile, list[dict]]:
    with DataFile(str(directory), "rank0.bin") as out:
        ranges = [out.write(t, 0, t.numel()) for t in PIECES]
        out.sync()
    return out, ranges


def _check(path, ranges) -> None:
    data = open(path, "rb").read()
    assert len(data) == sum(r["nbytes"] for r in ranges)  # no padding left at the end
    offset = 0
    for t, r in zip(PIECES, ranges):
        want = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        assert (r["offset"], r["nbytes"]) == (offset, len(want))
        assert data[offset:offset + len(want)] == want and r["crc32"] == zlib.crc32(want)
        offset += len(want)


@pytest.fixture(autouse=True)
def small_bounce(monkeypatch):
    monkeypatch.setattr(datafile, "BOUNCE_BYTES", 64 << 10)


def test_direct_writes_the_same_bytes(tmp_path):
    out, ranges = _write(tmp_path)
    if os.environ.get("OFFLOAD_CI") and not out.direct:
        pytest.fail(f"O_DIRECT was refused on {tmp_path}: this test is for a file system that takes it")
    if not out.direct:
        pytest.skip(f"O_DIRECT is refused on {tmp_path}")
    _check(tmp_path / "rank0.bin", ranges)


@pytest.mark.parametrize("direct", [True, False])
def test_aligned_ranges_start_at_a_page_and_go_out_from_their_own_memory(tmp_path, monkeypatch, direct):
    """A page-aligned range of STRAIGHT_BYTES or more starts at a page of the file (zeros before it), and once
    O_DIRECT took a write its whole pages go out from its own memory: only the rest is copied into the bounce
    buffer. Buffered, the same bytes; the ranges' offsets say where each one is."""
    from offload.swap.buffers import aligned_empty

    if not direct:
        monkeypatch.setattr(datafile, "_set_direct", lambda fd, on: False)
    copied, real = [], datafile.np.copyto
    monkeypatch.setattr(datafile.np, "copyto", lambda dst, src: copied.append(len(src)) or real(dst, src))
    aligned = aligned_empty(256 << 10, torch.uint8).view(torch.float32)
    aligned.copy_(torch.randn(aligned.numel(), generator=torch.Generator().manual_seed(1)))
    pieces = [torch.arange(16384, dtype=torch.float32), aligned, aligned[:1500], torch.arange(7, dtype=torch.uint8),
              aligned]  # a bounce buffer (64 KiB) flushed; straight; 6000 B (under STRAIGHT_BYTES); 7 B; padded, straight
    with DataFile(str(tmp_path), "rank0.bin") as out:
        ranges = [out.write(t, 0, t.numel()) for t in pieces]
        out.sync()
    if direct and not out.direct:
        pytest.skip(f"O_DIRECT is refused on {tmp_path}")
    assert [r["offset"] for r in ranges] == [0, 65536, 327680, 333680, 335872]  # 333687 padded to a page
    if direct:
        assert copied == [64 << 10, 1904, 7, 2185]
    data = open(tmp_path / "rank0.bin", "rb").read()
    assert len(data) == out.nbytes == 335872 + (256 << 10) and data[333687:335872] == bytes(2185)
    for t, r in zip(pieces, ranges):
        want = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        assert data[r["offset"]:r["offset"] + r["nbytes"]] == want and r["crc32"] == zlib.crc32(want)


def test_through_the_page_cache_where_direct_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(datafile, "_set_direct", lambda fd, on: False)
    out, ranges = _write(tmp_path)
    assert not out.direct
    _check(tmp_path / "rank0.bin", ranges)


def test_refused_at_the_first_write(tmp_path, monkeypatch):
    """A file system that takes the flag but fails the first O_DIRECT write (EINVAL): written buffered."""
    real_write, calls = os.write, []

    def write(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    flags = []
    monkeypatch.setattr(datafile, "_set_direct", lambda fd, on: flags.append(on) or on)
    monkeypatch.setattr(datafile.os, "write", write)
    out, ranges = _write(tmp_path)
    assert flags == [True, False] and not out.direct
    _check(tmp_path / "rank0.bin", ranges)


def test_a_full_disk_names_the_file_and_the_byte(tmp_path, monkeypatch):
    real_write = os.write

    def write(fd, data):
        if os.fstat(fd).st_size >= 64 << 10:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(datafile.os, "write", write)
    with pytest.raises(OSError, match=r"No space left on device \(writing \d+ bytes at byte 65536\)") as e:
        _write(tmp_path)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "rank0.bin")


def test_crc32_is_zlibs_and_isal_where_installed():
    """The ranges' crc32 are zlib's values (checkpoints load either way), computed by ISA-L where it is
    installed (a dependency on x86 and aarch64: 5x zlib's speed, the saver's largest CPU cost before)."""
    data = os.urandom((1 << 20) + 13)
    assert fmt.crc32(data) == zlib.crc32(data) and fmt.crc32(data[7:], 12345) == zlib.crc32(data[7:], 12345)
    if importlib.util.find_spec("isal") is not None:
        assert fmt.crc32.__module__.startswith("isal")


def test_manifest_is_readable_json(tmp_path):
    """manifest.json: a key a line down to a tensor's kinds (each kind's ranges on one line), json's values."""
    ranges = [{"begin": 0, "end": 4, "file": "rank0.bin", "offset": 0, "nbytes": 16, "crc32": 1}]
    m = {"format": fmt.FORMAT, "tensors": {"w": {"shape": [2, 2], "master": {"dtype": "float32", "ranges": ranges}},
                                           "b": {"shape": [], "aliases": []}}, "extra": {}}
    fmt.write_manifest(str(tmp_path), m)
    text = (tmp_path / fmt.MANIFEST).read_text()
    assert {k: v for k, v in json.loads(text).items() if k != fmt.DIGEST} == m
    assert '\n  "w": {\n   "shape": [2, 2],\n   "master": {"dtype": "float32", "ranges": [{"begin": 0' in text


def test_no_write_asks_more_than_write_bytes_of_the_drive(tmp_path, monkeypatch):
    """Every write() is at most WRITE_BYTES, straight from a range's memory and through the bounce buffer alike
    (a background save's write keeps the step's I/O waiting behind one such piece at most); the bytes are
    the same."""
    monkeypatch.setattr(datafile, "WRITE_BYTES", 16 << 10)
    sizes, write = [], os.write
    monkeypatch.setattr(datafile.os, "write", lambda fd, data: sizes.append(len(data)) or write(fd, data))
    out, ranges = _write(tmp_path)
    big = torch.randn(50_000, generator=torch.Generator().manual_seed(1))  # page-aligned: written straight
    with DataFile(str(tmp_path), "rank1.bin") as one:
        r = one.write(big, 0, big.numel())
        one.sync()
    assert max(sizes) == 16 << 10 and len(sizes) > 20
    _check(tmp_path / "rank0.bin", ranges)
    data = open(tmp_path / "rank1.bin", "rb").read()
    assert data[r["offset"]:r["offset"] + r["nbytes"]] == big.numpy().tobytes()
