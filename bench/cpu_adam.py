"""CPU Adam throughput: ours next to torch fused AdamW + casts, DeepSpeedCPUAdam (+ casts) and the roofline.

The job (every figure but deepspeed_fp32): bf16 gradients in, fp32 master/exp_avg/exp_avg_sq updated,
bf16 weights out = 2 + 3*4 bytes read + 3*4 + 2 written = 28 bytes per parameter.
- ours:              offload.kernels.cpu_adam.adam_step(p, g_bf16, m, v, out=w_bf16), one pass.
- torch_fused_casts: g32.copy_(g_bf16); torch.optim.AdamW(fused=True).step(); w_bf16.copy_(p).
- deepspeed_casts:   the same casts around DeepSpeedCPUAdam.step().
- deepspeed_fp32:    DeepSpeedCPUAdam.step() alone on fp32 grads: 16 read + 12 written = 28 bytes too.
- ours_digests:      ours with the swap digests of p/m/v before and after the update hashed in the same
                     pass (digest_bounds of 8 MiB blocks, what the engine does with optimizer states on
                     NVMe); `separate_hashes` times the two hash passes over p/m/v that the swap store
                     would make instead (verify after the read, record before the write; numpy, one
                     thread), so ours + separate_hashes is the step before the digests moved into it.
- roofline:          copy bandwidth / 28 bytes, the copy being an in-place p *= 1 over the same 4-byte
                     elements (read + written bytes / s), timed right after each of our steps: the host's
                     bandwidth swings 2x within a minute here (neighbours), so each of our steps is
                     compared with the copy at the same moment; ours_vs_roofline is the median of those
                     paired ratios. Also reported: the best step of four copy methods over the whole run
                     (torch copy_, threaded memcpy, in-place p *= 1, in-place g += p) against our best step.
- int8:              offload.kernels.adam8.adam8_step, the compiled 8-bit AdamW step (int8 m and v, one fp32
                     absmax per 256: [Note: int8 optimizer states]), bf16 grads in, bf16 weights out: master
                     4 + 4, grad 2, codes 2 + 2, out 2, absmax 16/256 = 16.06 bytes per parameter;
                     int8_roofline is the paired copy bandwidth over those bytes, int8_vs_fp32 its rate / ours.
- bnb_adamw8bit_casts: bitsandbytes.optim.AdamW8bit on CPU tensors (its CPU backend: dequantize blockwise,
                     the update in torch ops, quantize again) with the casts around it as torch_fused_casts;
                     null when bitsandbytes does not import or run (--no-bnb skips it).
Jobs run interleaved, round by round, and the median step is reported. Each round allocates fresh
buffers (ordinary anonymous memory, first-touched and warmed up before timing) and frees them before the
next job's process allocates, so peak memory is one job's set (~20 B/param), not the sum of the processes.
DeepSpeed runs in-process if importable, else in a worker with another interpreter:
--deepspeed-python, $OFFLOAD_BENCH_DS_PYTHON, or a `dsvenv` virtualenv beside this checkout.

  python bench/cpu_adam.py --numel 268435456 --json
"""

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from offload.kernels import cpu_adam  # noqa: E402

BYTES_PER_PARAM = 28
INT8_BYTES_PER_PARAM = 4 + 4 + 2 + 2 + 2 + 2 + 16 / 256  # master r+w, grad, codes r+w, out, absmax r+w
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
BUFFERS = {"p": torch.float32, "m": torch.float32, "v": torch.float32, "g32": torch.float32,
           "g16": torch.bfloat16, "out": torch.bfloat16}


def alloc_buffers(numel: int) -> dict:
    """Fresh buffers, filled by repeating a 1 Mi tile of N(0,1) (fast, and every page touched)."""
    tile = torch.randn(min(numel, 1 << 20), generator=torch.Generator().manual_seed(0))
    b = {name: torch.empty(numel, dtype=dtype) for name, dtype in BUFFERS.items()}
    for s in range(0, numel, tile.numel()):
        e = min(numel, s + tile.numel())
        b["p"][s:e].copy_(tile[: e - s])
        b["g32"][s:e].copy_(tile[: e - s].flip(0))
    b["g16"].copy_(b["g32"])
    for name in ("m", "v", "out"):
        b[name].zero_()
    return b


def time_steps(fn, steps: int) -> list:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


# ------------------------------------------------------------------------------------------- our jobs

