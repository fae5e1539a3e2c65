"""Training data without downloads: a byte-level tokenizer, the bundled corpus, local data files, and
deterministic seeded batch samplers.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import warnings
import zlib
from typing import Iterator

import numpy as np
import torch

from offload.plan.settings import with_article

# [Note: what --data reads]
# By extension (a trailing .gz allowed): .txt is plain text; .jsonl holds one JSON record a line; .json
# one array of records. One file holds one record shape:
# - {"text"}: a document; documents are joined, each followed by EOS, into one token stream, and batches
#   are random windows of it (packing), trained on every token.
# - {"prompt", "completion"}: loss on the completion and the EOS after it (labels -100 on the prompt), as
#   TRL's SFT does; each piece is tokenized on its own.
# - {"messages": [{"role", "content"}, ...]}: rendered with the tokenizer's chat template when it has one,
#   else the plain template (PLAIN_CHAT_HEADER); loss on the assistant turns only.
# - Alpaca {"instruction", "input" (optional), "output"}: rendered with the Alpaca prompt (ALPACA_PROMPT),
#   loss on the output.
# Instruction records are batched one example per row, right-padded (ExampleSampler), never packed.
# Any other extension or shape is refused with one line saying what is read (DATA_SHAPES).
#
# The bundled corpus is 38 public-domain Shakespeare plays (offload/corpus/shakespeare.txt.gz, 5.0 MB of
# text; offload/corpus/SOURCE.md says where it comes from).

BUNDLED_CORPUS = os.path.join(os.path.dirname(__file__), "corpus", "shakespeare.txt.gz")


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


# --- data files: which extensions and record shapes are read --------------------------------------------

# What --data takes, in one line (every refusal ends with it).
DATA_SHAPES = ('--data takes .txt (plain text), or .jsonl (a record a line) / .json (an array of records) whose '
               'records are all {"text"}, all {"prompt","completion"}, all {"messages": [{"role","content"},...]} '
               'or all Alpaca {"instruction","input"?,"output"}; each may end in .gz')
_SUFFIXES = {".txt": "txt", ".jsonl": "jsonl", ".json": "json"}


def file_kind(path: str) -> str:
    """"txt", "jsonl" or "json" by the file's extension (a trailing .gz allowed); anything else is refused."""
    base = path[:-3] if path.endswith(".gz") else path
    kind = _SUFFIXES.get(os.path.splitext(base)[1].lower())
    if kind is None:
        raise ValueError(f"{path}: not a data file offload reads; {DATA_SHAPES}")
    return kind


def _open_text(path: str):
    return gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")


# What reading a .gz that does not decompress raises: a bad header or CRC, a stream cut short, damaged data.
_GZIP_ERRORS = (gzip.BadGzipFile, EOFError, zlib.error)


@contextlib.contextmanager
def _reading(path: str) -> Iterator[None]:
    """Inside: a file that is not UTF-8, or a .gz that does not decompress, raises one ValueError naming the
    file (and the line), what is wrong and what to do, instead of the codec's position in a buffer."""
    try:
        yield
    except UnicodeDecodeError as e:
        raise ValueError(_not_utf8(path, e)) from e
    except _GZIP_ERRORS as e:
        raise ValueError(f"{path}: not a whole gzip file ({e}); check it with `gzip -t {path}` (copy it again if "
                         "it is damaged or cut short), or drop the .gz from its name if it is not compressed") from e


def _not_utf8(path: str, error: UnicodeDecodeError) -> str:
    """Where `path` first fails to decode: each line on its own (a b"\\n" is never part of a UTF-8 character)."""
    with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                return (f"{path}:{line_no}: byte {e.start + 1} of the line (0x{line[e.start]:02x}) is not UTF-8 "
                        f"({e.reason}); offload reads UTF-8 text: convert the file, e.g. "
                        "`iconv -f latin1 -t utf-8 FILE > FILE.utf8` for a Latin-1 one")
    return f"{path}: not UTF-8 ({error}); offload reads UTF-8 text: convert the file"


def _read_text(path: str) -> str:
    with _reading(path), _open_text(path) as f:
        return f.read()


def read_records(path: str) -> list[tuple[str, dict]]:
    """(where, record) of a .jsonl or .json file: `where` is "path:line" or "path[i]", for errors."""
    with _reading(path), _open_text(path) as f:
        if file_kind(path) == "jsonl":
            rows = []
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    rows.append((f"{path}:{line_no}", _parse(line, f"{path}:{line_no}", "each line must be one record")))
            return rows
        data = _parse(f.read(), path, "a .json file must hold one array of records")
    if not isinstance(data, list):
        raise ValueError(f"{path}: a JSON {type(data).__name__}, not an array of records; {DATA_SHAPES}")
    return [(f"{path}[{i}]", r) for i, r in enumerate(data)]


