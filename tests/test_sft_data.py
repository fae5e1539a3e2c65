"""Instruction data for `offload train --data` ([Note: what --data reads] in offload/data.py): each record
shape with its labels masked where TRL's SFT masks them, the byte tokenizer and a Hugging Face one with a
chat template, one example per row right-padded, refusals in one line, and a run that trains on them."""

import json
import os
import subprocess
import sys

import pytest
import torch

from offload import data
from offload.data import (
    IGNORE,
    ByteTokenizer,
    Examples,
    ExampleSampler,
    load_data,
    load_tokens,
)
from tests.hf_util import EXAMPLES, chat_tokenizer

EOS = ByteTokenizer.eos_id


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def trained(ids: torch.Tensor, labels: torch.Tensor) -> list[int]:
    """The ids the loss is taken on (in order)."""
    assert torch.equal(labels[labels != IGNORE], ids[labels != IGNORE])  # labels are the ids where trained
    return ids[labels != IGNORE].tolist()


def as_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def test_prompt_completion_trains_on_the_completion_and_its_eos(tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "2+2=", "completion": " 4"}, {"prompt": "Hi", "completion": "!"}])
    ex = load_data(path)
    assert isinstance(ex, Examples) and len(ex) == 2 and ex.shape == "prompt_completion"
    ids, labels = ex.rows[0]
    assert ids.tolist() == as_bytes("2+2= 4") + [EOS]
    assert labels.tolist() == [IGNORE] * 4 + as_bytes(" 4") + [EOS]


def test_messages_without_a_chat_template_use_the_plain_one_and_train_on_assistant_turns(tmp_path):
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"},
                    {"role": "assistant", "content": "Ciao."}]
    ids, labels = load_data(write_jsonl(tmp_path / "c.jsonl", [{"messages": conversation}])).rows[0]
    text = ("<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello.", "\n<|user|>\nBye\n<|assistant|>\nCiao.",
            "\n")
    assert ids.tolist() == as_bytes(text[0]) + [EOS] + as_bytes(text[1]) + [EOS] + as_bytes(text[2])
    assert trained(ids, labels) == as_bytes("Hello.") + [EOS] + as_bytes("Ciao.") + [EOS]


def test_alpaca_json_array_trains_on_the_rendered_records_not_the_json(tmp_path):
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps([{"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
                                {"instruction": "Say hi.", "output": "hi"}]))
    ex = load_data(str(path))
    assert ex.shape == "alpaca" and len(ex) == 2
    ids, labels = ex.rows[0]
    text = ByteTokenizer().decode(ids)
    assert text == data.ALPACA_PROMPT.format(instruction="Add the numbers.", input="2 and 3") + "5"
    assert '"instruction"' not in text and "{" not in text
    assert trained(ids, labels) == as_bytes("5") + [EOS]
    ids, labels = ex.rows[1]  # no input: the prompt without its Input section
    assert ByteTokenizer().decode(ids).startswith(data.ALPACA_PROMPT_NO_INPUT.format(instruction="Say hi."))
    assert trained(ids, labels) == as_bytes("hi") + [EOS]


def test_text_records_in_json_and_jsonl_are_one_packed_stream(tmp_path):
    records = [{"text": "ab"}, {"text": "c", "id": 1}]
    (tmp_path / "t.json").write_text(json.dumps(records))
    expected = [97, 98, EOS, 99, EOS]
    assert load_data(str(tmp_path / "t.json")).tolist() == expected
    assert load_data(write_jsonl(tmp_path / "t.jsonl", records)).tolist() == expected
    (tmp_path / "t.txt").write_text("ab")
    assert load_data(str(tmp_path / "t.txt")).tolist() == [97, 98]


