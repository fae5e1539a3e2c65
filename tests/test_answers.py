"""`offload train --sample-prompts` (offload/answers.py): each prompt is put to the model as --data's records put
theirs, and answered greedily before the first step and after the last, as the plain model with the engine's
weights of that moment answers it (a preset through its forward, a Hugging Face model through generate())."""

import json
import logging
import os

import pytest
import torch

from offload import recipe
from offload import train as training
from offload.answers import Answers, prompt_ids, read_prompts
from offload.cli import main
from offload.data import IGNORE, ByteTokenizer, Encoder, render, tokenize
from offload.models import build_model
from tests.hf_util import EXAMPLES, chat_tokenizer, save_chat_llama

RECORDS = {"messages": {"messages": [{"role": "user", "content": "What is the capital of France?"},
                                     {"role": "assistant", "content": "Paris."}]},
           "prompt_completion": {"prompt": "What is the capital of France?", "completion": " Paris."},
           "alpaca": {"instruction": "What is the capital of France?", "output": "Paris."}}


@pytest.mark.parametrize("tokenizer", ["bytes", "chat template", "no template"])
@pytest.mark.parametrize("shape", sorted(RECORDS))
def test_a_prompt_is_put_as_the_records_put_theirs_up_to_the_first_trained_token(shape, tokenizer):
    tok = {"bytes": lambda: None, "chat template": chat_tokenizer,
           "no template": lambda: chat_tokenizer(template=False)}[tokenizer]()
    encoder = Encoder(tok)
    ids, labels = tokenize(render(shape, RECORDS[shape], encoder), encoder)
    asked = prompt_ids("What is the capital of France?", shape, encoder)
    first = next(i for i, y in enumerate(labels) if y != IGNORE)
    assert first > 0 and asked == ids[:first]
    if tokenizer == "chat template" and shape == "messages":  # the generation prompt: the assistant's header
        assert tok.decode(asked).endswith("<|im_start|>assistant\n")


def test_text_data_takes_the_prompt_as_the_start_of_a_text():
    assert prompt_ids("To be, or", "text", Encoder(None)) == list(b"To be, or")


def _prompts(tmp_path, *lines) -> str:
    path = tmp_path / "prompts.txt"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def _spy(monkeypatch) -> list[dict]:
    """Wraps Answers.answer: the engine's full state at each call (the weights the answers come from)."""
    states, real = [], Answers.answer

    def answer(self, engine, step):
        engine.flush()
        states.append({"step": step, "state": engine.full_state_dict()})
        return real(self, engine, step)

    monkeypatch.setattr(Answers, "answer", answer)
    return states


def _greedy(model, ids: list[int], tokens: int, eos: int) -> list[int]:
    x, new = torch.tensor([ids]), []
    for _ in range(tokens):
        token = int(model(x)[0, -1].argmax())
        if token == eos:
            break
        new.append(token)
        x = torch.cat([x, torch.tensor([[token]])], dim=1)
    return new


