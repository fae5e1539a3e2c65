"""One script for a lent GPU: the tests marked `gpu`, then short trainings of one model in the engine's
modes beside a plain in-memory torch loop, and a table: step time against the in-memory step, stall
share, the H2D / D2H rates the engine achieved against a plain pinned copy measured in the same run, and
the hbm peak. Modes: bf16 with weights in hbm / dram / nvme, without overlap_step, with delayed_update
and clipping, with activation checkpointing, fp16 with loss scaling, int8 optimizer states on nvme, and with a
split master (neither yet run on a GPU); the presets tie their embedding. Decode (bench/generate.py's device_decode, not yet run on a GPU):
generate() at batch 32 with the weights in pinned dram against the pinned H2D bound.

    python bench/gpu_check.py [--device cuda:0] [--preset bench-200m] [--batch 4] [--seq 512] [--steps 3]
                              [--dir DIR] [--ranks-steps 4] [--no-ranks] [--json]
    python bench/gpu_check.py --device cpu --preset tiny --steps 1 --no-tests   # smoke run of this script

Parity: each placement (PARITY) trains --parity-steps steps of --parity-preset in fp32 on the device and
on the CPU (a subprocess without CUDA) from the same seed and batches; the largest relative loss difference is recorded per placement
and the run fails where it exceeds PARITY_RTOL (the CUDA path must train to the CPU build's numbers).

Ranks (skip with --no-ranks): ZeRO stages 1, 2 and 3 with offload nvme/nvme, and stage 3 with offload_param
none, each as 2 processes on the SAME device (gloo, over CUDA tensors on a GPU) training tests.engine_util.MLP
in fp32 for --ranks-steps steps on their slices of each global batch, against one process on that device
trained on the same slices in rank order (bench/zero_ranks_check.py). Recorded per case under "ranks": the
largest relative loss difference and weight difference, each rank's step seconds, the collectives' bytes
and all_gather's exposed_s; the run fails where a case exceeds its tolerance (losses rel 1e-5, weights
rtol/atol 1e-5: tests/ranks_util.py's fp32 bound) or could not run (an engine that refuses stages 1-3 on
CUDA: the refusal is that case's error). Ran on one H200 (bench/RESULTS.md).

QLoRA: a tiny Llama quantized by bitsandbytes (nf4, double quantization) with LoRA adapters, the engine with
the base in hbm, dram and nvme against the plain loop on the device (fp32 losses, rtol PARITY_RTOL).

Long sequence (skip with --no-long): a 1B-class Llama (TinyLlama-1.1B's shape, or --long-preset) at --long-seq
tokens, batch 1, bf16, weights and states in dram, trained --long-steps steps after one warm-up in four ways:
no checkpointing, the engine's activation checkpointing with the kept inputs in hbm, dram and nvme
(offload_activations). Per way: the median step, its ratio to the hbm way's, the device's allocated peak
(torch.cuda.max_memory_allocated) and the hbm tier's accounted peak, the kept inputs' hbm peak; parity: each
way's losses against no checkpointing's (rtol LONG_RTOL).

Also records the precision "auto" picks on the device and its matmul GFLOP/s per dtype (offload.doctor).
Writes the result to --out (default gpu-check.json) and prints one JSON line last with --json. Without a
visible GPU and without --device cpu it refuses in one line (exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # this checkout's offload, wherever the script is run from
    sys.path.insert(0, REPO)

MODES = {  # name -> (offload_param, offload_optimizer, extra config, checkpoint_activations)
    "bf16 hbm/cpu": ("none", "cpu", {}, False),
    "bf16 cpu/cpu": ("cpu", "cpu", {}, False),
    "bf16 nvme/nvme": ("nvme", "nvme", {}, False),
    "bf16 nvme/nvme no overlap": ("nvme", "nvme", {"overlap_step": False}, False),
    "bf16 nvme/nvme delayed+clip": ("nvme", "nvme", {"delayed_update": True, "gradient_clipping": 1.0}, False),
    "bf16 cpu/cpu ckpt": ("cpu", "cpu", {}, True),
    "fp16 cpu/cpu": ("cpu", "cpu", {"precision": "fp16"}, False),
    "bf16 nvme/nvme int8 states": ("nvme", "nvme", {"optimizer": {"lr": 1e-4, "states": "int8"}}, False),
    "bf16 cpu/nvme int8 split master": ("cpu", "nvme", {"optimizer": {"lr": 1e-4, "states": "int8", "master": "split"}},
                                        False),
}


PARITY = {"hbm/hbm": ("none", "none"), "hbm/cpu": ("none", "cpu"), "cpu/cpu": ("cpu", "cpu"),
          "nvme/nvme": ("nvme", "nvme")}
PARITY_RTOL = 1e-4  # fp32 losses, device against CPU: matmul kernels differ in summation order only


LONG_MODES = {"no ckpt": {}, "ckpt, inputs hbm": {"activation_checkpointing": True},
              "ckpt, inputs dram": {"activation_checkpointing": True, "offload_activations": {"device": "cpu"}},
              "ckpt, inputs nvme": {"activation_checkpointing": True, "offload_activations": {"device": "nvme"}}}
LONG_RTOL = 1e-3  # bf16 losses; the attention backward's kernels on CUDA accumulate in no fixed order


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> dict:
    """A plain pinned copy each way: what the engine's links are compared with."""
    if device.type != "cuda":
        return {"h2d_gbps": None, "d2h_gbps": None}
    from offload.swap import aligned_empty

    host = aligned_empty(nbytes, torch.uint8, pin=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, (dst, src) in {"h2d_gbps": (dev, host), "d2h_gbps": (host, dev)}.items():
        dst.copy_(src, non_blocking=True)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        _sync(device)
        out[name] = 5 * nbytes / (time.perf_counter() - t0) / 1e9
    return out


def device_limits(device: torch.device) -> dict:
    """What the device runs fast: the precision "auto" picks there, and matmul GFLOP/s per dtype."""
    from offload.doctor import matmul_gflops
    from offload.plan.precision import DTYPES, resolve_precision

    choice = resolve_precision("auto", device)
    return {"precision_auto": choice.name, "precision_line": choice.line(),
            "matmul_gflops": {name: matmul_gflops(dtype, device, min_s=0.1) for name, dtype in DTYPES.items()}}


def _batches(args):
    from offload.data import BatchSampler, load_tokens

    sampler = BatchSampler(load_tokens(), args.batch, args.seq, seed=0)
    return [sampler.batch(i) for i in range(args.steps + 1)]


def in_memory(args, device: torch.device) -> dict:
    """Plain torch: bf16 weights on the device, torch's AdamW (fused on CUDA); the first step is warm-up."""
    from offload.models import build_model, loss_of

    model = build_model(args.preset, seed=0).to(device=device, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if device.type == "cuda" else {}))
    times, losses = [], []
    for i, (ids, labels) in enumerate(_batches(args)):
        _sync(device)
        t0 = time.perf_counter()
        loss = loss_of(model(ids.to(device), labels.to(device)))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        losses.append(loss.item())
        if i:
            times.append(time.perf_counter() - t0)
    del model, opt
    return {"step_s": sorted(times)[len(times) // 2], "losses": losses}


def train(args, device: torch.device, mode: str) -> dict:
    import offload
    from offload.models import PRESETS, build_model, loss_of

    param, optim, extra, ckpt = MODES[mode]
    mc = dataclasses.replace(PRESETS[args.preset], checkpoint_activations=ckpt)
    cfg = {"precision": "bf16", "offload_param": {"device": param}, "offload_optimizer": {"device": optim},
           "nvme_path": args.dir, "optimizer": {"lr": 1e-4}, **extra}
    times, losses = [], []
    with offload.initialize(build_model(mc, seed=0), cfg) as eng:
        for i, (ids, labels) in enumerate(_batches(args)):
            _sync(device)
            t0 = time.perf_counter()
            loss = loss_of(eng(ids.to(device), labels.to(device)))
            eng.backward(loss)
            eng.step()
            _sync(device)
            losses.append(loss.item())
            if i:
                times.append(time.perf_counter() - t0)
        st = eng.stats()
    rate = {k: v["bytes"] / v["seconds"] / 1e9 if v["seconds"] else None for k, v in st["links"].items()}
    return {"step_s": sorted(times)[len(times) // 2], "stall_share": st["stall_seconds"] / sum(times),
            "h2d_gbps": rate["dram_to_hbm"], "d2h_gbps": rate["hbm_to_dram"],
            "hbm_peak_gb": st["tiers"]["hbm"]["peak_bytes"] / 1e9, "losses": losses}


def fp32_losses(args, device: torch.device, place: tuple[str, str]) -> list[float]:
    """--parity-steps steps of --parity-preset in fp32 through the engine on `device` (placement `place`)."""
    import offload
    from offload.models import build_model, loss_of

    param, optim = place
    cfg = {"precision": "fp32", "offload_param": {"device": param}, "offload_optimizer": {"device": optim},
           "nvme_path": os.path.join(args.dir, f"parity-{device.type}"), "optimizer": {"lr": 1e-3}}
    batches = _batches(argparse.Namespace(batch=2, seq=64, steps=args.parity_steps - 1))
    with offload.initialize(build_model(args.parity_preset, seed=0), cfg) as eng:
        if eng.device.type != device.type:
            raise RuntimeError(f"parity: the engine runs on {eng.device}, not {device}")
        out = []
        for ids, labels in batches:
            loss = loss_of(eng(ids.to(eng.device), labels.to(eng.device)))
            eng.backward(loss)
            eng.step()
            out.append(loss.item())
    return out


def cpu_losses(args) -> dict:
    """fp32_losses of every PARITY placement on the CPU build, in one subprocess that sees no GPU (the engine
    runs on CUDA wherever CUDA is available: only a process without it gives the CPU build a user runs)."""
    code = ("import argparse, json, sys, torch; sys.path.insert(0, sys.argv[1]); import gpu_check as g; "
            "a = argparse.Namespace(**json.loads(sys.argv[2])); "
            "out = {k: g.fp32_losses(a, torch.device('cpu'), p) for k, p in g.PARITY.items()}; "
            "print('CPU_LOSSES ' + json.dumps(out))")
    given = json.dumps({"dir": args.dir, "parity_preset": args.parity_preset, "parity_steps": args.parity_steps})
    run = subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__)), given],
                         capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("CPU_LOSSES ")]
    if run.returncode or not lines:
        raise RuntimeError(f"parity: the CPU runs failed (exit {run.returncode}): {run.stderr[-2000:]}")
    return json.loads(lines[-1][len("CPU_LOSSES "):])