def _parse(text: str, where: str, what: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg}); {what}; {DATA_SHAPES}") from e


def record_shape(record, where: str) -> str:
    """"text", "prompt_completion", "messages" or "alpaca"; any other record is refused."""
    if isinstance(record, dict):
        if "messages" in record:
            _check_messages(record["messages"], where)
            return "messages"
        if "prompt" in record and "completion" in record:
            return _strings(record, ("prompt", "completion"), where, "prompt_completion")
        if "instruction" in record and "output" in record:
            return _strings(record, ("instruction", "output") + (("input",) if "input" in record else ()), where,
                            "alpaca")
        if "text" in record:
            return _strings(record, ("text",), where, "text")
    keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
    raise ValueError(f"{where}: not a record offload reads ({keys}); {DATA_SHAPES}")


def _strings(record: dict, keys: tuple, where: str, shape: str) -> str:
    for k in keys:
        if not isinstance(record[k], str):
            raise ValueError(f"{where}: field {k!r} is {with_article(type(record[k]).__name__)}, not a string; {DATA_SHAPES}")
    return shape


def _check_messages(messages, where: str) -> None:
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)
    if not ok:
        raise ValueError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": str, \"content\": str}}; "
                         f"{DATA_SHAPES}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no \"assistant\" message, so nothing to train on; the loss is taken on "
                         f"assistant turns only")


def file_records(path: str) -> tuple[str, list[dict]]:
    """(shape, records) of a .jsonl / .json file: one shape for the whole file."""
    rows = read_records(path)
    if not rows:
        raise ValueError(f"{path}: no records; {DATA_SHAPES}")
    shape = record_shape(rows[0][1], rows[0][0])
    for where, record in rows[1:]:
        other = record_shape(record, where)
        if other != shape:
            raise ValueError(f"{where}: a {other} record in a file of {shape} records; one file holds one shape")
    return shape, [r for _, r in rows]


def _jsonl_documents(path: str) -> list[str]:
    """The texts of a file of {"text"} records (any other shape is refused: it carries no labels here)."""
    shape, records = file_records(path)
    if shape != "text":
        raise ValueError(f"{path}: {shape} records, which take the loss on completions only; read them with "
                         f"load_data() (offload train does), not as plain text")
    return [r["text"] for r in records]


def load_tokens(path: str | None = None, tokenizer=None) -> torch.Tensor:
    """Token ids (1-D) of a text file, or of the bundled corpus when path is None: int16 with the byte
    tokenizer (0..256 at a quarter of int64's bytes), int32 with a Hugging Face tokenizer.

    `.jsonl` / `.json` of {"text"} records: each document followed by EOS; `.txt`: one document, followed
    by EOS with a Hugging Face tokenizer only. Other extensions, and instruction records (load_data reads
    those), are refused.
    """
    path = _existing(path)
    encoder = Encoder(tokenizer)
    text_file = file_kind(path) == "txt"
    docs = [_read_text(path)] if text_file else _jsonl_documents(path)
    eos = [encoder.eos_id] if encoder.eos_id is not None and (encoder.hf or not text_file) else []
    ids: list[int] = []
    for doc in docs:
        ids += encoder.encode(doc) + eos
    return torch.tensor(ids, dtype=torch.int16 if encoder.hf is None else torch.int32)


def _existing(path: str | None) -> str:
    path = BUNDLED_CORPUS if path is None else path
    if not os.path.isfile(path):
        raise FileNotFoundError(2, "data file not found; pass --data with a local .txt, .jsonl or .json file", path)
    return path


# --- instruction data: rendered records, labels -100 outside the completion / assistant turns ---------------

class DataWarning(UserWarning):
    """Data that is read but not all used (the CLI prints it as one `offload: warning:` line)."""


IGNORE = -100  # the label of a token no loss is taken on (torch's cross_entropy ignore_index, as HF's)

# Alpaca records are rendered with the Stanford Alpaca prompt; the loss is taken on "output" only.
ALPACA_PROMPT = ("Below is an instruction that describes a task, paired with an input that provides further "
                 "context. Write a response that appropriately completes the request.\n\n"
                 "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_PROMPT_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately "
                          "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")

# Chat without a tokenizer chat template (the byte tokenizer, or a HF tokenizer that has none): each
# message is "<|role|>\n" + content + "\n"; an assistant's content is followed by EOS instead of "\n"
# and the loss is taken on that content and its EOS (headers and other turns: -100).
PLAIN_CHAT_HEADER = "<|{role}|>\n"


