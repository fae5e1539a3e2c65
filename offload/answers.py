"""`offload train --sample-prompts FILE`: prompts the model answers before the first step and after the last,
greedily, through the engine (weights stay in their tiers), so a run shows in words what training changed.

A prompt is put to the model as --data's records put theirs, up to where the trained part starts: a user turn
of a chat through the tokenizer's chat template with its generation prompt (else the plain chat template
offload.data uses), the prompt of prompt/completion records as it is, an Alpaca instruction in the Alpaca
prompt, the start of a text for text data. A Hugging Face model answers with its own generate() (KV cache,
the prompts in one left-padded batch), its forwards under no_grad fetching each unit from its tier as an
evaluation's do; a preset, which has no generate(), runs the whole sequence through the engine for each token.
"""

from __future__ import annotations

import os

import torch

from offload.data import ByteTokenizer, Encoder, render, tokenize

DEFAULT_SAMPLE_TOKENS = 48


def read_prompts(path: str, flag: str = "--sample-prompts") -> list[str]:
    """The prompts of a .txt file, one a line (blank lines skipped); errors name `flag`."""
    if not path.endswith(".txt"):
        raise ValueError(f"{flag}={path}: not a .txt file; give a UTF-8 text file of prompts, one a line")
    if not os.path.isfile(path):
        raise FileNotFoundError(2, f"prompts file not found; pass {flag} with a local .txt file, one "
                                   "prompt a line", path)
    try:
        with open(path, encoding="utf-8") as f:
            prompts = [line.strip() for line in f if line.strip()]
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag}={path}: not UTF-8 ({e.reason}); convert the file") from e
    if not prompts:
        raise ValueError(f"{flag}={path}: no prompts in it; write one prompt a line")
    return prompts


# A record of each instruction shape that asks `prompt` and holds an empty answer: its pieces up to the first trained
# one are what the model sees before it answers.
_ASKING = {"messages": lambda p: {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": ""}]},
           "prompt_completion": lambda p: {"prompt": p, "completion": ""},
           "alpaca": lambda p: {"instruction": p, "output": ""}}


def prompt_ids(prompt: str, shape: str, encoder: Encoder) -> list[int]:
    """The token ids that put `prompt` to the model as --data's records of `shape` put theirs: offload.data's
    rendering of a record that asks it, up to the first trained token; for text data, the prompt's own tokens."""
    if shape not in _ASKING:
        return encoder.encode(prompt)
    pieces = render(shape, _ASKING[shape](prompt), encoder)
    first = next(i for i, (_, trained) in enumerate(pieces) if trained)
    return tokenize(pieces[:first], encoder)[0]


class Answers:
    """The answers to --sample-prompts at a step: greedy, at most `max_new_tokens` each, ending at EOS."""

    def __init__(self, prompts: list[str], shape: str, tokenizer, max_new_tokens: int):
        self.prompts, self.shape, self.max_new_tokens = prompts, shape, max_new_tokens
        self.encoder = Encoder(tokenizer)
        self.ids = [prompt_ids(p, shape, self.encoder) for p in prompts]

    @classmethod
    def from_run(cls, run: dict, tokenizer, shape: str) -> "Answers | None":
        settings = run.get("prompts")
        if settings is None:
            return None
        return cls(read_prompts(settings["path"]), shape, tokenizer, settings["max_new_tokens"])

    def decode(self, ids: list[int]) -> str:
        if self.encoder.hf is None:
            return ByteTokenizer().decode(ids)
        return self.encoder.hf.decode(ids, skip_special_tokens=True)

    @torch.no_grad()
    def answer(self, engine, step: int, streamer=None) -> list[dict]:
        """[{"step", "prompt", "answer"}] for each prompt, the model in eval mode (train mode again after).
        streamer: a transformers streamer generate() gives each new batch of tokens (a Hugging Face model)."""
        engine.flush()  # a delayed update still pending would leave the weights a step behind
        model = engine.module
        base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model  # peft's
        engine.eval()
        try:
            if callable(getattr(base, "can_generate", None)):  # a transformers model: its generate()
                new = self._generate(engine, base, streamer)
            else:  # a preset
                new = [self._greedy(engine, ids, base.config.max_seq_len) for ids in self.ids]
        finally:
            engine.train()
        return [{"step": step, "prompt": p, "answer": self.decode(ids)} for p, ids in zip(self.prompts, new)]

    def _ends(self, model) -> set[int]:
        """The ids that end an answer: the tokenizer's EOS and the model's generation config's."""
        ends = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        ends = [] if ends is None else list(ends) if isinstance(ends, (list, tuple)) else [ends]
        return {self.encoder.eos_id, *ends} - {None}

    def _generate(self, engine, model, streamer=None) -> list[list[int]]:
        """The new ids of each prompt (to its first end of sequence, left out): the prompts in one batch, left-padded,
        through the engine's generate() ([Note: generation] in offload.step.generation)."""
        width = max(len(ids) for ids in self.ids)
        x = torch.tensor([[self.encoder.pad_id] * (width - len(ids)) + ids for ids in self.ids], device=engine.device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in self.ids], device=engine.device)
        ends = self._ends(model)
        out = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=self.max_new_tokens, do_sample=False,
                             num_beams=1, use_cache=True, pad_token_id=self.encoder.pad_id,
                             eos_token_id=sorted(ends), streamer=streamer)
        return [_until(row[width:].tolist(), ends) for row in out]

    def _greedy(self, engine, ids: list[int], max_seq_len: int) -> list[int]:
        """A preset's new ids after `ids` (to an end of sequence, left out): it has no KV cache, so the whole
        sequence runs through the engine again for each token, within max_seq_len."""
        x = torch.tensor([ids], dtype=torch.long, device=engine.device)
        new, ends = [], self._ends(None)
        for _ in range(min(self.max_new_tokens, max_seq_len - len(ids))):
            new.append(int(engine(x)[0, -1].argmax()))
            if new[-1] in ends:
                break
            x = torch.cat([x, x.new_tensor([new[-1:]])], dim=1)
        return _until(new, ends)


def _until(ids: list[int], ends: set[int]) -> list[int]:
    """`ids` up to the first of `ends` (left out)."""
    cut = next((i for i, t in enumerate(ids) if t in ends), len(ids))
    return ids[:cut]