def parity(args, device: torch.device) -> dict:
    """Per placement: the device's fp32 losses against the CPU build's, the largest relative difference."""
    result, cpu_runs = {}, cpu_losses(args)
    for name, place in PARITY.items():
        ours, cpu = fp32_losses(args, device, place), cpu_runs[name]
        diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, cpu))
        result[name] = {"losses": ours, "cpu_losses": cpu, "max_rel_diff": diff, "ok": diff <= PARITY_RTOL}
    return result


QLORA_PLACES = ("none", "cpu", "nvme")  # offload_param of the 4-bit base; the adapters' states on the CPU


def qlora_parity(args, device: torch.device) -> dict:
    """A tiny Llama with its linears quantized by bitsandbytes (nf4, double quantization) and peft LoRA on
    q_proj,v_proj, trained in fp32 on the device: the plain loop (torch AdamW on the adapters) against the
    engine with the base in hbm, dram and nvme, the largest relative loss difference per placement (rtol
    PARITY_RTOL: bitsandbytes' kernels dequantize on the device in both). Skipped without bitsandbytes."""
    try:
        import bitsandbytes  # noqa: F401
        import peft
        import transformers
    except ImportError as e:
        return {"skipped": f"needs bitsandbytes, peft and transformers ({e}): pip install -e '.[qlora]'"}
    import copy

    import offload
    from offload.plan.quantized import quantize_linears

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg)
    quantize_linears(base, "nf4", torch.float32)
    torch.manual_seed(1)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    g = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 256, (2, 32), generator=g) for _ in range(args.parity_steps)]

    def plain():
        m = copy.deepcopy(model).to(device)
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
        out = []
        for ids in batches:
            loss = m(input_ids=ids.to(device), labels=ids.to(device)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    def ours(param: str):
        c = {"precision": "fp32", "offload_param": {"device": param}, "offload_optimizer": {"device": "cpu"},
             "nvme_path": os.path.join(args.dir, "qlora"), "units": {"classes": ["LlamaDecoderLayer"]},
             "optimizer": {"lr": 1e-2, "weight_decay": 0.0}}
        out = []
        with offload.initialize(copy.deepcopy(model).to(device), c) as eng:
            for ids in batches:
                loss = eng(input_ids=ids.to(eng.device), labels=ids.to(eng.device)).loss
                eng.backward(loss)
                eng.step()
                out.append(loss.item())
        return out

    reference, result = plain(), {}
    for param in QLORA_PLACES:
        try:
            got = ours(param)
            diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, reference))
            result[param] = {"losses": got, "plain_losses": reference, "max_rel_diff": diff, "ok": diff <= PARITY_RTOL}
        except Exception as e:  # recorded: a failure on the device is this case's result
            result[param] = {"error": f"{type(e).__name__}: {e}", "ok": False}
    return result


