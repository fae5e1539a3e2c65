import gzip
import json

import pytest
import torch

from offload.data import BUNDLED_CORPUS, BatchSampler, ByteTokenizer, load_tokens, split_tokens


def test_byte_tokenizer_round_trips_utf8_and_has_eos():
    tok = ByteTokenizer()
    text = "To be, or not to be — that is the question: ünïcødé"
    ids = tok.encode(text, eos=True)
    assert ids[-1] == tok.eos_id == 256 and max(ids[:-1]) < 256
    assert tok.decode(ids) == text
    assert tok.vocab_size == 257


def test_bundled_corpus_is_a_few_megabytes_of_shakespeare():
    with gzip.open(BUNDLED_CORPUS, "rb") as f:
        raw = f.read()
    assert 3e6 < len(raw) < 8e6
    tokens = load_tokens()
    assert tokens.dtype == torch.int16 and len(tokens) == len(raw)
    text = raw.decode("utf-8")
    assert "HAMLET:" in text and "To be, or not to be" in text


def test_text_and_jsonl_files(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("hello world")
    assert ByteTokenizer().decode(load_tokens(str(txt))) == "hello world"
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text(json.dumps({"text": "ab"}) + "\n\n" + json.dumps({"text": "c", "id": 1}) + "\n")
    assert load_tokens(str(jsonl)).tolist() == [97, 98, 256, 99, 256]


def test_bad_data_files_name_path_and_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        load_tokens(str(tmp_path / "missing.txt"))
    bad = tmp_path / "b.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"b.jsonl:2: not a record offload reads \(body\); --data takes .txt"):
        load_tokens(str(bad))
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"b.jsonl:1: not JSON"):
        load_tokens(str(bad))
    with pytest.raises(ValueError, match="seq_len=64"):
        BatchSampler(torch.zeros(10, dtype=torch.int16), 2, 64)


def test_data_that_is_not_utf8_names_the_file_line_and_byte(tmp_path):
    """The codec's own error gives a position in a read buffer; the file's line is what a person can find."""
    records = tmp_path / "r.json"
    records.write_bytes(b'[\n  {"text": "ok"},\n  {"text": "caf\xe9"}\n]\n')  # Latin-1
    with pytest.raises(ValueError, match=r"r.json:3: byte 16 of the line \(0xe9\) is not UTF-8 .*iconv -f latin1"):
        load_tokens(str(records))


def test_sampler_is_deterministic_shaped_and_contiguous():
    tokens = torch.arange(10_000, dtype=torch.int16) % 257
    a = BatchSampler(tokens, 4, 32, seed=5)
    x, y = a.batch(3)
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.long
    assert torch.equal(x, y)                                   # HF convention: the model shifts
    assert torch.equal(x[:, 1:], (x[:, :-1] + 1) % 257)        # windows are contiguous stretches
    b = BatchSampler(tokens, 4, 32, seed=5)
    first = [b for b, _ in zip(a, range(4))]
    again = [b for b, _ in zip(b, range(4))]
    assert all(torch.equal(p[0], q[0]) for p, q in zip(first, again))
    assert torch.equal(next(iter(BatchSampler(tokens, 4, 32, seed=5).iter_from(3)))[0], x)
    assert not torch.equal(BatchSampler(tokens, 4, 32, seed=6).batch(3)[0], x)
    assert not torch.equal(a.batch(4)[0], x)


def test_ranks_slice_the_same_global_batch():
    tokens = torch.arange(5_000, dtype=torch.int16)
    whole = BatchSampler(tokens, 6, 16, seed=1).batch(2)[0]
    parts = [BatchSampler(tokens, 3, 16, seed=1, rank=r, world_size=2).batch(2)[0] for r in range(2)]
    assert torch.equal(torch.cat(parts), whole)


def test_split_holds_out_the_tail():
    train, val = split_tokens(torch.arange(1000), 0.1)
    assert len(train) == 900 and val[0] == 900