def ours_job(b: dict, digest_bounds=None):
    step = [0]
    hashed = {} if digest_bounds is None else {"digest_bounds": digest_bounds}

    def run():
        step[0] += 1
        cpu_adam.adam_step(b["p"], b["g16"], b["m"], b["v"], step=step[0], lr=HP["lr"], beta1=HP["betas"][0],
                           beta2=HP["betas"][1], eps=HP["eps"], weight_decay=HP["weight_decay"], out=b["out"],
                           **hashed)
    return run


def digest_bounds(numel: int) -> list:
    """The engine's swap blocks over a numel-element fp32 state (its default aio.block_bytes)."""
    from offload.plan.config import AioConfig
    from offload.swap.integrity import digest_bounds as bounds

    return bounds(numel, 4, AioConfig().block_bytes)


def separate_hashes_job(b: dict, bounds: list):
    from offload.swap.integrity import tensor_digests

    def run():
        for _ in range(2):  # verify after the read, record before the write
            for k in ("p", "m", "v"):
                tensor_digests(b[k], bounds)
    return run


def torch_fused_casts_job(b: dict):
    param = torch.nn.Parameter(b["p"], requires_grad=True)
    param.grad = b["g32"]
    opt = torch.optim.AdamW([param], fused=True, **HP)
    opt.state[param] = {"step": torch.tensor(0.0), "exp_avg": b["m"], "exp_avg_sq": b["v"]}

    def run():
        b["g32"].copy_(b["g16"])
        opt.step()
        b["out"].copy_(b["p"])
    return run


