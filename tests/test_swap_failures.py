"""Failures: errors injected at the I/O backend boundary (ENOSPC, EIO, EACCES, short transfers), a full
file system at allocation, corrupted and truncated files, permission bits, cleanup on close/exit/crash."""

import errno
import os
import signal
import stat
import subprocess
import sys
import threading

import pytest
import torch

from offload import swap
from offload.swap import SwapCorruptionError, SwapIOError, SwapStore, clean, list_runs, open_backend
from offload.swap.rundir import RUN_PREFIX, create_file
from tests.swap_util import FaultyBackend
from tests.unprivileged import unwritable_dir

BACKENDS = ["threads", pytest.param("libaio", marks=pytest.mark.libaio)]  # libaio: tests/conftest.py


@pytest.fixture(params=BACKENDS)
def faulty(request, tmp_path):
    plan = {"fail": lambda b: None}
    backend = FaultyBackend(open_backend(request.param, queue_depth=4, threads=2), lambda b: plan["fail"](b))
    with SwapStore(tmp_path, backend=backend, block_bytes=64 << 10, checksum=True) as store:
        yield store, plan
    backend.close()


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO, errno.EACCES])
def test_failed_overwrite_leaves_the_key_missing_not_wrong(faulty, err):
    store, plan = faulty
    old = torch.arange(100_000, dtype=torch.float32)
    store.write("w", old).wait()
    plan["fail"] = lambda b: -err if b.write and b.offset % (128 << 10) else None  # every other block
    with pytest.raises(SwapIOError) as e:
        store.write("w", torch.zeros(100_000)).wait()
    assert e.value.errno == err and e.value.path == str(store.path)
    assert e.value.nbytes > 0 and e.value.offset % 4096 == 0
    assert f"offset={e.value.offset}" in str(e.value) and errno.errorcode[err] in str(e.value)
    assert "w" not in store
    with pytest.raises(KeyError):
        store.read("w", torch.empty(100_000))
    plan["fail"] = lambda b: None  # the store stays usable, and the freed extent is reused
    store.write("w", old).wait()
    out = torch.empty(100_000)
    store.read("w", out).wait()
    assert torch.equal(out, old)


def test_failed_new_key_is_missing_and_short_transfers_raise(faulty):
    store, plan = faulty
    plan["fail"] = lambda b: b.nbytes - 512 if b.write else None  # a short write
    with pytest.raises(SwapIOError, match="short write") as e:
        store.write("n", torch.ones(50_000)).wait()
    assert e.value.errno == errno.EIO and "n" not in store
    plan["fail"] = lambda b: None
    store.write("n", torch.ones(50_000)).wait()
    plan["fail"] = lambda b: 0 if not b.write else None  # a read hitting end of file
    with pytest.raises(SwapIOError, match="short read: 0 of"):
        store.read("n", torch.empty(50_000)).wait()


def test_full_file_system_at_allocation(tmp_path, monkeypatch):
    def no_space(fd, old_end, new_end):
        raise OSError(errno.ENOSPC, "No space left on device")

    with SwapStore(tmp_path, backend="threads") as store:
        store.write("a", torch.ones(1000)).wait()
        monkeypatch.setattr(swap.store, "_grow", no_space)
        with pytest.raises(SwapIOError, match="cannot grow swap file") as e:
            store.write("b", torch.ones(1 << 20)).wait()
        assert e.value.errno == errno.ENOSPC and e.value.nbytes == 4 << 20
        assert "b" not in store
        out = torch.empty(1000)
        store.read("a", out).wait()  # what was written before is not lost
        assert torch.equal(out, torch.ones(1000))


