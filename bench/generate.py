"""Generation from offloaded weights (issue 51): tokens per second side by side in one run, greedy, the same
random prompts (--prompt-tokens each) and exactly --new-tokens new tokens each, per batch size: transformers'
generate() with the model in memory (the floor on a CPU; its lm_head's input made dense as ours makes it, [Note: the prefill's last
positions], which changes nothing where its weights require grad, as from_pretrained leaves them); ours (the model wrapped by the engine, its own
generate(): offload.step.generation) with the weights in dram (read in place on the CPU backend), on nvme with
an hbm budget of --budget for weights (the KV cache's bytes on top: the others do not count them either), and
on nvme with the default budget (nvme_resident: every unit fits; the untimed first call reads them and they stay
fetched for the timed one, as for any generate() after another: [Note: generation]); accelerate's disk offload
(from_pretrained with a device_map whose CPU budget, --budget, sends the rest to --dir's offload folder); and
DeepSpeed ZeRO-Inference (ZeRO-3, offload_param nvme, --budget bytes of live parameters: bench/ds_generate.py
in the venv of bench/ds_venv.sh; null where there is none).
link_bound_tok_s: batch x the swap's read bandwidth (measured in the run, `offload bench nvme`) over the
weights' bytes: the rate if every decode step read every weight once at that bandwidth.
accelerate runs in a process of its own (in this one, after ours' engines had closed, it ran 2.5x slower
until close() gave back the host memory settings it had made process-wide: bench/RESULTS.md). With --memory-cap SIZE, ours on nvme
and accelerate run again, each in a new process in a memory cgroup capped at SIZE, page cache included
(bench/memcap.py; the model's files evicted from the page cache first): nvme_capped and accelerate_capped, and
memory_cap (what the kernel charged each, how often it reached the cap). Uncapped, a host whose RAM holds the
model keeps accelerate's offload folder in its page cache, its "disk" reads memory copies; a model larger than
the RAM never has that.
in_memory_beside_reads: transformers in memory again while fio reads --dir with O_DIRECT at the rate ours read
in its nvme mode (what the host's compute keeps beside those reads: the ceiling of streaming them; null
without fio). nvme_read_per_token_gb: what ours on nvme read a decode step at --budget. same_tokens: each
mode's tokens equal the in-memory ones.

    python bench/generate.py [--model bench-200m|1b|smollm2|DIR] [--batch 1 8 32] [--prompt-tokens 32]
                             [--new-tokens 64] [--budget SIZE] [--dir DIR] [--io-size 1G] [--ds-python PY]
                             [--precision auto|bf16|fp16|fp32] [--memory-cap SIZE] [--json]

Beside them, as every bench (bench/limits.py): precision, matmul_gflops (measured in the run) and
compute_floor_tok_s = matmul_gflops / (2 x params): a token needs 2 FLOPs a parameter, at any batch.
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
import limits  # noqa: E402  (bench/limits.py)
from e2e import default_ds_python, worker_env  # noqa: E402  (bench/e2e.py)

MODES = ("in_memory", "dram", "nvme", "nvme_resident", "accelerate")
COLUMNS = (*MODES, "deepspeed", "nvme_capped", "accelerate_capped", "in_memory_beside_reads")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench-200m", help="a preset, 1b (TinyLlama-1.1B's shape), smollm2 or a HF dir")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dir", default=None, help="swap, offload folder and the model go under it (default: temporary)")
    ap.add_argument("--io-size", default="1G", help="bytes of the swap read measurement")
    ap.add_argument("--budget", default=None, help="the accelerator's bytes for weights, ours and accelerate's "
                                                   "(default: a quarter of the weights at the precision that runs)")
    ap.add_argument("--ds-python", default=default_ds_python(),
                    help="python of a venv with DeepSpeed (bench/ds_venv.sh), for the deepspeed column")
    limits.add_precision_argument(ap)
    ap.add_argument("--memory-cap", default=None,
                    help="also run ours on nvme and accelerate, each in a memory cgroup capped at SIZE (page cache "
                         "included): a host with that much memory (nvme_capped, accelerate_capped)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: one mode, --model a directory
    ap.add_argument("--prompts", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.precision = limits.resolve(args.precision)  # every mode at the same one
    if args.worker:
        return worker(args)
    if args.memory_cap:
        from offload.swap.measure import parse_size

        args.memory_cap = parse_size(args.memory_cap)
    base = tempfile.mkdtemp(prefix="generate-bench-", dir=args.dir)
    try:
        rows, info = run(args, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"{args.model} ({info['params'] / 1e6:.0f}M parameters, {info['weight_bytes'] / 1e9:.2f} GB of weights), "
          f"{args.prompt_tokens} prompt + {args.new_tokens} new tokens, greedy, tokens/s (x in-memory):")
    print(f"  budget for weights: {info['budget_bytes'] / 1e9:.2f} GB (nvme, accelerate, deepspeed)")
    print(f"  precision {info['precision']}: matmul {info['matmul_gflops']:,.1f} GFLOP/s measured in this run; compute "
          f"floor {info['compute_floor_tok_s']:.1f} tok/s (2 x params FLOPs a token / matmul)")
    print(f"  {'batch':>5s} " + " ".join(f"{m:>18s}" for m in COLUMNS) + f" {'link bound':>11s} {'nvme GB/tok':>11s}"
          "  same tokens")
    for r in rows:
        cells = [f"{r[m + '_tok_s']:8.1f} ({r[m + '_tok_s'] / r['in_memory_tok_s']:5.2f}x)"
                 if r[m + "_tok_s"] is not None else "-" for m in COLUMNS]
        print(f"  {r['batch']:5d} " + " ".join(f"{c:>18s}" for c in cells) + f" {r['link_bound_tok_s']:11.1f} "
              f"{r['nvme_read_per_token_gb']:11.3f}  " + ", ".join(m for m in r["same_tokens"] if r["same_tokens"][m]))
    for r in rows:
        cap = r["memory_cap"]
        if cap and cap.get("error"):
            print(f"  batch {r['batch']}: --memory-cap not applied: {cap['error']}")
        elif cap:
            print(f"  batch {r['batch']}: in memory cgroups capped at {cap['limit_bytes'] / 1e9:.2f} GB: " + "; ".join(
                f"{m} charged {cap[m + '_peak_bytes'] / 1e9:.2f} GB at most, reached the cap {cap[m + '_hit_limit']} "
                "times" if m + "_peak_bytes" in cap else f"{m}: {cap[m + '_error']}" for m in ("nvme", "accelerate")))
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
    params = sum(p.numel() for p in load(directory, "fp32").parameters())
    weight_bytes = params * (4 if args.precision == "fp32" else 2)  # at the precision that runs
    budget = parse_size(args.budget) if args.budget else weight_bytes // 4
    rows, prompt_sets = [], {}
    for batch in args.batch:
        prompts = prompt_sets[batch] = torch.randint(1, min(vocab, 1000), (batch, args.prompt_tokens),
                                                     generator=torch.Generator().manual_seed(batch))
        row, tokens = {"batch": batch, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens}, {}
        for mode in MODES:
            if mode == "accelerate":  # in a process of its own: nothing ours did in this one touches it
                r = run_worker(args, mode, directory, prompts, base, budget)
                tokens[mode], seconds, read = torch.tensor(r["tokens"]), r["seconds"], r["read"]
            else:
                tokens[mode], seconds, read = generate(mode, directory, prompts, args.new_tokens, base, budget,
                                                       args.precision)
            row[f"{mode}_tok_s"] = batch * args.new_tokens / seconds
            if mode == "nvme":
                row["nvme_read_per_token_gb"] = read / args.new_tokens / 1e9
                rate = read / seconds
        row.update(capped(args, directory, prompts, base, budget) if args.memory_cap else
                   {"nvme_capped_tok_s": None, "accelerate_capped_tok_s": None, "memory_cap": None})
        if row["nvme_capped_tok_s"] is not None:
            tokens["nvme_capped"] = row.pop("nvme_capped_tokens")
        if row["accelerate_capped_tok_s"] is not None:
            tokens["accelerate_capped"] = row.pop("accelerate_capped_tokens")
        row["in_memory_beside_reads_tok_s"] = beside_reads(directory, prompts, args.new_tokens, rate, base,
                                                           args.precision)
        row["deepspeed_tok_s"] = None
        row["same_tokens"] = {m: bool(torch.equal(tokens[m], tokens["in_memory"])) for m in tokens if m != "in_memory"}
        row["in_memory_tokens"] = tokens["in_memory"]
        rows.append(row)
    info = {"deepspeed_version": None, "deepspeed_error": None}
    if args.ds_python:
        try:
            for row, ds in zip(rows, deepspeed(args, directory, prompt_sets, budget, base)):
                row["deepspeed_tok_s"] = row["batch"] * args.new_tokens / ds["seconds"]
                row["same_tokens"]["deepspeed"] = ds["tokens"] == row["in_memory_tokens"].tolist()
                info["deepspeed_version"] = ds["deepspeed_version"]
        except RuntimeError as e:  # its column stays null, the others are kept
            info["deepspeed_error"] = str(e)[-2000:]
            print(f"deepspeed: {e}", file=sys.stderr)
    for row in rows:
        del row["in_memory_tokens"]
    for row in rows:  # the weights at the precision that runs, read once a decode step
        row["link_bound_tok_s"] = row["batch"] * bw["swap_read_gbps"] * 1e9 / weight_bytes
    gflops = limits.matmul_gflops(args.precision)
    return rows, {"params": params, "weight_bytes": weight_bytes, "budget_bytes": budget, **info, **bw,
                  "precision": args.precision, "matmul_gflops": gflops,
                  "compute_floor_tok_s": gflops * 1e9 / (2 * params)}  # 2 FLOPs a parameter a token: no batch beats it


def capped(args, directory: str, prompts, base: str, budget: int) -> dict:
    """nvme_capped_tok_s and accelerate_capped_tok_s (None where they could not run, memory_cap saying why), their
    tokens, and memory_cap: --memory-cap and what the kernel charged each worker under it."""
    import torch

    import memcap

    out = {"nvme_capped_tok_s": None, "accelerate_capped_tok_s": None, "memory_cap": {"limit_bytes": args.memory_cap}}
    if memcap.cgroup_parent() is None:
        out["memory_cap"]["error"] = "no memory cgroup to make here (Linux cgroups, as root)"
        return out
    for mode in ("nvme", "accelerate"):
        try:
            r = run_worker(args, mode, directory, prompts, base, budget, args.memory_cap)
        except RuntimeError as e:
            out["memory_cap"][f"{mode}_error"] = str(e)
            continue
        out[f"{mode}_capped_tok_s"] = prompts.shape[0] * args.new_tokens / r["seconds"]
        out[f"{mode}_capped_tokens"] = torch.tensor(r["tokens"])
        out["memory_cap"].update({f"{mode}_{k}": r["memory"][k] for k in ("peak_bytes", "hit_limit")})
    return out


def run_worker(args, mode: str, directory: str, prompts, base: str, budget: int, cap: int | None = None) -> dict:
    """One mode's greedy generate() in a new process (`worker`), in a memory cgroup capped at `cap` bytes if
    given (bench/memcap.py; the model's files evicted from the page cache first, so its reads are charged to
    it): worker()'s result, with "memory" (memcap's figures; {} uncapped). RuntimeError if it failed."""
    import subprocess

    import memcap

    work = tempfile.mkdtemp(prefix=f"{mode}-worker-", dir=base)
    try:
        path = os.path.join(work, "prompts.json")
        with open(path, "w") as f:
            json.dump(prompts.tolist(), f)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--model", directory, "--prompts", path,
               "--new-tokens", str(args.new_tokens), "--budget", str(budget), "--precision", args.precision,
               "--dir", work]
        if cap is None:
            proc, mem = subprocess.run(cmd, capture_output=True, text=True, env=worker_env()), {}
        else:
            memcap.evict(directory)
            proc, mem = memcap.run(cmd, cap, env=worker_env())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if proc.returncode:
        killed = " (killed: out of memory under the cap)" if mem.get("oom_killed") else ""
        raise RuntimeError(f"{mode} worker failed (exit {proc.returncode}){killed}: "
                           f"{(proc.stderr.strip().splitlines() or [''])[-1]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "memory": mem}


def worker(args) -> None:
    """In a subprocess: one greedy generate() of --prompts in mode --worker; a JSON line with its tokens,
    seconds, bytes read from nvme and this process's peak RSS."""
    import torch

    with open(args.prompts) as f:
        prompts = torch.tensor(json.load(f))
    tokens, seconds, read = generate(args.worker, args.model, prompts, args.new_tokens, args.dir, int(args.budget),
                                     args.precision)
    print(json.dumps({"tokens": tokens.tolist(), "seconds": seconds, "read": read, "rss_bytes": _status("VmRSS"),
                      "peak_rss_bytes": _status("VmHWM")}))