def int8_job(b: dict):
    """Our compiled int8 step on the round's master, bf16 grads and bf16 out, with its own int8 states."""
    from offload.kernels import adam8

    numel = b["p"].numel()
    states = [torch.zeros(numel, dtype=torch.uint8), torch.zeros(numel // 256),
              torch.zeros(numel, dtype=torch.uint8), torch.zeros(numel // 256)]
    step = [0]

    def run():
        step[0] += 1
        adam8.adam8_step(b["p"], b["g16"], *states, step=step[0], lr=HP["lr"], beta1=HP["betas"][0],
                         beta2=HP["betas"][1], eps=HP["eps"], weight_decay=HP["weight_decay"], out=b["out"])
    return run


def bnb_job(b: dict, info: dict):
    """bitsandbytes' AdamW8bit on the CPU (blockwise, 256) with the casts, warmed up; None (and
    info["bnb_error"]) when it does not import or run."""
    try:
        import bitsandbytes

        param = torch.nn.Parameter(b["p"], requires_grad=True)
        param.grad = b["g32"]
        opt = bitsandbytes.optim.AdamW8bit([param], **HP)

        def run():
            b["g32"].copy_(b["g16"])
            opt.step()
            b["out"].copy_(b["p"])
        run()  # warm-up: allocates the 8-bit states
        info["bnb_version"] = bitsandbytes.__version__
        return run
    except Exception as e:  # noqa: BLE001 (ImportError, or whatever its CPU backend raises: recorded, null)
        info["bnb_error"] = f"{type(e).__name__}: {e}"
        return None


def copy_gbps(b: dict, steps: int) -> dict:
    """Copy bandwidth in GB/s (bytes read + written) by four methods over 4*numel bytes; the best is the
    roofline's base. Out-of-place copies pay a read-for-ownership on the destination that our kernel
    mostly does not (it rewrites lines it just read), so in-place streams are measured too: the
    stricter (higher) roofline."""
    src, dst = b["p"], b["g32"]
    nbytes = src.numel() * 4
    threads = max(1, torch.get_num_threads())

    def memcpy_threaded():
        part = (nbytes // threads) & ~4095
        spans = [(i * part, nbytes - i * part if i == threads - 1 else part) for i in range(threads)]
        ts = [threading.Thread(target=ctypes.memmove, args=(dst.data_ptr() + o, src.data_ptr() + o, n))
              for o, n in spans]  # ctypes releases the GIL during the call
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    methods = {"torch_copy": (lambda: dst.copy_(src), 2), "memcpy": (memcpy_threaded, 2),
               "inplace_scale": (lambda: src.mul_(1.0), 2),       # p = p * 1: read + write the same bytes
               "inplace_add": (lambda: dst.add_(src), 3)}         # g32 += p: two reads, one write
    return {k: moved * nbytes / min(time_steps(fn, steps)) / 1e9 for k, (fn, moved) in methods.items()}


def max_rel_err(numel: int) -> float:
    """Ours vs torch.optim.AdamW(foreach=False) after 3 steps on min(numel, 1M) fresh elements:
    max |ours - ref| / max(|ref|, 1e-3). Also checks the bf16 output is the RNE cast of the master."""
    n = min(numel, 1 << 20)
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([ref], foreach=False, **HP)
    m, v, out = torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)
    for step in range(1, 4):
        g = torch.randn(n, generator=gen).bfloat16()
        ref.grad = g.float()
        opt.step()
        cpu_adam.adam_step(p, g, m, v, step=step, lr=HP["lr"], beta1=HP["betas"][0], beta2=HP["betas"][1],
                           eps=HP["eps"], weight_decay=HP["weight_decay"], out=out)
    if not torch.equal(out.view(torch.int16), p.bfloat16().view(torch.int16)):
        raise AssertionError("bf16 output is not the round-to-nearest-even cast of the fp32 master")
    return float(((p - ref.detach()).abs() / ref.detach().abs().clamp_min(1e-3)).max())


# ------------------------------------------------------------------------------------------- DeepSpeed

DS_WORKER = r"""
import json, sys, time, torch
numel, hp = int(sys.argv[1]), json.loads(sys.argv[2])
def say(obj): print("@@" + json.dumps(obj), flush=True)
try:
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.ops.op_builder import CPUAdamBuilder
    CPUAdamBuilder().load()  # the JIT build of the op, on first use
except Exception as e:
    say({"error": f"DeepSpeedCPUAdam unavailable: {e}"}); sys.exit(0)
say({"ready": True, "version": deepspeed.__version__})
def alloc():  # the same buffers and fill as the parent's alloc_buffers
    tile = torch.randn(min(numel, 1 << 20), generator=torch.Generator().manual_seed(0))
    b = {k: torch.empty(numel) for k in ("p", "m", "v", "g32")}
    b["g16"], b["out"] = torch.empty(numel, dtype=torch.bfloat16), torch.empty(numel, dtype=torch.bfloat16)
    for s in range(0, numel, tile.numel()):
        e = min(numel, s + tile.numel())
        b["p"][s:e].copy_(tile[: e - s]); b["g32"][s:e].copy_(tile[: e - s].flip(0))
    b["g16"].copy_(b["g32"]); b["m"].zero_(); b["v"].zero_(); b["out"].zero_()
    return b
for line in sys.stdin:
    cmd = json.loads(line)
    b = alloc()
    param = torch.nn.Parameter(b["p"], requires_grad=True)
    param.grad = b["g32"]
    opt = DeepSpeedCPUAdam([param], lr=hp["lr"], betas=tuple(hp["betas"]), eps=hp["eps"],
                           weight_decay=hp["weight_decay"], adamw_mode=True)
    opt.state[param] = {"step": 0, "exp_avg": b["m"], "exp_avg_sq": b["v"]}
    def casts():
        b["g32"].copy_(b["g16"]); opt.step(); b["out"].copy_(b["p"])
    fn = casts if cmd["job"] == "casts" else opt.step
    fn()  # warm-up
    times = []
    for _ in range(cmd["steps"]):
        t0 = time.perf_counter(); fn(); times.append(time.perf_counter() - t0)
    del opt, param, b, fn
    say({"times": times})
"""


class DeepSpeedWorker:
    """DeepSpeedCPUAdam over the shared buffers, in a subprocess (any interpreter with deepspeed)."""

    def __init__(self, python: str, numel: int):
        self.proc = subprocess.Popen([python, "-c", DS_WORKER, str(numel), json.dumps(HP)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = self._read()
        if "error" in hello:
            self.close()
            raise RuntimeError(hello["error"])
        self.version = hello["version"]

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return json.loads(line[2:])
        raise RuntimeError(f"DeepSpeed worker exited with {self.proc.wait()}")

    def run(self, job: str, steps: int) -> list:
        self.proc.stdin.write(json.dumps({"job": job, "steps": steps}) + "\n")
        self.proc.stdin.flush()
        return self._read()["times"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def deepspeed_python(arg: str | None) -> str | None:
    """The interpreter for the DeepSpeed worker, or None when there is none."""
    candidates = [arg, os.environ.get("OFFLOAD_BENCH_DS_PYTHON")]
    try:
        import deepspeed  # noqa: F401
        candidates.append(sys.executable)
    except ImportError:
        pass
    candidates.append(str(ROOT.parent / "dsvenv" / "bin" / "python"))
    return next((c for c in candidates if c and os.path.exists(c)), None)


# ------------------------------------------------------------------------------------------- main

def run_bench(args) -> dict:
    worker = None
    py = None if args.no_deepspeed else deepspeed_python(args.deepspeed_python)
    if py is not None:
        try:
            worker = DeepSpeedWorker(py, args.numel)
        except RuntimeError as e:
            print(f"DeepSpeed unavailable: {e}", file=sys.stderr)
    try:
        times = {k: [] for k in ("ours", "roofline_copy", "ours_digests", "separate_hashes", "torch_fused_casts",
                                 "deepspeed_casts", "deepspeed_fp32", "int8", "bnb_adamw8bit_casts")}
        copy, info = {}, {"bnb_version": None, "bnb_error": "skipped (--no-bnb)" if args.no_bnb else None}
        for _ in range(args.rounds):
            # frees its buffers before the worker allocates
            our_round(args.numel, args.steps, times, copy, None if args.no_bnb else info)
            if worker is not None:
                times["deepspeed_casts"] += worker.run("casts", args.steps)
                times["deepspeed_fp32"] += worker.run("fp32", args.steps)
        return {**summarize(args.numel, times, copy, worker), **info}
    finally:
        if worker is not None:
            worker.close()


def our_round(numel: int, steps: int, times: dict, copy: dict, bnb_info: dict | None) -> None:
    b = alloc_buffers(numel)
    for k, gbps in copy_gbps(b, steps).items():
        copy[k] = max(copy.get(k, 0.0), gbps)
    ours = ours_job(b)
    ours()  # warm-up (and the kernel build on first use)
    bounds = digest_bounds(numel)
    fused, hashes = ours_job(b, bounds), separate_hashes_job(b, bounds)
    fused()
    for _ in range(steps):  # each step paired with the in-place copy right after it, and the digest jobs
        times["ours"] += time_steps(ours, 1)
        times["roofline_copy"] += time_steps(lambda: b["p"].mul_(1.0), 1)  # 8 B/elem moved
        times["ours_digests"] += time_steps(fused, 1)
        times["separate_hashes"] += time_steps(hashes, 1)
    torch_job = torch_fused_casts_job(b)
    torch_job()
    times["torch_fused_casts"] += time_steps(torch_job, steps)
    int8 = int8_job(b)
    int8()  # warm-up
    times["int8"] += time_steps(int8, steps)
    bnb = None if bnb_info is None or bnb_info["bnb_error"] else bnb_job(b, bnb_info)
    if bnb is not None:
        times["bnb_adamw8bit_casts"] += time_steps(bnb, steps)


def summarize(numel: int, times: dict, copy: dict, worker) -> dict:
    copy_times = times.pop("roofline_copy")
    fused_times, hash_times = times.pop("ours_digests"), times.pop("separate_hashes")
    # the copy moves 8 B per element, the step 28 B per parameter: the step's time at copy bandwidth
    roof_times = [t * BYTES_PER_PARAM / 8 for t in copy_times]
    rate = {k: (numel / statistics.median(v) / 1e9 if v else None) for k, v in times.items()}
    best = {k: (numel / min(v) / 1e9 if v else None) for k, v in times.items()}
    ours = rate["ours"]
    ratio = {f"ours_vs_{k}": (ours / r if r else None) for k, r in rate.items() if k != "ours"}
    roofline = numel / statistics.median(roof_times) / 1e9
    copy_gbps_best = max(copy.values())
    int8, bnb = rate["int8"], rate["bnb_adamw8bit_casts"]
    int8_roofline = roofline * BYTES_PER_PARAM / INT8_BYTES_PER_PARAM  # the paired copy bandwidth / 16.06 B
    return {"numel": numel, "ours_gparams_s": ours, "torch_fused_casts_gparams_s": rate["torch_fused_casts"],
            "deepspeed_casts_gparams_s": rate["deepspeed_casts"], "deepspeed_fp32_gparams_s": rate["deepspeed_fp32"],
            "roofline_gparams_s": roofline, "max_rel_err": max_rel_err(numel),
            "bytes_per_param": BYTES_PER_PARAM, "copy_gbps": roofline * BYTES_PER_PARAM, "copy_methods_gbps": copy,
            "ours_gbps": ours * BYTES_PER_PARAM,
            "ours_vs_roofline": statistics.median(r / o for r, o in zip(roof_times, times["ours"])),
            "roofline_best_gparams_s": copy_gbps_best / BYTES_PER_PARAM,
            "ours_best_vs_roofline_best": best["ours"] / (copy_gbps_best / BYTES_PER_PARAM),
            "ours_digests_gparams_s": numel / statistics.median(fused_times) / 1e9,
            "separate_hashes_s": statistics.median(hash_times),
            # paired medians: the fused step's cost over the plain one, and its gain over plain + two passes
            "digests_in_step_vs_ours": statistics.median(f / o for f, o in zip(fused_times, times["ours"])),
            "separate_vs_digests_in_step": statistics.median((o + h) / f for o, h, f in
                                                             zip(times["ours"], hash_times, fused_times)),
            "int8_gparams_s": int8, "int8_roofline_gparams_s": int8_roofline,
            "bnb_adamw8bit_casts_gparams_s": bnb, "int8_bytes_per_param": INT8_BYTES_PER_PARAM,
            "int8_vs_fp32": int8 / ours, "int8_vs_int8_roofline": int8 / int8_roofline,
            "int8_vs_bnb": int8 / bnb if bnb else None,
            **ratio, "backend": cpu_adam.kernel_backend(),
            "isa": cpu_adam.kernel_isa(), "threads": cpu_adam.get_num_threads(),
            "best_step_gparams_s": best, "steps_timed": {k: len(v) for k, v in times.items()},
            "deepspeed_version": None if worker is None else worker.version}


def print_table(r: dict) -> None:
    print(f"CPU Adam, {r['numel']:,} params, {r['bytes_per_param']} B/param, backend={r['backend']} "
          f"isa={r['isa']} threads={r['threads']}, DeepSpeed {r['deepspeed_version']}")
    rows = [("ours (bf16 grad -> bf16 out)", "ours"), ("torch fused AdamW + casts", "torch_fused_casts"),
            ("DeepSpeedCPUAdam + casts", "deepspeed_casts"), ("DeepSpeedCPUAdam fp32 alone", "deepspeed_fp32"),
            ("roofline (paired copy / 28 B)", "roofline")]
    for label, key in rows:
        g = r[f"{key}_gparams_s"]
        if g is None:
            print(f"  {label:32s}      n/a")
            continue
        ratio = r["ours_vs_roofline"] if key == "roofline" else r["ours_gparams_s"] / g
        print(f"  {label:32s} {g:6.3f} Gparam/s {g * 28:6.1f} GB/s   ours/this {ratio:5.2f}x")
    methods = ", ".join(f"{k} {v:.1f}" for k, v in r["copy_methods_gbps"].items())
    best = ", ".join(f"{k} {v:.3f}" for k, v in r["best_step_gparams_s"].items() if v)
    print(f"  (medians; best steps: {best})")
    print(f"  roofline: in-place copy right after each of our steps, median {r['copy_gbps']:.1f} GB/s; ours/roofline is "
          f"the median of the paired ratios. Whole-run best copy {r['roofline_best_gparams_s'] * 28:.1f} GB/s "
          f"({methods}): our best step / that = {r['ours_best_vs_roofline_best']:.2f}")
    print(f"  swap digests of p/m/v in the step: {r['ours_digests_gparams_s']:.3f} Gparam/s, "
          f"{r['digests_in_step_vs_ours']:.2f}x our plain step's time; the store's two separate hash passes "
          f"{r['separate_hashes_s']:.3f} s: plain step + those = {r['separate_vs_digests_in_step']:.2f}x the fused step")
    print(f"  max rel err vs torch AdamW {r['max_rel_err']:.2e}")
    bnb = r["bnb_adamw8bit_casts_gparams_s"]
    print(f"  int8 states ({r['int8_bytes_per_param']:.2f} B/param): ours int8 {r['int8_gparams_s']:.3f} Gparam/s "
          f"= {r['int8_vs_fp32']:.2f}x ours fp32, {r['int8_vs_int8_roofline']:.2f}x its roofline "
          f"({r['int8_roofline_gparams_s']:.3f} Gparam/s); bitsandbytes {r['bnb_version']} AdamW8bit + casts "
          + (f"{bnb:.3f} Gparam/s (ours int8 / that {r['int8_vs_bnb']:.2f}x)" if bnb else f"n/a ({r['bnb_error']})"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 26, help="parameters (default 64Mi)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per job per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of all jobs, interleaved")
    ap.add_argument("--deepspeed-python", help="interpreter with deepspeed for the reference")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--no-bnb", action="store_true", help="skip bitsandbytes' AdamW8bit")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args()
    if args.numel < 1 or args.steps < 1 or args.rounds < 1:
        ap.error("--numel, --steps and --rounds must be >= 1")
    if args.numel % 256:
        ap.error(f"--numel {args.numel}: must be a multiple of 256 (the int8 step's blocks)")
    result = run_bench(args)
    print_table(result)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