@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupted_entry_raises_instead_of_returning_garbage(tmp_path, backend, word_digest):
    with SwapStore(tmp_path, backend=backend, block_bytes=64 << 10, checksum=True) as store:
        x = torch.arange(100_000, dtype=torch.int32)
        store.write("x", x).wait()
        store.write("y", x + 1).wait()
        entry = store._index["x"]
        with open(store.fd_path, "r+b") as f:  # flip one byte in x's third block
            f.seek(entry.offset + 150_000)
            byte = f.read(1)
            f.seek(entry.offset + 150_000)
            f.write(bytes([byte[0] ^ 0x40]))
        with pytest.raises(SwapCorruptionError, match="checksum mismatch") as e:
            store.read("x", torch.empty_like(x)).wait()
        assert e.value.path == str(store.path) and e.value.offset == entry.offset + (128 << 10)
        out = torch.empty_like(x)
        store.read("y", out).wait()  # the neighbour is intact
        assert torch.equal(out, x + 1)
        os.truncate(store.fd_path, 0)  # truncated file: a short read
        with pytest.raises(SwapIOError, match="short read"):
            store.read("y", out).wait()


def test_permission_bits_and_no_symlink_following(tmp_path, monkeypatch):
    """A name planted as a symlink is refused, never followed: O_EXCL alone refuses it (so the outcome
    cannot tell O_NOFOLLOW's absence), hence the flags of the open itself are checked too."""
    base = tmp_path / "new" / "swap"
    with SwapStore(base, backend="threads") as store:
        store.write("a", torch.ones(10)).wait()
        assert stat.S_IMODE(base.stat().st_mode) == 0o700
        assert stat.S_IMODE(store.run_dir.stat().st_mode) == 0o700
        for f in store.run_dir.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
        os.symlink(tmp_path / "elsewhere", store.run_dir / "link")
        flags, real_open = [], os.open
        monkeypatch.setattr(os, "open", lambda path, f, *a, **k: flags.append(f) or real_open(path, f, *a, **k))
        with pytest.raises(OSError) as e:
            create_file(store.run_dir / "link")
        monkeypatch.undo()
        assert e.value.errno in (errno.ELOOP, errno.EEXIST)
        assert not (tmp_path / "elsewhere").exists()
        assert len(flags) == 1 and flags[0] & os.O_NOFOLLOW and flags[0] & os.O_EXCL and flags[0] & os.O_CREAT


def test_unwritable_directory_raises_swap_io_error(tmp_path):
    with unwritable_dir(tmp_path) as locked:  # as root (CI): a directory that refuses root too
        with pytest.raises(SwapIOError) as e:
            SwapStore(str(locked))
    assert e.value.errno in (errno.EACCES, errno.EPERM) and str(locked) in str(e.value)


def test_directory_under_a_file_raises_swap_io_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SwapIOError) as e:
        SwapStore(tmp_path / "file" / "swap")
    assert e.value.errno == errno.ENOTDIR and "file" in e.value.path


def test_probe_falls_back_to_buffered_when_o_direct_is_refused(tmp_path, monkeypatch, caplog):
    real_open = os.open

    def refuse_direct(path, flags, *a, **k):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", refuse_direct)
    monkeypatch.setattr(swap.rundir, "_direct_cache", {})
    caplog.set_level("WARNING", logger="swap")
    with SwapStore(tmp_path, backend="threads") as s1, SwapStore(tmp_path, backend="threads") as s2:
        assert not s1.direct and not s2.direct
        s1.write("a", torch.ones(5000)).wait()
        out = torch.empty(5000)
        s1.read("a", out).wait()
        assert torch.equal(out, torch.ones(5000))
    assert sum("refuses O_DIRECT" in r.message for r in caplog.records) == 1  # said once
    with pytest.raises(ValueError, match="direct=True"):
        SwapStore(tmp_path, direct=True)


def test_close_removes_files_and_is_idempotent(tmp_path):
    store = SwapStore(tmp_path, backend="threads")
    store.write("a", torch.ones(1 << 20)).wait()
    assert store.disk_bytes >= 4 << 20
    store.close()
    store.close()
    assert not store.run_dir.exists() and store.disk_bytes == 0
    with pytest.raises(ValueError, match="closed"):
        store.write("b", torch.ones(1))