def long_model(name: str):
    """`1b`: TinyLlama-1.1B's shape (1.10B parameters, untied 32000-row embedding and head); else a preset."""
    from offload.models import PRESETS, ModelConfig

    if name == "1b":
        return ModelConfig(vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, d_ff=5632,
                           max_seq_len=2048, tie_embeddings=False)
    return PRESETS[name]


def long_sequence(args, device: torch.device) -> dict:
    """Each LONG_MODES way at --long-seq: step, peaks and losses; parity against no checkpointing's losses."""
    import offload
    from offload.models import build_model, loss_of

    mc = dataclasses.replace(long_model(args.long_preset), max_seq_len=args.long_seq)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, mc.vocab_size, (1, args.long_seq + 1), generator=g) for _ in range(args.long_steps + 1)]
    result = {}
    for way, extra in LONG_MODES.items():
        cfg = {"precision": "bf16", "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"},
               "nvme_path": os.path.join(args.dir, "long"), "optimizer": {"lr": 1e-4},
               "activations": {"batch": 1, "seq": args.long_seq}, **extra}
        try:
            times, losses = [], []
            with offload.initialize(build_model(mc, seed=0), cfg) as eng:
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                for i, tokens in enumerate(batches):
                    ids, labels = tokens[:, :-1].to(eng.device), tokens[:, 1:].to(eng.device)
                    _sync(device)
                    t0 = time.perf_counter()
                    loss = loss_of(eng(ids, labels))
                    eng.backward(loss)
                    eng.step()
                    _sync(device)
                    losses.append(loss.item())
                    del loss
                    if i:
                        times.append(time.perf_counter() - t0)
                st = eng.stats()
            result[way] = {"step_s": sorted(times)[len(times) // 2], "losses": losses,
                           "allocated_peak_gb": torch.cuda.max_memory_allocated(device) / 1e9
                           if device.type == "cuda" else None,
                           "hbm_tier_peak_gb": st["tiers"]["hbm"]["peak_bytes"] / 1e9,
                           "inputs_hbm_peak_gb": st["activations"].get("inputs_peak_bytes", 0) / 1e9}
        except Exception as e:  # recorded: a failure on the device (out of memory included) is this way's result
            result[way] = {"error": f"{type(e).__name__}: {str(e)[:300]}", "ok": False}
    ref, hbm = result["no ckpt"], result["ckpt, inputs hbm"]
    for way, r in result.items():
        if "error" in r:
            continue
        if "error" in ref:
            r.update(max_rel_diff=None, ok=way != "no ckpt")
        else:
            r["max_rel_diff"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], ref["losses"]))
            r["ok"] = r["max_rel_diff"] <= LONG_RTOL
        r["vs_ckpt_hbm"] = r["step_s"] / hbm["step_s"] if "step_s" in hbm else None
    return result