class Encoder:
    """Text -> ids for data files: the byte tokenizer (tokenizer None or a ByteTokenizer) or a Hugging Face
    tokenizer (the model directory's own, local files only)."""

    def __init__(self, tokenizer=None):
        self.hf = None if tokenizer is None or isinstance(tokenizer, ByteTokenizer) else tokenizer
        self.eos_id = ByteTokenizer.eos_id if self.hf is None else self.hf.eos_token_id
        pad = None if self.hf is None else self.hf.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_id if self.eos_id is not None else 0)
        self.eos = [] if self.eos_id is None else [self.eos_id]
        self.bos = [] if self.hf is None else _default_bos(self.hf)

    def encode(self, text: str) -> list[int]:
        if self.hf is None:
            return list(text.encode("utf-8"))
        ids: list[int] = []
        for start in range(0, len(text), 1 << 16):  # pieces, so a slow tokenizer never sees megabytes at once
            ids += self.hf(text[start:start + (1 << 16)], add_special_tokens=False)["input_ids"]
        return ids

    @property
    def chat_template(self) -> bool:
        return self.hf is not None and bool(getattr(self.hf, "chat_template", None))

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _default_bos(tokenizer) -> list[int]:
    """[BOS] where the tokenizer starts a text with it by default (Llama's), else []."""
    bos = tokenizer.bos_token_id
    return [bos] if bos is not None and tokenizer("a")["input_ids"][:1] == [bos] else []


Piece = tuple["str | list[int]", bool]  # (text, or token ids as they are; trained)


def render(shape: str, record: dict, encoder: Encoder) -> list[Piece]:
    """An instruction record as pieces, in order. Without a chat template an example starts with BOS
    where the tokenizer starts texts with it (as TRL tokenizes the prompt); a chat template writes its own."""
    if shape == "prompt_completion":  # as TRL's SFT: loss on the completion and the EOS after it
        return [(encoder.bos, False), (record["prompt"], False), (record["completion"], True), (encoder.eos, True)]
    if shape == "alpaca":
        template = ALPACA_PROMPT if record.get("input") else ALPACA_PROMPT_NO_INPUT
        prompt = template.format(instruction=record["instruction"], input=record.get("input", ""))
        return [(encoder.bos, False), (prompt, False), (record["output"], True), (encoder.eos, True)]
    if encoder.chat_template:
        return _template_pieces(record["messages"], encoder)
    return [(encoder.bos, False)] + _plain_chat_pieces(record["messages"], encoder.eos)


def _plain_chat_pieces(messages: list[dict], eos: list[int]) -> list[Piece]:
    pieces: list = []
    for m in messages:
        pieces.append((PLAIN_CHAT_HEADER.format(role=m["role"]), False))
        if m["role"] == "assistant":
            pieces += [(m["content"], True), (eos, True), ("\n", False)]
        else:
            pieces.append((m["content"] + "\n", False))
    return pieces


def _template_pieces(messages: list[dict], encoder: Encoder) -> list[Piece]:
    """The tokenizer's chat template, cut at each assistant turn: the text before it (with the generation
    prompt, the assistant header) is not trained; what the turn adds (its content and end-of-turn) is."""
    pieces, done = [], ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, after = encoder.render(messages[:i], True), encoder.render(messages[:i + 1], False)
        if not (before.startswith(done) and after.startswith(before)):
            raise ValueError("the tokenizer's chat template does not render a conversation as the prefix of its "
                             "continuation, so assistant turns cannot be told apart; give prompt/completion "
                             "records instead")
        pieces += [(before[len(done):], False), (after[len(before):], True)]
        done = after
    full = encoder.render(messages, False)
    return pieces + [(full[len(done):], False)]


def tokenize(pieces: list[Piece], encoder: Encoder) -> tuple[list[int], list[int]]:
    """(ids, labels): each text piece tokenized on its own (as TRL tokenizes prompt and completion), labels
    IGNORE on pieces not trained."""
    ids: list[int] = []
    labels: list[int] = []
    for piece, trained in pieces:
        part = piece if isinstance(piece, list) else encoder.encode(piece)
        ids += part
        labels += part if trained else [IGNORE] * len(part)
    return ids, labels


class Examples:
    """Instruction examples, each (ids, labels) as int64 tensors, labels IGNORE where no loss is taken;
    pad_id fills the rows of a batch after an example's end."""

    def __init__(self, rows: list[tuple[torch.Tensor, torch.Tensor]], pad_id: int, shape: str):
        self.rows, self.pad_id, self.shape = rows, pad_id, shape

    def __len__(self) -> int:
        return len(self.rows)