def _status(key: str) -> int:
    """A size in bytes from /proc/self/status (VmRSS: this process's resident set now; VmHWM: its peak)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def beside_reads(directory: str, prompts, new_tokens: int, rate: float, base: str, precision: str) -> float | None:
    """Tokens/s of transformers' generate() in memory while fio reads a file under `base` (O_DIRECT, libaio, 8 MiB
    blocks) at `rate` bytes/s; None where fio is not installed."""
    import subprocess

    import torch

    if shutil.which("fio") is None:
        return None
    job = ["fio", "--name=reads", f"--filename={os.path.join(base, 'fio.dat')}", "--size=1G", "--bs=8M",
           "--direct=1", "--ioengine=libaio", "--iodepth=8"]
    subprocess.run([*job, "--rw=write"], check=True, capture_output=True)  # the file to read
    reader = subprocess.Popen([*job, "--rw=read", f"--rate={int(rate)}", "--time_based", "--runtime=3600"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        time.sleep(2)  # reading
        kw = greedy(new_tokens)
        _, seconds = timed(load(directory, precision), prompts, torch.ones_like(prompts), kw)
    finally:  # fio's job processes too (the pattern: this run's file alone)
        subprocess.run(["pkill", "-9", "-f", os.path.join(base, "fio.dat")])
        reader.wait()
        os.remove(os.path.join(base, "fio.dat"))
    return prompts.shape[0] * new_tokens / seconds


def deepspeed(args, directory: str, prompt_sets: dict, budget: int, base: str) -> list[dict]:
    """bench/ds_generate.py's line per batch, run in the DeepSpeed venv."""
    import subprocess

    path = os.path.join(base, "prompts.json")
    with open(path, "w") as f:
        json.dump({b: p.tolist() for b, p in prompt_sets.items()}, f)
    cmd = [args.ds_python, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_generate.py"),
           "--model", directory, "--prompts", path, "--new-tokens", str(args.new_tokens), "--budget", str(budget),
           "--dir", base, "--precision", args.precision]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=worker_env())
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in proc.stdout.strip().splitlines()]


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


