"""The `offload train` command line: --help everywhere, one-line errors with exit code 2, --json last."""

import argparse
import gzip
import json
import os
import subprocess
import sys

import pytest
import torch

from offload.cli import build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _commands(parser, prefix=()):
    """Every runnable command path, e.g. ('train',), ('bench', 'nvme')."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield prefix
        return
    for name, sub in subs[0].choices.items():
        yield from _commands(sub, prefix + (name,))


COMMANDS = list(_commands(build_parser()))


def test_train_is_a_command():
    assert ("train",) in COMMANDS


def _exit_code(argv) -> int:
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_has_help(command, capsys):
    assert _exit_code([*command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: offload " + " ".join(command)) and len(out.splitlines()) > 3


def test_train_help_says_what_sigterm_does(capsys):
    assert _exit_code(["train", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "SIGTERM first lets the current step end and saves a checkpoint" in out and "143 for SIGTERM" in out


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_rejects_a_bad_flag_in_one_line(command, capsys):
    assert _exit_code([*command, "--no-such-flag"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("offload") and ": error: " in err


@pytest.mark.parametrize("argv, message", [(["--hbm", "2.5X"], "argument --hbm: '2.5X' is not a size; write e.g. 2.5G"),
                                           (["--dram", "0"], "argument --dram: '0': must be more than 0 bytes")])
def test_bad_tier_budgets_are_one_line_errors(argv, message, capsys):
    assert _exit_code(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("offload train: error: ") and message in err


@pytest.mark.parametrize("argv, message", [
    (["--data", "/nonexistent/corpus.txt"], "data file not found"),
    (["--model", "/nonexistent/model"], "neither a preset"),
    (["--model", "huge"], "neither a preset"),
    (["--offload-config", "/nonexistent/cfg.yaml"], "no such file"),
    (["--steps", "0"], "--steps=0"),
    (["--seq-len", "100000"], "--seq-len=100000: longer than the model's maximum of 256"),
    (["--steps", "3", "--warmup-steps", "3"], "--warmup-steps=3: must be less than --steps=3"),
    (["--lora", "0"], "--lora=0: the LoRA rank must be a positive integer"),  # states in hbm beside nvme weights
    # are allowed now where they fit: tests/test_train_lora.py refuses them where they do not
])
def test_bad_values_and_paths_are_one_line_errors(argv, message, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--model", "tiny", "--nvme-path", str(tmp_path / "swap"), "--out", str(out),
                 "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("offload train: error: ") and message in err
    assert not out.exists()  # nothing written for a run that never started


def _gzip_damaged() -> bytes:
    whole = bytearray(gzip.compress(b"hello world " * 1000, mtime=0))
    whole[30] ^= 0xFF  # inside the deflate stream
    whole[31] ^= 0xFF
    return bytes(whole)


@pytest.mark.parametrize("flag, name, content, message", [
    ("--data", "a.txt", b"hello\nworld\nthird \xd0 line\n",
     "--data: {path}:3: byte 7 of the line (0xd0) is not UTF-8 (invalid continuation byte); offload reads UTF-8"),
    ("--eval-data", "a.jsonl", b'{"text": "ok"}\n{"text": "\xd0x"}\n', "--eval-data: {path}:2: byte 11 of the line"),
    ("--data", "a.txt.gz", gzip.compress(b"fine\n\xff\n"), "--data: {path}:2: byte 1 of the line (0xff) is not UTF-8"),
    ("--data", "a.txt.gz", b"garbage, not gzip\n", "--data: {path}: not a whole gzip file (Not a gzipped file"),
    ("--eval-data", "a.jsonl.gz", gzip.compress(b'{"text": "ok"}\n' * 100)[:20],
     "--eval-data: {path}: not a whole gzip file (Compressed file ended before the end-of-stream marker"),
    ("--data", "a.txt.gz", _gzip_damaged(), "--data: {path}: not a whole gzip file (Error -3 while decompressing"),
], ids=["latin1-txt", "latin1-eval-jsonl", "latin1-txt-gz", "not-gzip", "gzip-cut-short", "gzip-damaged"])
def test_unreadable_data_files_say_flag_file_and_line(flag, name, content, message, tmp_path, capsys):
    """Bytes that are not UTF-8 and damaged .gz files: the flag, the file, the line, what to do, in one line."""
    path = tmp_path / name
    path.write_bytes(content)
    assert main(["train", "--model", "tiny", "--nvme-path", str(tmp_path / "swap"), "--out", str(tmp_path / "run"),
                 "--no-progress", "--steps", "1", flag, str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("offload train: error: "), err
    assert message.format(path=path) in err, err


def test_directory_without_config_json(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    assert main(["train", "--model", str(tmp_path / "m"), "--no-progress"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_json_report_is_the_last_stdout_line(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-m", "offload", "train", "--model", "tiny", "--steps", "2",
                           "--batch-size", "2", "--seq-len", "32", "--nvme-path", str(tmp_path / "swap"),
                           "--out", str(out), "--hbm", "256M", "--dram", "2.5G", "--json"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    report = json.loads(lines[-1])
    assert report["steps"] == 2 and len(report["losses"]) == 2 and report["tokens_per_step"] == 64
    tiers = report["stats"]["tiers"]  # the tier budgets the flags set
    assert (tiers["hbm"]["budget_bytes"], tiers["dram"]["budget_bytes"]) == (256 << 20, int(2.5 * 2**30))
    picked = "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"  # what auto picks on this CPU
    assert report["precision"] == report["config"]["precision"] == picked
    assert f"precision {picked} (auto: this CPU" in proc.stderr  # the memory plan says what was chosen and why
    assert any(line.strip().startswith("loss") for line in lines[:-1])     # the summary table came first
    assert "step/s" in proc.stderr or "s/step" in proc.stderr                # the progress bar, on stderr
    assert sorted(os.listdir(out)) == ["memory_and_links.png", "report.json"]
    assert os.listdir(tmp_path / "swap") == []                               # swap files removed


def test_a_resumed_run_says_where_it_resumed_and_counts_from_there(tmp_path, capsys):
    common = ["train", "--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--nvme-path", str(tmp_path / "s"),
              "--checkpoint-dir", str(tmp_path / "ck"), "--no-progress"]
    assert main([*common, "--steps", "2", "--save-every", "2", "--out", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    assert main([*common, "--steps", "4", "--resume", "latest", "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("offload train: tiny ("))
    assert "(resumed from " in header and "after step 2)" in header, header
    assert "(step 3) -> " in out and "(step 4)" in out, out  # the loss line counts from the checkpoint on
