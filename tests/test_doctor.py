"""`offload doctor`: the table in one run (rc 0, --json last), and each problem as one line with its fix:
a missing libaio, a swap path without O_DIRECT, a CPU without native bf16, a probe that raises."""

import errno
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from offload import doctor
from offload.plan import precision as prec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_doctor_prints_its_table_and_json_last(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "offload", "doctor", "--nvme-path", str(tmp_path), "--json"],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    report = json.loads(lines[-1])
    assert report["seconds"] < 30
    names = [c["name"] for c in report["checks"]]
    for name in ("versions", "cpu", "memory", "precision auto", "matmul", "memory bandwidth", "CPU Adam kernel",
                 "libaio", "O_DIRECT", "swap", "pinned memory"):
        assert name in names, names
    assert len(lines) - 1 == len(report["checks"]) + 2  # a head line, one line per check, a tail line
    limits = report["limits"]
    assert set(limits["matmul_gflops"]) == {"fp32", "bf16", "fp16"} and all(v > 0 for v in limits["matmul_gflops"].values())
    assert limits["copy_gbps"] > 0 and limits["swap_read_gbps"] > 0 and limits["swap_write_gbps"] > 0
    assert report["precision"]["auto"] == prec.resolve_precision("auto").name
    assert "Traceback" not in proc.stdout + proc.stderr
    assert os.listdir(tmp_path) == []  # the swap probe's run directory is gone


def _only(checks):
    [check] = checks
    assert "\n" not in check.line()
    return check


def test_the_longer_swap_run_the_doctor_suggests_runs_on_the_probed_path(tmp_path, monkeypatch, capsys):
    from offload.cli import main

    monkeypatch.setattr(doctor, "SWAP_BYTES", 8 << 20)
    monkeypatch.chdir(tmp_path)
    probed = str(tmp_path / "my swap")
    check = _only(doctor.probe_swap({"limits": {}}, probed))
    command = re.search(r"`offload (bench nvme [^`]*)`", check.value).group(1)
    argv = shlex.split(command.replace("--size 4G", "--size 16M"))
    assert main([*argv, "--engine", "threads", "--json"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["dir"] == probed


def test_a_missing_libaio_is_one_line_with_what_to_do(monkeypatch):
    monkeypatch.setitem(sys.modules, "libaio", None)  # import libaio -> ImportError
    check = _only(doctor.probe_libaio({}))
    assert check.status == "fail" and "pip install 'offload[aio]'" in check.fix and "apt-get install libaio1" in check.fix


def test_a_path_without_o_direct_is_one_line_with_what_to_do(tmp_path, monkeypatch):
    """tmpfs takes O_DIRECT since Linux 6.6 (this host runs 6.18), so the refusal is simulated as the
    kernel gives it: EINVAL from open."""
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    check = _only(doctor.probe_direct({}, str(tmp_path)))
    assert check.status == "warn" and "refuses O_DIRECT" in check.value and "--nvme-path" in check.fix
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(os, "open", real_open)
    assert _only(doctor.probe_direct({}, str(tmp_path))).status == "ok"


@pytest.mark.parametrize("native", [False, True])
def test_a_cpu_without_native_bf16_is_one_line_with_what_to_do(monkeypatch, native):
    monkeypatch.setattr(prec, "cpu_bf16_native", lambda: native)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    report = {}
    check = _only(doctor.probe_precision(report))
    assert report["precision"]["auto"] == ("bf16" if native else "fp32")
    if native:
        assert check.status == "ok" and not check.fix
    else:
        assert check.status == "warn" and "fp32" in check.value and "AVX512_BF16 or AMX" in check.fix


def test_a_probe_that_raises_is_one_failed_line_not_a_traceback(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no memory bandwidth today\nsecond line")

    for name in ("probe_matmul", "probe_swap", "probe_cpu_adam"):  # skip the slow ones too
        monkeypatch.setattr(doctor, name, lambda report, *a: [])
    monkeypatch.setattr(doctor, "copy_gbps", broken)
    report = doctor.run(str(tmp_path))
    [check] = [c for c in report["checks"] if c["name"] == "memory bandwidth"]
    assert check["status"] == "fail" and "RuntimeError: no memory bandwidth today second line" in check["value"]
    assert check["fix"]
    text = doctor.table(report)
    assert len(text.splitlines()) == len(report["checks"]) + 2 and "need attention" in text.splitlines()[-1]