def load_data(path: str | None, tokenizer=None) -> "torch.Tensor | Examples":
    """--data: a token stream (text: .txt or {"text"} records, or the bundled corpus when path is None),
    trained on every token, or Examples (prompt/completion, messages, Alpaca), trained on completions
    and assistant turns only. The tokenizer: None (bytes) or a Hugging Face tokenizer."""
    path = _existing(path)
    if file_kind(path) == "txt":
        return load_tokens(path, tokenizer)
    shape, records = file_records(path)
    if shape == "text":
        return load_tokens(path, tokenizer)
    encoder = Encoder(tokenizer)
    rows = []
    for i, record in enumerate(records):
        try:
            ids, labels = tokenize(render(shape, record, encoder), encoder)
        except Exception as e:  # a chat template that refuses the conversation: say which record
            raise ValueError(f"{path}: record {i}: {e}") from e
        rows.append((torch.tensor(ids, dtype=torch.long), torch.tensor(labels, dtype=torch.long)))
    return Examples(rows, encoder.pad_id, shape)


def make_sampler(data: "torch.Tensor | Examples", batch_size: int, seq_len: int, seed: int = 0):
    """The sampler for load_data's result: random windows of a token stream (packed), or whole examples
    one per row, right-padded (padding)."""
    if isinstance(data, Examples):
        return ExampleSampler(data, batch_size, seq_len, seed=seed)
    return BatchSampler(data, batch_size, seq_len, seed=seed)


def split_tokens(tokens: torch.Tensor, val_fraction: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val): the last val_fraction of the stream is held out."""
    n_val = int(len(tokens) * val_fraction)
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]


class _Batches:
    """Iteration over `batch(i)`, the one method a sampler defines (batch i depends only on its seed and i)."""

    def iter_from(self, start_step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        step = start_step
        while True:
            yield self.batch(step)
            step += 1

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.iter_from(0)


class BatchSampler(_Batches):
    """Random windows of a token stream, as (input_ids, labels) int64 tensors of [batch, seq].

    labels == input_ids (Hugging Face's convention: the model shifts). Deterministic: batch i depends
    only on (seed, i), so a resumed run picks up where it stopped with `start_step`. With world_size > 1,
    every rank draws the same global batch of batch_size * world_size windows and takes its own slice.
    """

    shape = "text"  # the record shape it samples (ExampleSampler's: its examples')

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


class ExampleSampler(_Batches):
    """Instruction examples one per row, as (input_ids, labels) int64 tensors of [batch, seq] (padding, not
    packing: no row mixes two examples). An example longer than seq_len is cut to its first seq_len tokens
    (as TRL's truncation); a shorter one is right-padded with pad_id, labels IGNORE. Right padding needs no
    attention mask in a causal model: a pad attends only to the tokens before it, and no loss is taken on it.
    Examples with no trained token after the first within seq_len (the model predicts position t from the
    tokens before it) are left out, with a warning. Rows come in a seeded order, every example once per
    epoch; batch i depends only on (seed, i), so a resumed run continues with `batch(step)` as BatchSampler.
    """

    def __init__(self, examples: Examples, batch_size: int, seq_len: int, seed: int = 0):
        if batch_size < 1 or seq_len < 2:
            raise ValueError(f"batch_size={batch_size}, seq_len={seq_len}: need batch_size >= 1 and seq_len >= 2")
        kept = [r for r in examples.rows if (r[1][1:seq_len] != IGNORE).any()]
        if not kept:
            raise ValueError(f"seq_len={seq_len}: no example has a completion token within its first {seq_len} "
                             f"tokens; use a longer sequence or shorter prompts")
        if len(kept) < len(examples.rows):
            warnings.warn(f"{len(examples.rows) - len(kept)} of {len(examples.rows)} examples have no completion "
                          f"token within seq_len={seq_len} and are left out; a longer sequence keeps them",
                          DataWarning, stacklevel=2)
        self.rows, self.pad_id, self.shape = kept, examples.pad_id, examples.shape
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.full((self.batch_size, self.seq_len), self.pad_id, dtype=torch.long)
        labels = torch.full((self.batch_size, self.seq_len), IGNORE, dtype=torch.long)
        n, orders = len(self.rows), {}
        for j in range(self.batch_size):
            epoch, at = divmod(step * self.batch_size + j, n)
            if epoch not in orders:
                orders[epoch] = self._order(epoch)
            x, y = self.rows[orders[epoch][at]]
            length = min(len(x), self.seq_len)
            ids[j, :length], labels[j, :length] = x[:length], y[:length]
        return ids, labels


def causal_lm_windows(tokens: torch.Tensor, n: int, seq_len: int, seed: int) -> list[dict]:
    """n random windows of a token stream as causal-LM examples for Hugging Face loops (`input_ids` ==
    `labels`: the model shifts them), as the examples' Trainer and Accelerate loops take them."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - seq_len, (n,), generator=g)
    rows = [tokens[s:s + seq_len].long() for s in starts.tolist()]
    return [{"input_ids": r, "labels": r} for r in rows]