def print_long(res: dict, args) -> None:
    print(f"long sequence: {args.long_preset} at {args.long_seq} tokens, batch 1, bf16, weights and states in dram "
          f"(losses against no ckpt, rtol {LONG_RTOL:g})")
    print(f"{'way':20s} {'step s':>8s} {'x ckpt hbm':>10s} {'alloc GB':>9s} {'hbm tier GB':>11s} {'inputs GB':>9s} "
          f"{'loss diff':>9s}")
    for way, r in res.items():
        if "error" in r:
            print(f"{way:20s} FAILED: {r['error']}")
            continue
        fmt = lambda v, w, p: f"{v:{w}.{p}f}" if v is not None else f"{'-':>{w}s}"  # noqa: E731
        diff = f"{r['max_rel_diff']:9.1e}" if r["max_rel_diff"] is not None else f"{'-':>9s}"
        print(f"{way:20s} {r['step_s']:8.3f} {fmt(r['vs_ckpt_hbm'], 10, 2)} {fmt(r['allocated_peak_gb'], 9, 2)} "
              f"{r['hbm_tier_peak_gb']:11.2f} {r['inputs_hbm_peak_gb']:9.3f} {diff}{'' if r['ok'] else '  FAILED'}")


def ranks(args, device: torch.device) -> dict:
    """bench/zero_ranks_check.py's cases on `device`: 2 gloo ranks against one process; a case that raises
    here is recorded as its error too."""
    import zero_ranks_check  # bench/, this script's directory, is first on sys.path

    dev = "cpu" if device.type == "cpu" else f"cuda:{device.index}"
    if device.type == "cuda":
        torch.cuda.empty_cache()  # this process's cached blocks: the ranks share the device
    result = {}
    for case in zero_ranks_check.CASES:
        root = os.path.join(args.dir, "ranks", case.replace(" ", "-").replace("/", "-"))
        try:
            result[case] = zero_ranks_check.run_case(case, dev, args.ranks_steps, root)
        except Exception as e:
            result[case] = {"error": f"{type(e).__name__}: {e}", "ok": False}
    return result


