"""`make demo` (docs/training.md "make demo"): its `offload train` line parses and resolves, the files it names ship
with the package, and the bundled pirate instruction set is what offload/corpus/build_pirate.py writes: every
answer in the one style, the eval records and the two prompts asking what no training record asks."""

import importlib.util
import json
import pathlib
import shlex
import subprocess

import pytest

from offload import recipe
from offload.data import IGNORE, load_data

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORPUS = ROOT / "offload" / "corpus"


def demo_argv() -> list[str]:
    """The arguments of the `offload train` that `make demo` runs (make -n: printed, not run)."""
    proc = subprocess.run(["make", "-n", "-C", str(ROOT), "demo"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    [line] = [line for line in proc.stdout.replace("\\\n", " ").splitlines() if "/offload train " in line]
    return shlex.split(line.split("/offload train ", 1)[1])


def test_make_demo_fine_tunes_smollm2_with_lora_on_nvme_and_shows_before_and_after():
    args = recipe.train_parser().parse_args(demo_argv())
    assert args.model == "smollm2" and args.lora and args.lora_targets == "all-linear"
    assert (args.offload_param, args.offload_optimizer) == ("nvme", "nvme")
    cfg, run = recipe.resolve(args)
    assert run["eval"]["data"].endswith("pirate_eval.jsonl") and run["prompts"]["path"].endswith("pirate_prompts.txt")
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["offload"]
    shipped = {p for g in globs for p in (ROOT / "offload").glob(g)}
    for path in (run["data"], run["eval"]["data"], run["prompts"]["path"]):
        assert (ROOT / path).resolve() in shipped, path  # a wheel carries them


def _records(name: str) -> list[dict]:
    return [json.loads(line) for line in (CORPUS / name).read_text().splitlines()]


def test_the_bundled_instruction_set_is_what_its_script_writes(tmp_path):
    spec = importlib.util.spec_from_file_location("build_pirate", CORPUS / "build_pirate.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    build.main(str(tmp_path))
    for name in ("pirate_train.jsonl", "pirate_eval.jsonl", "pirate_prompts.txt"):
        assert (tmp_path / name).read_bytes() == (CORPUS / name).read_bytes(), name


def test_every_answer_is_a_short_pirates_and_the_held_out_questions_are_new():
    train, held = _records("pirate_train.jsonl"), _records("pirate_eval.jsonl")
    prompts = (CORPUS / "pirate_prompts.txt").read_text().splitlines()
    assert len(train) >= 200 and len(held) >= 25 and len(prompts) == 2
    for r in train + held:
        user, assistant = r["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        assert assistant["content"].startswith("Arr, matey! ") and len(assistant["content"].split()) <= 30
    asked = [r["messages"][0]["content"] for r in train]
    assert len(set(asked)) == len(asked)
    assert not set(asked) & {r["messages"][0]["content"] for r in held} and not set(asked) & set(prompts)
    examples = load_data(str(CORPUS / "pirate_train.jsonl"))  # bytes: the loss on the answers alone
    assert len(examples) == len(train) and all((y != IGNORE).any() for _, y in examples.rows)
