"""Swap bytes never outlive the process ([Note: unlinked data file] in swap/rundir.py): the data file has no
name, so SIGKILL leaves none of its bytes behind; the library installs no SIGTERM handler, so a SIGTERM
ends a script at once, even inside a long C call; owner.json, `offload clean --list`, engine.stats() and
describe() say where the bytes are."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import offload
from offload import swap
from offload.cli import main
from offload.swap import SwapStore, clean, list_runs
from offload.swap.rundir import OWNER_FILE, RUN_PREFIX
from tests.process_util import RESET, finish, start, wait_for


def files_bytes(root) -> dict[str, int]:
    """Every file under `root` with its bytes on disk (as `du` counts them)."""
    return {os.path.join(d, f): os.lstat(os.path.join(d, f)).st_blocks * 512
            for d, _, fs in os.walk(root) for f in fs}


def swap_bytes_held_by(pid: int, root) -> int:
    """Bytes on disk of the files process `pid` holds open under `root` (named or not)."""
    total = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith(str(root) + os.sep):
                total += os.stat(f"/proc/{pid}/fd/{fd}").st_blocks * 512
        except OSError:
            pass  # closed meanwhile
    return total


def free_bytes(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


# About 3.1M parameters on nvme/nvme: 6 MiB of bf16 weights and 37 MiB of fp32 master, m and v.
_TRAIN = RESET + """
import sys, torch, offload
torch.set_num_threads(1)
model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(12)])
cfg = {"offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}, "nvme_path": sys.argv[1],
       "units": {"min_numel": 1024}}
engine = offload.initialize(model, cfg)
x = torch.randn(8, 512)
engine.backward(engine(x).square().mean())
engine.step()
print("stepped", flush=True)
if sys.argv[2] == "train":
    while True:
        engine.backward(engine(x).square().mean())
        engine.step()
torch.set_num_threads(1)
a = torch.randn(8192, 8192)
print("computing", flush=True)
while True:
    a @ a  # about 1.1 TFLOP: seconds in one C call, with no Python instruction where a handler could run