def print_ranks(res: dict, device: torch.device, steps: int) -> None:
    """One row per case: the differences, both ranks' step seconds, rank 0's bytes per collective (every rank
    moves the same), the larger exposed_s of all_gather."""
    from zero_ranks_check import GAS, LOSS_RTOL, WEIGHT_ATOL, WEIGHT_RTOL, WORLD

    print(f"{WORLD} gloo ranks on {device} against one process in rank order (MLP, fp32, {steps} steps "
          f"x {GAS} micro-steps; losses rel {LOSS_RTOL:g}, weights rtol {WEIGHT_RTOL:g} atol {WEIGHT_ATOL:g}):")
    print(f"{'case':18s} {'loss rel':>8s} {'weight |d|':>10s} {'step s r0/r1':>13s} {'grad B':>10s} "
          f"{'bcast B':>10s} {'gather B':>10s} {'exposed s':>9s}")
    for case, r in res.items():
        if "error" in r:
            print(f"{case:18s} ERROR {r['error'].splitlines()[0][:200]}")
            continue
        c = r["collectives"][0]
        nbytes = lambda *ks: sum(c.get(k, {}).get("bytes", 0) for k in ks)  # noqa: E731
        exposed = [x for x in r["all_gather_exposed_s"] if x is not None]  # stage 3 only
        exposed_s = f"{max(exposed):9.3f}" if exposed else f"{'-':>9s}"
        print(f"{case:18s} {r['max_rel_loss_diff']:8.1e} {r['max_weight_diff']:10.1e} "
              f"{r['step_s'][0]:6.3f}/{r['step_s'][1]:<6.3f} {nbytes('reduce', 'reduce_scatter'):10,d} "
              f"{nbytes('broadcast'):10,d} {nbytes('all_gather'):10,d} "
              f"{exposed_s}{'' if r['ok'] else '  FAILED'}")


