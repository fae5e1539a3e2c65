"""`python -m offload.cli` runs the command line, as `python -m offload` and the `offload` script do
(it used to import the module and exit 0 having done nothing)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["offload.cli", "offload"])
def test_python_dash_m_runs_the_command(module):
    done = subprocess.run([sys.executable, "-m", module, "estimate", "--params", "1e6", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # 1e6 fp32 parameters at stage 0, nothing offloaded: weights 4 + gradients 4 + Adam's states 8 bytes each
    assert out["params"] == 1_000_000 and out["model_states"] == {"hbm_bytes": 16_000_000, "dram_bytes": 0,
                                                                  "nvme_bytes": 0}


def test_python_dash_m_offload_cli_reports_errors_with_exit_code_2():
    done = subprocess.run([sys.executable, "-m", "offload.cli", "train", "--steps", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--steps=0" in done.stderr


USER_SCRIPT = """
import torch, offload
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
cfg = {"precision": "fp32", "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"},
       "nvme_path": "./swap", "units": {"min_numel": 1}}
with offload.initialize(model, cfg) as eng:
    loss = eng(torch.ones(2, 64)).sum()
    eng.backward(loss)
    eng.step()
print("user script trained")
"""


def test_a_users_swap_folder_and_scheduler_py_do_not_shadow_the_package(tmp_path):
    """Our packages live under offload (offload.swap, offload.scheduler): a `./swap` folder (which the first
    run below creates) and a `scheduler.py` in the working directory are the user's, and every run works."""
    import offload

    (tmp_path / "scheduler.py").write_text("RUNS = 1\n")
    (tmp_path / "train.py").write_text(USER_SCRIPT)
    root = str(pathlib.Path(offload.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    run = lambda *argv: subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env,  # noqa: E731
                                       capture_output=True, text=True, timeout=300)
    for out in ("r1", "r2"):
        done = run("-m", "offload", "train", "--model", "tiny", "--steps", "1", "--nvme-path", "./swap",
                   "--out", out)
        assert done.returncode == 0, done.stderr[-3000:]
        assert (tmp_path / "swap").is_dir()
    done = run("train.py")
    assert done.returncode == 0 and "user script trained" in done.stdout, done.stderr[-3000:]
