"""The CLI contract for `offload bench nvme`, `offload tune nvme` and `offload clean` (API.md)."""

import json
import os
import socket
import subprocess
import sys

import pytest

import swap.measure
from offload.cli import main
from swap import SwapStore
from swap.measure import parse_size
from swap.rundir import OWNER_FILE, RUN_PREFIX

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
