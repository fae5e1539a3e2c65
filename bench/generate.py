"""Generation from offloaded weights (issue 51): tokens per second side by side in one run, greedy, the same
random prompts (--prompt-tokens each) and exactly --new-tokens new tokens each, per batch size: transformers'
generate() with the model in memory (the floor on a CPU), ours with the weights in dram and on nvme (the model
wrapped by the engine, its own generate()), and accelerate's disk offload (from_pretrained with a device_map
whose CPU budget sends the layers to --dir's offload folder). DeepSpeed ZeRO-Inference: not run here (null).
link_bound_tok_s: batch x the swap's read bandwidth (measured in the run, `offload bench nvme`) over the weights'
bytes, the rate if every decode step read every weight once at that bandwidth. same_tokens: each mode's tokens
equal the in-memory ones.

    python bench/generate.py [--model bench-200m|1b|smollm2|DIR] [--batch 1 8 32] [--prompt-tokens 32]
                             [--new-tokens 64] [--dir DIR] [--io-size 1G] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import iobound  # noqa: E402  (bench/iobound.py)

MODES = ("in_memory", "dram", "nvme", "accelerate")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench-200m", help="a preset, 1b (TinyLlama-1.1B's shape), smollm2 or a HF dir")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dir", default=None, help="swap, offload folder and the model go under it (default: temporary)")
    ap.add_argument("--io-size", default="1G", help="bytes of the swap read measurement")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="generate-bench-", dir=args.dir)
    try:
        rows, info = run(args, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"{args.model} ({info['params'] / 1e6:.0f}M parameters, {info['weight_bytes'] / 1e9:.2f} GB of weights), "
          f"{args.prompt_tokens} prompt + {args.new_tokens} new tokens, greedy, tokens/s (x in-memory):")
    print(f"  {'batch':>5s} " + " ".join(f"{m:>18s}" for m in MODES) + f" {'link bound':>11s}  same tokens")
    for r in rows:
        cells = [f"{r[m + '_tok_s']:8.1f} ({r[m + '_tok_s'] / r['in_memory_tok_s']:5.2f}x)" for m in MODES]
        print(f"  {r['batch']:5d} " + " ".join(f"{c:>18s}" for c in cells) + f" {r['link_bound_tok_s']:11.1f}  "
              + ", ".join(m for m in MODES[1:] if r["same_tokens"][m]))
    if args.json:
        print(json.dumps({**rows[-1], "model": args.model, **info, "rows": rows}))  # API.md's keys: the last batch's


def run(args, base: str) -> tuple[list[dict], dict]:
    import torch

    from offload.swap.measure import parse_size

    directory = model_dir(args.model, base)
    os.makedirs(os.path.join(base, "io"))
    bw = iobound.measure_swap(os.path.join(base, "io"), parse_size(args.io_size), {})
    with open(os.path.join(directory, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rows = []
    for batch in args.batch:
        prompts = torch.randint(1, min(vocab, 1000), (batch, args.prompt_tokens),
                                generator=torch.Generator().manual_seed(batch))
        row, tokens = {"batch": batch, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens}, {}
        for mode in MODES:
            tokens[mode], seconds = generate(mode, directory, prompts, args.new_tokens, base)
            row[f"{mode}_tok_s"] = batch * args.new_tokens / seconds
        row["deepspeed_tok_s"] = None
        row["same_tokens"] = {m: bool(torch.equal(tokens[m], tokens["in_memory"])) for m in MODES[1:]}
        rows.append(row)
    weight_bytes = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)
                       if f.endswith(".safetensors"))
    for row in rows:
        row["link_bound_tok_s"] = row["batch"] * bw["swap_read_gbps"] * 1e9 / weight_bytes
    params = sum(p.numel() for p in load(directory).parameters())
    return rows, {"params": params, "weight_bytes": weight_bytes, **bw}


def model_dir(name: str, base: str) -> str:
    """A HF directory of the model: a packaged model's or a given one as it is, a preset (or 1b) saved from its
    seeded build as transformers' Llama in fp32."""
    import torch
    import transformers

    from offload.models import PRESETS, ModelConfig, hf_llama_config
    from offload.pretrained import resolve_model

    path = resolve_model(name)
    if os.path.isdir(path):
        return path
    shape = ModelConfig(vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, d_ff=5632,
                        max_seq_len=2048, tie_embeddings=False) if name == "1b" else PRESETS[name]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_llama_config(shape)))
    out = os.path.join(base, "model")
    model.save_pretrained(out)
    return out


def load(directory: str, **kw):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32, **kw).eval()


def generate(mode: str, directory: str, prompts, new_tokens: int, base: str):
    """(the new tokens, seconds) of one greedy generate() of `prompts` in `mode`."""
    import torch

    kw = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False, "num_beams": 1,
          "pad_token_id": 0}
    mask = torch.ones_like(prompts)
    if mode in ("in_memory", "accelerate"):
        model = load(directory) if mode == "in_memory" else load(
            directory, device_map="auto", max_memory={"cpu": "64MB"}, offload_folder=os.path.join(base, "offload"))
        return timed(model, prompts, mask, kw)
    import offload
    from offload.integrations.hf_io import SafetensorsWeights
    from offload.models import build_model

    model = build_model(directory, device="meta")
    model.requires_grad_(False)
    cfg = {"precision": "fp32", "offload_param": {"device": "cpu" if mode == "dram" else "nvme"},
           "offload_optimizer": {"device": "cpu"}, "nvme_path": os.path.join(base, "swap")}
    with offload.initialize(model, cfg, weights=SafetensorsWeights(directory, model=model)) as engine:
        engine.eval()
        return timed(engine.module, prompts, mask, kw)


def timed(model, prompts, mask, kw: dict):
    """(new tokens, seconds) of generate(), after an untimed one of 2 new tokens (first-call costs, and the
    engine's trace of a forward)."""
    import torch

    with torch.no_grad():
        model.generate(input_ids=prompts, attention_mask=mask, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
        t = time.perf_counter()
        out = model.generate(input_ids=prompts, attention_mask=mask, **kw)
        seconds = time.perf_counter() - t
    return out[:, prompts.shape[1]:], seconds


if __name__ == "__main__":
    main()
