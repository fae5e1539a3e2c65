"""`python -m offload.cli` runs the command line, as `python -m offload` and the `offload` script do
(it used to import the module and exit 0 having done nothing)."""

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["offload.cli", "offload"])
def test_python_dash_m_runs_the_command(module):
    done = subprocess.run([sys.executable, "-m", module, "estimate", "--params", "1e6", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["model_states"]["dram_bytes"] >= 0


def test_python_dash_m_offload_cli_reports_errors_with_exit_code_2():
    done = subprocess.run([sys.executable, "-m", "offload.cli", "train", "--steps", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--steps=0" in done.stderr