@pytest.mark.parametrize("name,content,match", [
    ("a.ndjson", '{"text": "x"}\n', r"a.ndjson: not a data file offload reads; --data takes .txt"),
    ("a.csv", "text\nx\n", r"a.csv: not a data file offload reads; --data takes"),
    ("a.json", '{"text": "x"}', r"a.json: a JSON dict, not an array of records; --data takes"),
    ("a.json", '[{"question": "x", "answer": "y"}]', r"a.json\[0\]: not a record offload reads \(question, answer\)"),
    ("a.jsonl", '{"prompt": "x", "completion": "y"}\n{"text": "z"}\n',
     r"a.jsonl:2: a text record in a file of prompt_completion records; one file holds one shape"),
    ("a.jsonl", '{"prompt": "x", "completion": 3}\n', r"a.jsonl:1: field 'completion' is an int, not a string"),
    ("a.jsonl", '{"messages": [{"role": "user", "content": "x"}]}\n', r"a.jsonl:1: no \"assistant\" message"),
    ("a.jsonl", '{"messages": [{"role": "user"}]}\n', r"a.jsonl:1: \"messages\" must be a non-empty list"),
    ("a.json", "[]", r"a.json: no records; --data takes"),
])
def test_other_files_and_shapes_are_refused_in_one_line(tmp_path, name, content, match):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=match) as e:
        load_data(str(tmp_path / name))
    assert "\n" not in str(e.value)


def test_load_tokens_refuses_instruction_records(tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}])
    with pytest.raises(ValueError, match=r"prompt_completion records, which take the loss on completions only"):
        load_tokens(path)


def test_example_sampler_pads_truncates_and_covers_every_example_each_epoch():
    rows = [(torch.arange(n) + 1, torch.cat([torch.full((2,), IGNORE), torch.arange(2, n) + 1])) for n in (4, 6, 9)]
    sampler = ExampleSampler(Examples(rows, pad_id=0, shape="prompt_completion"), batch_size=3, seq_len=8, seed=1)
    ids, labels = sampler.batch(0)
    assert ids.shape == labels.shape == (3, 8) and ids.dtype == labels.dtype == torch.long
    assert sorted(int((row != 0).sum()) for row in ids) == [4, 6, 8]  # one example a row; the 9 cut to 8
    for x, y in zip(ids, labels):
        n = int((x != 0).sum())
        assert (y[n:] == IGNORE).all() and (y[:2] == IGNORE).all() and torch.equal(y[2:n], x[2:n])
    assert torch.equal(sampler.batch(5)[0], ExampleSampler(Examples(rows, 0, "x"), 3, 8, seed=1).batch(5)[0])
    assert not all(torch.equal(sampler.batch(i)[0], ExampleSampler(Examples(rows, 0, "x"), 3, 8, seed=2).batch(i)[0])
                   for i in range(4))


def test_example_sampler_leaves_out_examples_without_a_trained_token_in_seq_len():
    long_prompt = (torch.arange(10), torch.cat([torch.full((8,), IGNORE), torch.arange(8, 10)]))
    short = (torch.arange(3), torch.tensor([IGNORE, 1, 2]))
    with pytest.warns(data.DataWarning, match=r"1 of 2 examples have no completion token within seq_len=6"):
        sampler = ExampleSampler(Examples([long_prompt, short], 0, "x"), 2, 6)
    assert len(sampler.rows) == 1
    with pytest.raises(ValueError, match=r"seq_len=6: no example has a completion token within its first 6"):
        ExampleSampler(Examples([long_prompt], 0, "x"), 2, 6)


def test_the_bundled_examples_load():
    for name, shape in [("prompt_completion.jsonl", "prompt_completion"), ("chat.jsonl", "messages"),
                        ("alpaca.json", "alpaca")]:
        ex = load_data(os.path.join(EXAMPLES, name))
        assert ex.shape == shape and len(ex) >= 6
        assert all((y != IGNORE).any() and (y == IGNORE).any() for _, y in ex.rows)


# --- a Hugging Face tokenizer with a chat template -----------------------------------------------------------

