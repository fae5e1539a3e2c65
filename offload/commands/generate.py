"""`offload generate`: complete prompts with a model whose weights stay in their tier (RAM or NVMe), a user's
way to try a fine-tuned model that does not fit in memory: --model a Hugging Face directory (or smollm2, or a
preset with its seeded random weights), --adapter a LoRA adapter as `offload train --lora ... --save` (or peft)
writes it, the prompts greedy in one batch through the model's own generate() (its KV cache; offload.answers),
the completions printed, and the tokens per second.

Not yet (issue 51): decode traces of their own and the KV cache in the memory plan; each decode step fetches
the units from their tier as an evaluation's forward does.
"""

from __future__ import annotations

import json
import os
import sys
import time

import offload

DEFAULT_NEW_TOKENS = 64


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="complete prompts with a model whose weights stream from RAM or NVMe",
                              description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--model", required=True, metavar="HF_DIR|PACKAGED|PRESET",
                   help="a local Hugging Face directory, a packaged model (smollm2) or a preset")
    p.add_argument("--adapter", default=None, metavar="DIR",
                   help="a LoRA adapter directory (adapter_config.json + adapter_model.safetensors) on the model")
    asked = p.add_mutually_exclusive_group(required=True)
    asked.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeat for several)")
    asked.add_argument("--prompts", metavar="FILE", help="a UTF-8 .txt file, one prompt a line")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_NEW_TOKENS, metavar="N",
                   help=f"new tokens at most per prompt (default {DEFAULT_NEW_TOKENS})")
    p.add_argument("--raw", action="store_true",
                   help="send the prompts as plain text (default: through the tokenizer's chat template, if it has one)")
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    offload.add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from offload.answers import Answers, read_prompts

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens}: must be >= 1")
    prompts = args.prompt if args.prompt else read_prompts(args.prompts, flag="--prompts")
    model, weights, tokenizer, source = _build(args.model, args.adapter)
    shape = "messages" if tokenizer is not None and getattr(tokenizer, "chat_template", None) and not args.raw \
        else "text"
    answers = Answers(prompts, shape, tokenizer, args.max_new_tokens)
    _check_positions(model, answers, args.max_new_tokens)
    cfg = offload.config_from_args(args)
    print(f"offload generate: {len(prompts)} prompt(s), at most {args.max_new_tokens} new tokens each, {source}; "
          f"weights in {cfg.offload_param.device}", file=sys.stderr, flush=True)
    with offload.initialize(model, cfg, weights=weights) as engine:
        t0 = time.perf_counter()
        out = answers.answer(engine, step=0, streamer=_Progress(args.max_new_tokens))
        seconds = time.perf_counter() - t0
    new = sum(len(answers.encoder.encode(a["answer"])) for a in out)
    for a in out:
        print(f"> {a['prompt']}\n{a['answer']}\n")
    summary = {"prompts": len(prompts), "new_tokens": new, "seconds": round(seconds, 3),
               "tokens_per_s": round(new / seconds, 2) if seconds else None, "offload_param": cfg.offload_param.device,
               "answers": [{"prompt": a["prompt"], "answer": a["answer"]} for a in out]}
    print(f"generated {new} tokens in {seconds:.1f} s: {summary['tokens_per_s']} tokens/s (weights in "
          f"{cfg.offload_param.device}; the prompts in one batch)")
    if args.json:
        print(json.dumps(summary))
    return 0


class _Progress:
    """The progress line: generate() hands a streamer the prompts, then each decode step's new tokens."""

    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, -1, time.perf_counter()

    def put(self, value) -> None:
        self.done += 1  # the first call is the prompts
        if self.done:
            rate = self.done / (time.perf_counter() - self.t0)
            print(f"\r  token {self.done}/{self.total} ({rate:.2f} decode steps/s)", end="", file=sys.stderr, flush=True)
        else:
            self.t0 = time.perf_counter()

    def end(self) -> None:
        print(file=sys.stderr, flush=True)


def _build(name: str, adapter: str | None):
    """(model on the meta device, its weights source or None, tokenizer or None, a line on what it is), every
    parameter frozen: nothing is trained."""
    from offload.models import PRESETS, build_model
    from offload.pretrained import resolve_model
    from offload.recipe import _hf_tokenizer

    path = resolve_model(name)
    if os.path.isdir(path):
        from offload.integrations.hf_io import SafetensorsWeights

        model = build_model(path, device="meta")
        weights, tokenizer, source = SafetensorsWeights(path, model=model), _hf_tokenizer(path), path
    elif path in PRESETS:
        model, weights, tokenizer = build_model(path, device="meta"), None, None
        source = f"the {path} preset (its seeded random weights)"
    else:
        raise ValueError(f"--model={name}: neither a preset ({', '.join(PRESETS)}), a packaged model nor a "
                         "directory; pass a local Hugging Face directory")
    if adapter is not None:
        if weights is None:
            raise ValueError(f"--adapter={adapter}: needs --model a Hugging Face directory (a preset's adapter is "
                             "saved with its merged weights: --save-merged)")
        from offload.lora import AdapterWeights

        model, weights = AdapterWeights.wrap(model, weights, adapter)
        source += f" with the adapter {adapter}"
    model.requires_grad_(False)
    return model, weights, tokenizer, source


def _check_positions(model, answers, max_new_tokens: int) -> None:
    """A prompt with its new tokens longer than the model's positions is refused, naming the longest."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None) or \
        getattr(getattr(model, "config", None), "max_seq_len", None)
    longest = max(len(ids) for ids in answers.ids)
    if limit is not None and longest + max_new_tokens > limit:
        raise ValueError(f"a prompt of {longest} tokens and --max-new-tokens {max_new_tokens} exceed the model's "
                         f"{limit} positions; shorten the prompt or pass --max-new-tokens {max(1, limit - longest)}")
