"""Training data without downloads: a byte-level tokenizer, the bundled corpus, local text/JSONL files,
and a deterministic seeded batch sampler.

The bundled corpus is 38 public-domain Shakespeare plays (offload/data/shakespeare.txt.gz, 5.0 MB of
text; offload/data/SOURCE.md says where it comes from).
"""

from __future__ import annotations

import gzip
import json
import os
from typing import Iterator

import numpy as np
import torch

BUNDLED_CORPUS = os.path.join(os.path.dirname(__file__), "data", "shakespeare.txt.gz")


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; EOS (256) separates documents. vocab_size = 257."""

    eos_id = 256
    vocab_size = 257

    def encode(self, text: str, eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ids + [self.eos_id] if eos else ids

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")


def _read_text(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read()


def _jsonl_documents(path: str) -> list[str]:
    docs = []
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not JSON ({e.msg}); each line must be {{\"text\": ...}}") from e
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"{path}:{line_no}: no string field \"text\"; each line must be {{\"text\": ...}}")
            docs.append(record["text"])
    return docs


def load_tokens(path: str | None = None, tokenizer: ByteTokenizer | None = None) -> torch.Tensor:
    """Token ids (int16, 1-D) of a local file, or of the bundled corpus when path is None.

    `.jsonl` (optionally `.jsonl.gz`): one {"text": ...} per line, each document followed by EOS.
    Anything else is read as UTF-8 text (gzipped if it ends in .gz), one document.
    """
    tokenizer = tokenizer or ByteTokenizer()
    path = BUNDLED_CORPUS if path is None else path
    if not os.path.isfile(path):
        raise FileNotFoundError(2, "data file not found; pass --data with a local .txt or .jsonl file", path)
    if path.endswith((".jsonl", ".jsonl.gz")):
        ids = [i for doc in _jsonl_documents(path) for i in tokenizer.encode(doc, eos=True)]
    else:
        ids = tokenizer.encode(_read_text(path))
    return torch.tensor(ids, dtype=torch.int16)   # int16 holds 0..256 at a quarter of int64's bytes


def split_tokens(tokens: torch.Tensor, val_fraction: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val): the last val_fraction of the stream is held out."""
    n_val = int(len(tokens) * val_fraction)
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]


class BatchSampler:
    """Random windows of a token stream, as (input_ids, labels) int64 tensors of [batch, seq].

    labels == input_ids (Hugging Face's convention: the model shifts). Deterministic: batch i depends
    only on (seed, i), so a resumed run picks up where it stopped with `start_step`. With world_size > 1,
    every rank draws the same global batch of batch_size * world_size windows and takes its own slice.
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1):
        if len(tokens) <= seq_len:
            raise ValueError(f"seq_len={seq_len}: the data has only {len(tokens)} tokens; "
                             f"use a shorter sequence or more data")
        if batch_size < 1 or seq_len < 2:
            raise ValueError(f"batch_size={batch_size}, seq_len={seq_len}: need batch_size >= 1 and seq_len >= 2")
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.seed, self.rank, self.world_size = seed, rank, world_size

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        # One stream per (seed, step); numpy's SeedSequence mixes both fully (torch's CPU generator
        # keeps only 32 bits of a seed, so packing seed and step into one integer would collide).
        rng = np.random.default_rng([self.seed, step])
        n_windows = len(self.tokens) - self.seq_len + 1
        starts = torch.from_numpy(rng.integers(0, n_windows, self.batch_size * self.world_size))
        starts = starts[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        offsets = starts[:, None] + torch.arange(self.seq_len)[None, :]      # [batch, seq]
        input_ids = self.tokens[offsets].long()
        return input_ids, input_ids.clone()

    def iter_from(self, start_step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        step = start_step
        while True:
            yield self.batch(step)
            step += 1

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.iter_from(0)


def causal_lm_windows(tokens: torch.Tensor, n: int, seq_len: int, seed: int) -> list[dict]:
    """n random windows of a token stream as causal-LM examples for Hugging Face loops (`input_ids` ==
    `labels`: the model shifts them), as the examples' Trainer and Accelerate loops take them."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - seq_len, (n,), generator=g)
    rows = [tokens[s:s + seq_len].long() for s in starts.tolist()]
    return [{"input_ids": r, "labels": r} for r in rows]
