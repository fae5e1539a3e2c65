"""examples/train_with_flags.py: a plain loop that three lines put on the Engine runs with the flags;
examples/trainer_offload.py in a short run."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_with_flags.py")
TRAINER = os.path.join(ROOT, "examples", "trainer_offload.py")


def test_the_three_offload_lines():
    text = open(SCRIPT).read()
    marked = [line for line in text.splitlines() if "# offload (" in line]
    assert len(marked) == 3
    assert "offload.add_arguments(parser)" in marked[0]
    assert "offload.initialize(model, offload.config_from_args(args))" in marked[1]
    assert "engine.backward(loss); engine.step()" in marked[2]


@pytest.mark.parametrize("flags", [[], ["--offload-param", "nvme", "--offload-optimizer", "nvme"],
                                   ["--offload-optimizer", "cpu", "--precision", "fp32"]],
                         ids=["plain", "nvme", "cpu-fp32"])
def test_example_runs_two_steps(flags, tmp_path):
    if "nvme" in flags:
        flags = flags + ["--nvme-path", str(tmp_path / "swap")]
    proc = subprocess.run([sys.executable, SCRIPT, "--steps", "2", "--batch-size", "8", *flags],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step")]
    assert [line.split()[1] for line in lines] == ["1", "2"]
    if "nvme" in flags:
        assert os.listdir(tmp_path / "swap") == []  # engine.close() removed the swap files


def test_example_bad_flag_is_an_argparse_error():
    proc = subprocess.run([sys.executable, SCRIPT, "--offload-param", "disk"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert proc.returncode == 2 and "invalid choice: 'disk'" in proc.stderr


def test_trainer_example_logs_its_loss_in_a_short_run(tmp_path):
    """Fewer steps than the logging interval used to leave no loss to report (IndexError)."""
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, TRAINER, "--steps", "4", "--nvme-path", str(tmp_path / "swap")],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["steps"] == 4 and result["last_loss"] < result["first_loss"]
    proc = subprocess.run([sys.executable, TRAINER, "--steps", "0"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert proc.returncode == 2 and "--steps=0: must be at least 1" in proc.stderr