"""


def _start_and_wait(tmp_path, mode: str):
    swap_dir = tmp_path / "swap"
    proc = start([_TRAIN, str(swap_dir), mode], tmp_path)
    wait_for(lambda: "stepped" in (tmp_path / "stdout").read_text(), "a first step", proc, tmp_path)
    return proc, swap_dir


def _assert_no_swap_bytes_left(swap_dir) -> None:
    left = files_bytes(swap_dir)
    assert {Path(f).name for f in left} <= {OWNER_FILE}, left  # no data file with a name
    assert sum(left.values()) <= 4096 * len(left), left  # owner.json: one block each
    [run] = list_runs(swap_dir)
    assert run.stale and run.swap_bytes == 0 and run.named_bytes == 0
    assert [r.path for r in clean(swap_dir)] == [run.path] and os.listdir(swap_dir) == []


def test_sigkill_mid_step_leaves_no_swap_bytes(tmp_path):
    proc, swap_dir = _start_and_wait(tmp_path, "train")
    held = swap_bytes_held_by(proc.pid, swap_dir)
    assert held >= 40 << 20, held  # the swap is under nvme_path while the process lives
    free_alive = free_bytes(swap_dir)
    time.sleep(0.3)  # into a later step
    proc.kill()
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    _assert_no_swap_bytes_left(swap_dir)
    # The file system has the blocks back. Polled: ext4 frees them when its journal commits (within ~5 s);
    # half of them, so that other processes writing to this drive meanwhile do not fail the test.
    deadline = time.monotonic() + 15
    while free_bytes(swap_dir) - free_alive < held // 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert free_bytes(swap_dir) - free_alive >= held // 2, (free_alive, free_bytes(swap_dir), held)


def test_sigterm_during_a_long_matmul_ends_the_script_within_a_second(tmp_path):
    proc, swap_dir = _start_and_wait(tmp_path, "matmul")
    wait_for(lambda: "computing" in (tmp_path / "stdout").read_text(), "the matmul", proc, tmp_path)
    time.sleep(0.5)  # inside the first matmul
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass
    elapsed = time.monotonic() - t0
    stdout, stderr = finish(proc, tmp_path)
    assert proc.returncode == -signal.SIGTERM, stderr
    assert elapsed < 1.0, f"SIGTERM took {elapsed:.2f} s to end the process"
    _assert_no_swap_bytes_left(swap_dir)


def test_the_library_installs_no_sigterm_handler(tmp_path):
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
        cfg = {"offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"},
               "nvme_path": str(tmp_path), "units": {"min_numel": 256}}
        with SwapStore(tmp_path, backend="threads"), offload.initialize(model, cfg):
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("tmpfile", [True, False], ids=["O_TMPFILE", "unlinked-after-open"])
def test_the_data_file_has_no_name_and_owner_json_records_its_bytes(tmp_path, monkeypatch, tmpfile):
    if not tmpfile:  # a file system without O_TMPFILE
        real_open = os.open

        def no_tmpfile(path, flags, *a, **k):
            if flags & os.O_TMPFILE == os.O_TMPFILE:
                raise OSError(errno.EOPNOTSUPP, "Operation not supported")
            return real_open(path, flags, *a, **k)

        monkeypatch.setattr(os, "open", no_tmpfile)
    with SwapStore(tmp_path, backend="threads") as store:
        assert store.file_kind == ("O_TMPFILE" if tmpfile else "unlinked after open")
        store.write("a", torch.ones(1 << 20)).wait()
        store.write("b", torch.ones(3 << 20)).wait()
        assert os.listdir(store.run_dir) == [OWNER_FILE]
        assert store.disk_bytes == 16 << 20 == os.stat(store.fd_path).st_blocks * 512
        assert os.readlink(store.fd_path).startswith(f"{store.run_dir}/")  # where the bytes are
        owner = json.loads((store.run_dir / OWNER_FILE).read_text())
        assert owner["pid"] == os.getpid() and owner["bytes"] == 16 << 20 and owner["fd"] == int(store.fd_path.rsplit("/", 1)[1])
        [run] = list_runs(tmp_path)
        assert run.alive and run.swap_bytes == 16 << 20 and run.named_bytes == 0
        store.write("a", torch.zeros(1 << 20)).wait()  # rewritten in place: no growth
        assert json.loads((store.run_dir / OWNER_FILE).read_text())["bytes"] == 16 << 20
        assert str(store.run_dir) in store.describe() and "16.0 MiB" in store.describe()
    assert os.listdir(tmp_path) == []


def test_a_forked_child_does_not_hold_the_data_file(tmp_path):
    with SwapStore(tmp_path, backend="threads") as store:
        store.write("a", torch.ones(1 << 20)).wait()
        fd = int(store.fd_path.rsplit("/", 1)[1])
        pid = os.fork()
        if pid == 0:  # the child: the inherited descriptor is closed, the store forgotten
            try:
                os.fstat(fd)
                code = 1
            except OSError as e:
                code = 0 if e.errno == errno.EBADF else 2
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert store.run_dir.exists() and store.disk_bytes == 4 << 20  # the parent's store is untouched


def test_clean_list_shows_live_runs_and_their_bytes(tmp_path, capsys):
    old = tmp_path / f"{RUN_PREFIX}old_version-1-abcd"  # an earlier version's crashed run: a named data.bin
    old.mkdir()
    (old / OWNER_FILE).write_text(json.dumps({"pid": _dead_pid(), "host": os.uname().nodename, "started": 1.0}))
    (old / "data.bin").write_bytes(b"x" * 8192)
    with SwapStore(tmp_path, backend="threads") as live:
        live.write("a", torch.ones(1 << 20)).wait()
        assert main(["clean", str(tmp_path), "--list", "--json"]) == 0
        out = capsys.readouterr().out
        listed = {r["path"]: r for r in json.loads(out.strip().splitlines()[-1])["runs"]}
        assert listed[str(live.run_dir)] == {"path": str(live.run_dir), "pid": os.getpid(), "host": os.uname().nodename,
                                             "alive": True, "swap_bytes": 4 << 20, "named_bytes": 0}
        assert listed[str(old)]["alive"] is False and listed[str(old)]["named_bytes"] == 8192
        assert "4.0 MiB" in out and old.exists()  # --list removes nothing
        assert main(["clean", str(tmp_path)]) == 0
        assert not old.exists() and live.run_dir.exists()


def test_list_runs_reads_the_exact_bytes_where_owner_json_lags(tmp_path, monkeypatch):
    monkeypatch.setattr(swap.rundir, "OWNER_RECORD_S", 1e9)  # owner.json rewritten only when grown by 1/8
    with SwapStore(tmp_path, backend="threads") as store:
        store.write("a", torch.ones(1 << 20)).wait()
        store.write("b", torch.ones(1)).wait()  # one more 4 KiB page: not recorded
        assert json.loads((store.run_dir / OWNER_FILE).read_text())["bytes"] == 4 << 20
        [run] = list_runs(tmp_path)
        assert run.swap_bytes == (4 << 20) + 4096 == store.disk_bytes  # from /proc/<pid>/fd/<fd>
        store.write("c", torch.ones(1 << 18)).wait()  # grown by more than an eighth: recorded
        assert json.loads((store.run_dir / OWNER_FILE).read_text())["bytes"] == (5 << 20) + 4096


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_engine_stats_and_the_placement_print_say_where_the_swap_is(tmp_path, capsys):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    cfg = {"offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"},
           "nvme_path": str(tmp_path), "units": {"min_numel": 256}}
    with offload.initialize(model, cfg) as engine:
        where = engine.stats()["swap"]
        [run] = list_runs(tmp_path)
        assert where["run_dir"] == str(run.path) and where["disk_bytes"] == engine.store.disk_bytes > 0
        assert where["proc_path"] == f"/proc/{os.getpid()}/fd/{engine.store.fd_path.rsplit('/', 1)[1]}"
        printed = capsys.readouterr().err  # the memory plan initialize prints ends with the swap line
        assert f"swap: " in printed and str(run.path) in printed and "`ls` does not show it" in printed
    assert engine.stats()["swap"]["disk_bytes"] == 0