def test_messages_with_the_tokenizers_chat_template_train_on_assistant_turns(tmp_path):
    tok = chat_tokenizer()
    conversation = [{"role": "user", "content": "What is the capital of France?"},
                    {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Hello there"},
                    {"role": "assistant", "content": "how are you?"}]
    ids, labels = load_data(write_jsonl(tmp_path / "c.jsonl", [{"messages": conversation}]), tok).rows[0]
    assert tok.decode(ids) == tok.apply_chat_template(conversation, tokenize=False)
    pieces = [tok.decode(ids[s]) for s in _runs(labels != IGNORE)]
    assert pieces == ["Paris.<|im_end|>\n", "how are you?<|im_end|>\n"]  # content and end of turn; no header
    assert "What is" not in "".join(pieces)


def test_a_hf_tokenizer_without_a_template_starts_examples_with_its_bos_and_uses_the_plain_chat(tmp_path):
    tok = chat_tokenizer(template=False)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    assert tok("Paris")["input_ids"][0] == bos  # as Llama's: BOS first by default
    ids, labels = load_data(write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "What is", "completion": " Paris."}]),
                            tok).rows[0]
    completion = tok(" Paris.", add_special_tokens=False)["input_ids"] + [eos]
    assert ids.tolist() == [bos] + tok("What is", add_special_tokens=False)["input_ids"] + completion
    assert trained(ids, labels) == completion and labels[0] == IGNORE
    conversation = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "how are you?"}]
    ids, labels = load_data(write_jsonl(tmp_path / "c.jsonl", [{"messages": conversation}]), tok).rows[0]
    assert ids[0] == bos and tok.decode(ids[1:]) == "<|user|>\nHello there\n<|assistant|>\nhow are you?</s>\n"
    assert trained(ids, labels) == tok("how are you?", add_special_tokens=False)["input_ids"] + [eos]


def _runs(mask: torch.Tensor) -> list[slice]:
    """Slices of the consecutive True stretches of a 1-D mask."""
    out, start = [], None
    for i, m in enumerate(mask.tolist() + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append(slice(start, i))
            start = None
    return out


# --- offload train on instruction data ------------------------------------------------------------------------


def test_train_takes_its_loss_on_completions_only(tmp_path):
    """The first step's loss is the model's loss on the first batch with the prompts masked: the same
    number as the seeded start computes on the sampler's batch, and not the loss over every token.
    --eval-data takes the same records."""
    from offload import train as training
    from offload.models import build_model

    path = tmp_path / "alpaca.json"  # short records: the Alpaca prompt is about 120 bytes, and tiny takes 256
    path.write_text(json.dumps([{"instruction": f"Add {a} and {b}.", "output": f"{a + b}"} for a, b in
                                [(1, 2), (30, 4), (5, 6), (17, 25)]]))
    path = str(path)
    report = training.train({"model": "tiny", "steps": 1, "batch_size": 2, "seq_len": 256, "data": path,
                           "eval_data": path, "eval_batches": 1, "precision": "fp32", "offload_param": "cpu",
                           "nvme_path": str(tmp_path / "swap"), "out": str(tmp_path / "run"), "no_progress": True})
    ids, labels = data.make_sampler(load_data(path), 2, 256, seed=0).batch(0)
    assert (labels == IGNORE).any() and "### Response:" in ByteTokenizer().decode(ids[0])
    model = build_model("tiny", seed=0)  # the seeded start the Engine materialized
    with torch.no_grad():
        masked, every = model(ids, labels=labels).item(), model(ids, labels=ids).item()
    assert report["losses"][0] == pytest.approx(masked, rel=1e-5) and abs(masked - every) > 1e-3
    assert [e["step"] for e in report["eval_losses"]] == [0, 1] and 0 < report["eval_losses"][1]["loss"] < 10
    assert report["eval_losses"][0]["loss"] == pytest.approx(masked, rel=1e-5)  # before training: the same batch


def test_train_a_hf_directory_on_chat_data_with_its_template(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from offload.cli import main

    model_dir = tmp_path / "llama"
    tok = chat_tokenizer(model_dir)
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(model_dir)
    rc = main(["train", "--model", str(model_dir), "--data", os.path.join(EXAMPLES, "chat.jsonl"), "--steps", "2",
               "--batch-size", "2", "--seq-len", "96", "--nvme-path", str(tmp_path / "swap"),
               "--out", str(tmp_path / "run"), "--json", "--no-progress"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["steps"] == 2 and all(0 < loss < 20 for loss in report["losses"])


def test_the_cli_refuses_other_data_files_in_one_line(tmp_path):
    bad = tmp_path / "alpaca.ndjson"
    bad.write_text('{"instruction": "x", "output": "y"}\n')
    done = subprocess.run([sys.executable, "-m", "offload", "train", "--data", str(bad), "--steps", "1",
                           "--nvme-path", str(tmp_path / "swap"), "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(f"offload train: error: --data: {bad}: not a data file")
    assert '{"prompt","completion"}' in done.stderr