def load(directory: str, precision: str, **kw):
    """The model in memory (or accelerate's, with `kw`), its output embeddings' input made dense as ours makes it
    ([Note: the prefill's last positions]: with a weight that does not require grad torch's bf16 CPU linear
    materializes it per sequence for the prefill's last-position slice, seconds and GBs at batch 32)."""
    import transformers

    from offload.plan.precision import DTYPES
    from offload.step.generation import contiguous_head

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=DTYPES[precision], **kw).eval()
    contiguous_head(model)
    return model


def generate(mode: str, directory: str, prompts, new_tokens: int, base: str, budget: int, precision: str):
    """(the new tokens, seconds, bytes read from nvme) of one greedy generate() of `prompts` in `mode`, after an
    untimed one of 2 new tokens (first-call costs; the engine's generation trace)."""
    import torch

    kw = greedy(new_tokens)
    mask = torch.ones_like(prompts)
    if mode in ("in_memory", "accelerate"):
        model = load(directory, precision) if mode == "in_memory" else load(
            directory, precision, device_map="auto", max_memory={"cpu": budget},
            offload_folder=os.path.join(base, "offload"))
        return (*timed(model, prompts, mask, kw), 0)
    import offload
    from offload.integrations.hf_io import SafetensorsWeights
    from offload.models import build_model

    from offload.step.generation import kv_bytes

    model = build_model(directory, device="meta")
    model.requires_grad_(False)
    cfg = {"precision": precision, "offload_param": {"device": "cpu" if mode == "dram" else "nvme"},
           "offload_optimizer": {"device": "cpu"}, "nvme_path": os.path.join(base, "swap")}
    if mode == "nvme":  # --budget for weights, and the KV cache of this batch beside it
        kv = kv_bytes(model.config, prompts.shape[0], prompts.shape[1] + new_tokens, 2 if precision != "fp32" else 4)
        cfg["budgets"] = {"hbm_bytes": budget + kv}
    with offload.initialize(model, cfg, weights=SafetensorsWeights(directory, model=model)) as engine:
        engine.eval()
        timed(engine.module, prompts, mask, {**kw, "max_new_tokens": 2, "min_new_tokens": 2})
        read = engine.stats()["links"]["nvme_to_dram"]["bytes"]
        out, seconds = timed(engine.module, prompts, mask, kw, warm=False)
        return out, seconds, engine.stats()["links"]["nvme_to_dram"]["bytes"] - read


