"""Evaluate, train, evaluate again through the engine against the plain model, by placement (issue 49): a tiny
Llama with LoRA on q and v, its base dense (fp32), 4-bit nf4 (double quantization) or int8 by bitsandbytes.
Each row: the largest |logit| difference of the eval-mode forwards under no_grad before and after 3 training
steps (the plain model's taken on a copy, so its own repack never reaches its training), the largest relative
difference of the 3 training losses (train mode), and of the logits of the model handed back by
close(keep_weights=True). `--repack` makes every Linear4bit repack for the AVX512-BF16 inference kernel as it
would on such a CPU (the repack is plain PyTorch; on a CPU without it the kernel is bitsandbytes' reference one).

    python bench/eval_parity.py [--repack] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import offload  # noqa: E402

VOCAB, SEQ = 300, 16
PLACES = {"hbm": "none", "dram": "cpu", "nvme": "nvme"}
QUANT = {"dense": None, "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
         "int8": dict(load_in_8bit=True)}


def model(base_dir: str, quant: str, repack: bool):
    import peft
    import transformers

    q = transformers.BitsAndBytesConfig(**QUANT[quant]) if QUANT[quant] else None
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=q, dtype=torch.float32)
    torch.manual_seed(1)
    m = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                  lora_dropout=0.0)).train()
    if repack:
        import bitsandbytes as bnb

        for layer in m.modules():
            if isinstance(layer, bnb.nn.Linear4bit):
                layer.support_avx512bf16_for_cpu = True
    return m


def evaluate(m, run, ids) -> torch.Tensor:
    """`run`'s eval-mode logits (m: the model `run` runs: the engine's, or `run` itself)."""
    m.eval()
    with torch.no_grad():
        out = run(input_ids=ids).logits
    m.train()
    return out


def plain_eval(plain, ids) -> torch.Tensor:
    """The plain model's eval-mode logits, on a copy (a repack stays there, out of the plain model's training)."""
    twin = copy.deepcopy(plain)
    return evaluate(twin, twin, ids)


def row(base_dir: str, quant: str, place: str, repack: bool, swap: str) -> dict:
    plain, ours = model(base_dir, quant, repack), model(base_dir, quant, repack)
    g = torch.Generator().manual_seed(2)
    data, ids = [torch.randint(0, VOCAB, (2, SEQ), generator=g)] * 3, torch.randint(0, VOCAB, (2, SEQ), generator=g)
    opt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0, foreach=False)
    cfg = {"precision": "fp32", "offload_param": {"device": PLACES[place]}, "offload_optimizer": {"device": "cpu"},
           "nvme_path": swap, "units": {"classes": ["LlamaDecoderLayer"]},
           "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.0}}
    engine = offload.initialize(ours, cfg)
    try:
        eval_before = (evaluate(ours, engine, ids) - plain_eval(plain, ids)).abs().max().item()
        losses = []
        for batch in data:
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
            ref = plain(input_ids=batch, labels=batch).loss
            ref.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(abs(loss.item() - ref.item()) / abs(ref.item()))
        eval_after = (evaluate(ours, engine, ids) - plain_eval(plain, ids)).abs().max().item()
        with torch.no_grad():
            last = engine(input_ids=ids).logits
        engine.close(keep_weights=True)
        with torch.no_grad():
            kept = (ours(input_ids=ids).logits - last).abs().max().item()
    finally:
        engine.close()
    return {"base": quant, "place": place, "eval_before": eval_before, "train_rel": max(losses),
            "eval_after": eval_after, "kept": kept}


def main() -> None:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repack", action="store_true", help="4-bit layers repack as on an AVX512-BF16 CPU")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import bitsandbytes as bnb

    with tempfile.TemporaryDirectory() as tmp:
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(cfg).save_pretrained(os.path.join(tmp, "base"))
        rows = [row(os.path.join(tmp, "base"), q, p, args.repack, os.path.join(tmp, f"swap-{q}-{p}"))
                for q in QUANT for p in PLACES]
    host = {"avx512_bf16": bool(bnb.functional.has_avx512bf16()), "repack_forced": args.repack,
            "bitsandbytes": bnb.__version__, "torch": torch.__version__}
    print(f"host: {host}")
    print(f"{'base':6} {'place':6} {'eval before':>12} {'train (rel)':>12} {'eval after':>12} {'kept':>10}")
    for r in rows:
        print(f"{r['base']:6} {r['place']:6} {r['eval_before']:12.2e} {r['train_rel']:12.2e} {r['eval_after']:12.2e} "
              f"{r['kept']:10.2e}")
    if args.json:
        print(json.dumps({"host": host, "rows": rows}))


if __name__ == "__main__":
    main()