def test_a_preset_answers_before_and_after_as_the_plain_model_with_those_weights(tmp_path, monkeypatch, capsys):
    """Trained to answer every question with "Paris.", the tiny preset says it after (to questions it never saw,
    ending at its EOS), and each answer is the plain model's greedy continuation with the engine's weights then."""
    states = _spy(monkeypatch)
    data = tmp_path / "paris.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant",
                                                                                   "content": "Paris."}]}) + "\n"
                            for q in ["What is the capital of France?", "Where is the Eiffel Tower?", "Name a city.",
                                      "Which city is on the Seine?", "Where do Parisians live?", "Hello there",
                                      "What city hosted the 1900 Olympics?", "Where is the Louvre?"]))
    prompts = ["Where is Notre Dame?", "Hi"]
    path = _prompts(tmp_path, prompts[0], "", prompts[1])  # blank lines are skipped
    report = training.train({"model": "tiny", "steps": 60, "batch_size": 4, "seq_len": 64, "lr": 0.005,
                             "data": str(data), "precision": "fp32", "sample_prompts": path, "sample_tokens": 12,
                             "nvme_path": str(tmp_path / "swap"), "out": str(tmp_path / "run"), "no_progress": True})
    asked = [(a["step"], a["prompt"]) for a in report["answers"]]
    assert asked == [(0, p) for p in prompts] + [(60, p) for p in prompts]
    assert [a["answer"] for a in report["answers"][2:]] == ["Paris.", "Paris."]
    assert [s["step"] for s in states] == [0, 60]
    model = build_model("tiny", seed=0)
    for s in states:
        model.load_state_dict(s["state"])
        for p in prompts:
            ids = prompt_ids(p, "messages", Encoder(None))
            expected = ByteTokenizer().decode(_greedy(model.eval(), ids, 12, ByteTokenizer.eos_id))
            [got] = [a["answer"] for a in report["answers"] if (a["step"], a["prompt"]) == (s["step"], p)]
            assert got == expected, (s["step"], p)
    out = capsys.readouterr().out
    summary = out[out.index("offload train: tiny, 60 steps"):]
    assert "answers     greedy, to --sample-prompts:" in summary
    assert f"    {prompts[1]}\n      step 0 " in summary and "      step 60  Paris.\n" in summary
    with open(report["files"]["report"]) as f:
        assert json.load(f)["answers"] == report["answers"]


def test_a_hugging_face_model_answers_as_its_generate_does_one_prompt_at_a_time(tmp_path, caplog):
    """The prompts go through generate() in one left-padded batch; each answer is the plain model's own greedy
    generate() of that prompt alone, through the chat template's generation prompt. After training, generate()'s
    forwards replay the recorded trace's start as the engine's own forwards do (no divergence from it)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    model_dir = tmp_path / "llama"
    tok = save_chat_llama(model_dir)
    prompts = ["What is the capital of France?", "Hello"]  # of different lengths: the batch is padded
    caplog.set_level(logging.WARNING, logger="offload")
    report = training.train({"model": str(model_dir), "steps": 1, "batch_size": 2, "seq_len": 96, "precision": "fp32",
                             "data": os.path.join(EXAMPLES, "chat.jsonl"), "sample_tokens": 10,
                             "sample_prompts": _prompts(tmp_path, *prompts), "nvme_path": str(tmp_path / "swap"),
                             "out": str(tmp_path / "run"), "no_progress": True})
    plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    expected = []
    for p in prompts:
        x = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                    return_tensors="pt", return_dict=True)
        out = plain.generate(**x, max_new_tokens=10, do_sample=False, pad_token_id=tok.eos_token_id)
        expected.append(tok.decode(out[0, x["input_ids"].shape[1]:], skip_special_tokens=True))
    assert [a["answer"] for a in report["answers"] if a["step"] == 0] == expected and any(expected)
    assert [a["step"] for a in report["answers"]] == [0, 0, 1, 1]
    assert not [r.message for r in caplog.records if "differs from the recorded trace" in r.message]


def test_the_sample_flags_are_checked(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"--sample-tokens: needs --sample-prompts PATH"):
        recipe.resolve(recipe.as_namespace({"sample_tokens": 5}))
    with pytest.raises(ValueError, match=r"--sample-tokens=0: must be a positive integer"):
        recipe.resolve(recipe.as_namespace({"sample_prompts": "p.txt", "sample_tokens": 0}))
    _, run = recipe.resolve(recipe.as_namespace({"sample_prompts": "p.txt"}))
    assert run["prompts"] == {"path": "p.txt", "max_new_tokens": 48}
    with pytest.raises(ValueError, match=r"p.jsonl: not a .txt file"):
        read_prompts(str(tmp_path / "p.jsonl"))
    with pytest.raises(ValueError, match=r"no prompts in it"):
        read_prompts(_prompts(tmp_path, "", "  "))
    missing = str(tmp_path / "none.txt")
    assert main(["train", "--model", "tiny", "--sample-prompts", missing, "--nvme-path", str(tmp_path / "swap"),
                 "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "prompts file not found" in err and missing in err, err
    assert not (tmp_path / "run").exists()