def greedy(new_tokens: int) -> dict:
    """generate()'s arguments for exactly `new_tokens` greedy tokens, the same in every mode."""
    return {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False, "num_beams": 1,
            "pad_token_id": 0}


def timed(model, prompts, mask, kw: dict, warm: bool = True):
    """(new tokens, seconds) of generate(), after an untimed one of 2 new tokens if `warm`."""
    import torch

    with torch.no_grad():
        if warm:
            model.generate(input_ids=prompts, attention_mask=mask, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
        t = time.perf_counter()
        out = model.generate(input_ids=prompts, attention_mask=mask, **kw)
        seconds = time.perf_counter() - t
    return out[:, prompts.shape[1]:], seconds


if __name__ == "__main__":
    main()


def device_decode(device, h2d_gbps: float | None, base: str, preset: str = "bench-200m", batch: int = 32,
                  prompt_tokens: int = 32, new_tokens: int = 64) -> dict:
    """bench/gpu_check.py's decode case: `preset` (transformers' Llama, fp32) with its weights in pinned dram and
    an hbm budget of a quarter of them beside the KV cache, greedy generate() of `batch` prompts on `device`. The
    bound: batch x the plain pinned H2D copy's GB/s (`h2d_gbps`, measured in the same run) over the bytes each
    decode step moved (the engine's dram_to_hbm count over the new tokens); goal: >= 0.85 of it. same_tokens:
    the tokens equal transformers' generate() with the model whole on the device."""
    import torch

    import offload
    from offload.integrations.hf_io import SafetensorsWeights
    from offload.models import build_model
    from offload.step.generation import kv_bytes

    directory = model_dir(preset, base)
    model = build_model(directory, device="meta").requires_grad_(False)
    prompts = torch.randint(1, min(model.config.vocab_size, 300), (batch, prompt_tokens),
                            generator=torch.Generator().manual_seed(batch)).to(device)
    mask = torch.ones_like(prompts)
    kw = greedy(new_tokens)
    expected, in_memory_s = timed(load(directory, "fp32").to(device), prompts, mask, kw)
    weights = sum(p.numel() * 4 for p in model.parameters())
    cfg = {"precision": "fp32", "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"},
           "budgets": {"hbm_bytes": weights // 4 + kv_bytes(model.config, batch, prompt_tokens + new_tokens, 4)}}
    with offload.initialize(model, cfg, weights=SafetensorsWeights(directory, model=model)) as engine:
        engine.eval()
        timed(engine.module, prompts, mask, {**kw, "max_new_tokens": 2, "min_new_tokens": 2}, warm=False)
        moved = engine.stats()["links"]["dram_to_hbm"]["bytes"]
        out, seconds = timed(engine.module, prompts, mask, kw, warm=False)
        per_step = (engine.stats()["links"]["dram_to_hbm"]["bytes"] - moved) / new_tokens
    tok_s = batch * new_tokens / seconds
    bound = batch * h2d_gbps * 1e9 / per_step if h2d_gbps and per_step else None
    return {"model": preset, "batch": batch, "tok_s": tok_s, "in_memory_tok_s": batch * new_tokens / in_memory_s,
            "moved_per_step_gb": per_step / 1e9, "bound_tok_s": bound,
            "of_bound": tok_s / bound if bound else None, "ok": bound is None or tok_s >= 0.85 * bound,
            "same_tokens": bool(torch.equal(out, expected))}


def decode_line(r: dict) -> str:
    """device_decode's result in one line."""
    bound = f"{r['bound_tok_s']:.0f} tok/s bound ({r['of_bound']:.2f} of it)" if r["bound_tok_s"] else "no bound"
    return (f"decode, {r['model']} batch {r['batch']}, weights in dram: {r['tok_s']:.1f} tok/s (in memory "
            f"{r['in_memory_tok_s']:.1f}), {r['moved_per_step_gb']:.3f} GB a step, {bound}; "
            f"same tokens as in memory: {r['same_tokens']}")
