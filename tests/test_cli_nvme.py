"""The CLI contract for `offload bench nvme`, `offload tune nvme` and `offload clean` (API.md)."""

import json
import os
import socket
import subprocess
import sys

import pytest

from offload import swap
from offload.cli import main
from offload.swap import SwapStore
from offload.swap.measure import parse_size
from offload.swap.rundir import OWNER_FILE, RUN_PREFIX

AIO_KEYS = {"engine", "block_bytes", "queue_depth", "threads"}  # API.md's `aio` section


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("engine", ["threads", "auto"])
def test_bench_nvme_prints_a_table_and_json_last(tmp_path, capsys, engine):
    rc = main(["bench", "nvme", "--dir", str(tmp_path), "--size", "8M", "--engine", engine,
               "--block-bytes", "256K", "--queue-depth", "4", "--threads", "2", "--json"])
    out = capsys.readouterr().out
    assert rc == 0 and "task GB/s" in out and "e2e GB/s" in out
    r = _last_json(out)
    assert r["size_bytes"] == 8 << 20 and r["block_bytes"] == 256 << 10 and r["direct"] is True
    assert r["engine"] in ("threads", "libaio") and (engine == "auto" or r["engine"] == engine)
    for op in ("write", "read"):
        assert r[f"{op}_gbps"] > 0 and r[f"{op}_e2e_s"] >= r[f"{op}_task_s"] > 0
    assert r["warmup"] is True and r["first_write_gbps"] > 0
    assert os.listdir(tmp_path) == []  # the run directory is gone


def test_bench_nvme_bad_input_is_a_one_line_error(tmp_path, capsys):
    assert main(["bench", "nvme", "--dir", str(tmp_path), "--size", "lots"]) == 2
    assert "size='lots': not a size" in capsys.readouterr().err
    assert main(["bench", "nvme", "--dir", str(tmp_path), "--size", "1M", "--block-bytes", "1000"]) == 2
    assert "block_bytes=1000" in capsys.readouterr().err


def test_bench_nvme_defaults_to_what_training_uses(tmp_path, monkeypatch, capsys):
    """No --dir, no --block-bytes: the swap directory and the block size of `offload train`'s default run."""
    from offload.plan.config import Config
    from offload.recipe import DEFAULT_SWAP_DIR

    monkeypatch.chdir(tmp_path)
    assert main(["bench", "nvme", "--size", "16M", "--engine", "threads", "--json"]) == 0
    r = _last_json(capsys.readouterr().out)
    assert r["dir"] == DEFAULT_SWAP_DIR and r["block_bytes"] == Config().aio.block_bytes
    assert os.listdir(tmp_path / DEFAULT_SWAP_DIR) == []  # the run directory is gone


def test_parse_size_units():
    assert parse_size("4G") == 4 << 30 and parse_size("512MiB") == 512 << 20 and parse_size("64k") == 65536
    assert parse_size("4096") == 4096 and parse_size("1.5M") == 3 << 19


def test_tune_nvme_prints_best_aio_section_and_writes_png(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(swap.measure, "SWEEP_BLOCK_BYTES", (64 << 10, 256 << 10))
    monkeypatch.setattr(swap.measure, "SWEEP_QUEUE_DEPTHS", (4,))
    monkeypatch.setattr(swap.measure, "SWEEP_THREADS", (1, 2))
    plot = tmp_path / "sweep.png"
    swapdir = tmp_path / "swap"
    rc = main(["tune", "nvme", "--dir", str(swapdir), "--size", "4M", "--plot", str(plot), "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    r = _last_json(out)
    assert set(r["aio"]) == AIO_KEYS and r["aio"]["engine"] in ("libaio", "threads")
    assert len(r["results"]) == (2 * 1 + 2 * 2 if swap.libaio_available() else 2 * 2)
    best = min(r["results"], key=lambda x: x["write_task_s"] + x["read_task_s"])
    assert r["aio"] == {k: best[k] for k in AIO_KEYS}
    assert '"aio": {' in out and f'"block_bytes": {r["aio"]["block_bytes"]}' in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_clean_removes_stale_runs_only(tmp_path, capsys):
    stale = tmp_path / f"{RUN_PREFIX}crashed-1-abcd"
    stale.mkdir()
    (stale / OWNER_FILE).write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname(), "started": 1.0}))
    (stale / "data.bin").write_bytes(b"x" * 10)
    unrelated = tmp_path / "my-data"
    unrelated.mkdir()
    with SwapStore(tmp_path) as live:
        assert main(["clean", str(tmp_path), "--dry-run", "--json"]) == 0
        dry = _last_json(capsys.readouterr().out)
        assert dry["would_remove"] == [str(stale)] and stale.exists()
        assert main(["clean", str(tmp_path), "--json"]) == 0
        out = capsys.readouterr().out
        assert _last_json(out)["removed"] == [str(stale)] and "kept" in out
        assert not stale.exists() and live.run_dir.exists() and unrelated.exists()


def test_bench_nvme_holds_a_bounded_ring_not_the_size(tmp_path, capsys, monkeypatch):
    """64 MiB go to the drive through 2 keys of one full queue each (256 KiB x 4 = 1 MiB): 2 MiB of host
    memory, every key's bytes checked on the way back."""
    from offload import swap

    sizes = []
    real = swap.measure.aligned_empty
    monkeypatch.setattr(swap.measure, "aligned_empty", lambda n, *a, **k: (sizes.append(n), real(n, *a, **k))[1])
    assert main(["bench", "nvme", "--dir", str(tmp_path), "--size", "64M", "--engine", "threads",
                 "--block-bytes", "256K", "--queue-depth", "4", "--threads", "2", "--json"]) == 0
    out = capsys.readouterr().out
    r = _last_json(out)
    assert sizes == [2 << 20] and r["host_bytes"] == 2 << 20 and r["size_bytes"] == 64 << 20
    assert "task: from the first request submitted to the last completed" in out and "e2e: task plus" in out
    assert "a 2 MiB ring, whatever the size" in out


def test_bench_nvme_detects_bytes_that_did_not_come_back(tmp_path, monkeypatch, capsys):
    """Every slot's last key is checked: reading key 0 into both slots is caught."""
    from offload.swap.store import SwapStore

    real = SwapStore.read
    monkeypatch.setattr(SwapStore, "read", lambda self, key, into, **kw: real(self, "chunk.0", into, **kw))
    rc = main(["bench", "nvme", "--dir", str(tmp_path), "--size", "8M", "--engine", "threads",
               "--block-bytes", "256K", "--queue-depth", "4", "--threads", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "bytes read back from" in err and "differ from bytes written" in err, err
    assert "Traceback" not in err  # one line, as every user-facing error


def test_bench_nvme_refuses_a_ring_larger_than_half_the_available_ram(tmp_path, capsys, monkeypatch):
    from offload.swap import hostmem

    monkeypatch.setattr(hostmem, "available", lambda: 3 << 20)
    assert main(["bench", "nvme", "--dir", str(tmp_path), "--size", "64M", "--block-bytes", "1M",
                 "--queue-depth", "4"]) == 2
    err = capsys.readouterr().err
    assert "--block-bytes/--queue-depth: the bench would hold 8 MiB of host memory" in err and "smaller blocks" in err