def _device_arg(value: str) -> str:
    if value in ("cpu", "cuda") or re.fullmatch(r"cuda:\d+", value):
        return value
    raise argparse.ArgumentTypeError(f"--device={value}: not a device here; pass cuda, cuda:N or cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench-200m")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode, after one warm-up step")
    ap.add_argument("--dir", default=None, help="swap directory (default: a temporary one)")
    ap.add_argument("--device", default="cuda:0", type=_device_arg,
                    help="cuda, cuda:N, or cpu: a smoke run of this script on a machine without a GPU")
    ap.add_argument("--no-tests", action="store_true", help="skip the pytest run of the `gpu` tests")
    ap.add_argument("--parity-preset", default="tiny", help="the model of the fp32 parity runs (default %(default)s)")
    ap.add_argument("--parity-steps", type=int, default=3, help="steps of each parity run (default %(default)s)")
    ap.add_argument("--no-ranks", action="store_true", help="skip the 2-rank ZeRO stages 1-3 check")
    ap.add_argument("--ranks-steps", type=int, default=4,
                    help="optimizer steps of each ranks case (default %(default)s)")
    ap.add_argument("--no-long", action="store_true", help="skip the long-sequence activations case")
    ap.add_argument("--long-preset", default="1b", help="its model: 1b (TinyLlama-1.1B's shape) or a preset")
    ap.add_argument("--long-seq", type=int, default=16384, help="its sequence length (default %(default)s)")
    ap.add_argument("--long-steps", type=int, default=2, help="its timed steps, after one warm-up")
    ap.add_argument("--decode-batch", type=int, default=32, help="the decode case's batch (default %(default)s)")
    ap.add_argument("--decode-tokens", type=int, default=64, help="its new tokens (default %(default)s)")
    ap.add_argument("--out", default="gpu-check.json", help="the JSON result is written here (default %(default)s)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; run it on a machine with a GPU, or pass --device cpu for a "
              "smoke run of its CPU-side parts", file=sys.stderr)
        sys.exit(2)
    device = torch.device(args.device)
    if device.type == "cuda":  # the engine runs on the current device
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    args.dir = args.dir or tempfile.mkdtemp(prefix="gpu-check-")
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              **device_limits(device)}
    print(f"{result['device']}: {result['precision_line']}; matmul GFLOP/s "
          + ", ".join(f"{k} {v:,.1f}" for k, v in result["matmul_gflops"].items()), flush=True)
    if not args.no_tests:
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", os.path.join(REPO, "tests")],
                               capture_output=True, text=True, cwd=REPO)
        print(tests.stdout[-2000:])
        result["gpu_tests_rc"] = tests.returncode
    result["pinned_copy"] = copy_bandwidth(device)
    result["in_memory"] = ref = in_memory(args, device)
    result["modes"] = {m: train(args, device, m) for m in MODES}
    pin = result["pinned_copy"]
    print(f"{'mode':28s} {'step s':>8s} {'x in-mem':>8s} {'stall':>6s} {'h2d GB/s':>9s} {'d2h GB/s':>9s} {'hbm GB':>7s}")
    print(f"{'plain torch in memory':28s} {ref['step_s']:8.3f} {1:8.2f}")
    for m, r in result["modes"].items():
        fmt = lambda v: f"{v:9.1f}" if v else f"{'-':>9s}"  # noqa: E731
        print(f"{m:28s} {r['step_s']:8.3f} {r['step_s'] / ref['step_s']:8.2f} {r['stall_share']:6.1%} "
              f"{fmt(r['h2d_gbps'])} {fmt(r['d2h_gbps'])} {r['hbm_peak_gb']:7.2f}")
    if pin["h2d_gbps"]:
        print(f"plain pinned copies in the same run: h2d {pin['h2d_gbps']:.1f} GB/s, d2h {pin['d2h_gbps']:.1f} GB/s")
    import generate  # bench/generate.py, beside this script
    result["decode"] = generate.device_decode(device, pin["h2d_gbps"], args.dir, args.preset, args.decode_batch,
                                              new_tokens=args.decode_tokens)  # issue 51: goal 0.85 of the bound
    print(generate.decode_line(result["decode"]))
    result["parity"] = par = parity(args, device)
    print(f"fp32 parity against the CPU build ({args.parity_preset}, {args.parity_steps} steps, rtol {PARITY_RTOL:g}): "
          + ", ".join(f"{k} {v['max_rel_diff']:.1e}{'' if v['ok'] else ' FAILED'}" for k, v in par.items()))
    result["qlora"] = ql = qlora_parity(args, device)
    print("nf4 QLoRA, fp32, the engine against the plain loop on the device: " + (ql["skipped"] if "skipped" in ql else
          ", ".join(f"base {k} " + (f"{v['max_rel_diff']:.1e}" if "error" not in v else v["error"])
                    + ("" if v["ok"] else " FAILED") for k, v in ql.items())))
    if not args.no_long:
        result["long"] = long_sequence(args, device)
        print_long(result["long"], args)
    if not args.no_ranks:
        result["ranks"] = ranks(args, device)
        print_ranks(result["ranks"], device, args.ranks_steps)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"result written to {args.out}")
    if args.json:
        print(json.dumps(result))
    failures = []
    if result.get("gpu_tests_rc"):
        failures.append(f"the gpu tests failed (pytest exit {result['gpu_tests_rc']})")
    failed = [k for k, v in par.items() if not v["ok"]]
    if failed:
        failures.append(f"fp32 losses differ from the CPU build's beyond {PARITY_RTOL:g} in {', '.join(failed)}")
    failed = [k for k, v in ql.items() if k != "skipped" and not v["ok"]]
    if failed:
        failures.append(f"nf4 QLoRA differs from the plain loop beyond {PARITY_RTOL:g}, or failed, with the base in "
                        f"{', '.join(failed)}")
    failed = [k for k, v in result.get("long", {}).items() if not v["ok"]]
    if failed:
        failures.append(f"at a long sequence, {', '.join(failed)} failed or differs from no ckpt beyond {LONG_RTOL:g}")
    failed = [k for k, v in result.get("ranks", {}).items() if not v["ok"]]
    if failed:
        failures.append(f"2 ranks differ from one process beyond the tolerance, or failed, in {', '.join(failed)}")
    if failures:
        sys.exit("gpu_check: " + "; ".join(failures))


if __name__ == "__main__":
    main()