def test_two_stores_in_one_directory_do_not_collide(tmp_path):
    with SwapStore(tmp_path) as a, SwapStore(tmp_path) as b:
        assert a.run_dir != b.run_dir
        a.write("k", torch.ones(10)).wait()
        b.write("k", torch.zeros(10)).wait()
        out = torch.empty(10)
        a.read("k", out).wait()
        assert torch.equal(out, torch.ones(10))


_CHILD = """
import os, signal, sys, torch
from offload.swap import SwapStore
s = SwapStore(sys.argv[1])
s.write("a", torch.ones(1000)).wait()
print(s.run_dir, flush=True)
if sys.argv[2] == "crash":
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_interpreter_exit_removes_files_and_crashed_runs_are_cleanable(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    exited = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), "exit"], capture_output=True,
                            text=True, env=env, check=True)
    assert not os.path.exists(exited.stdout.strip())
    crashed = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), "crash"], capture_output=True,
                             text=True, env=env)
    assert crashed.returncode == -signal.SIGKILL
    left = crashed.stdout.strip()
    assert os.path.isdir(left) and os.path.basename(left).startswith(RUN_PREFIX)
    with SwapStore(tmp_path) as live:
        runs = {str(r.path): r for r in list_runs(tmp_path)}
        assert runs[left].stale and not runs[str(live.run_dir)].stale
        removed = clean(tmp_path)
        assert [str(r.path) for r in removed] == [left]
        assert live.run_dir.exists() and not os.path.exists(left)


@pytest.fixture(params=["numpy", pytest.param("compiled", marks=pytest.mark.compiled_kernel)])
def word_digest(request):
    """swap.integrity's block digests from numpy's two passes, or from offload's compiled single pass."""
    from offload import swap
    from offload.kernels import cpu_adam

    swap.integrity.use_word_digest(None)  # numpy's, even where an engine built earlier installed the kernel's
    if request.param == "compiled" and not cpu_adam.use_for_swap_digests():
        pytest.skip("the CPU Adam kernel is unavailable here")
    yield request.param
    swap.integrity.use_word_digest(None)


@pytest.mark.compiled_kernel
@pytest.mark.parametrize("nbytes", [8, 4096, 1 << 20])
def test_compiled_word_digest_equals_numpys(nbytes):
    """offload's single pass gives the (sum, xor) numpy's two passes give, wrap-around included, so
    digests recorded by either verify under the other."""
    from offload.kernels import cpu_adam
    from offload.swap.integrity import _numpy_word_digest

    kernel = cpu_adam._get_kernel()
    if kernel is None:
        pytest.skip("the CPU Adam kernel is unavailable here")
    for fill in ("random", "ones"):
        buf = swap.aligned_empty(nbytes + 8)
        buf.view(torch.int64).random_() if fill == "random" else buf.fill_(0xFF)
        for addr in (buf.data_ptr(), buf.data_ptr() + 8):
            assert kernel.word_digest(addr, nbytes, -1) == _numpy_word_digest(addr, nbytes)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        kernel.word_digest(buf.data_ptr(), 12, -1)


@pytest.mark.parametrize("nbytes", [1, 7, 8, 4095, 4096, 65536 + 5])
def test_block_digest_sees_any_single_byte_change_and_zeroing(nbytes, word_digest):
    from offload.swap.integrity import block_digest

    buf = swap.aligned_empty(nbytes).random_(1, 256)
    ref = block_digest(buf.data_ptr(), nbytes)
    for pos in {0, nbytes // 2, nbytes - 1}:
        old = int(buf[pos])
        buf[pos] = old ^ 0x01
        assert block_digest(buf.data_ptr(), nbytes) != ref, pos
        buf[pos] = old
    assert block_digest(buf.data_ptr(), nbytes) == ref
    buf.zero_()
    assert block_digest(buf.data_ptr(), nbytes) != ref
