"""One script for a lent GPU: the tests marked `gpu`, then a short nvme-offload training of the bench
model, and a small table (copy bandwidths, step times, stall share). Prints one JSON line with --json.

python bench/gpu_check.py [--preset bench-200m] [--steps 3] [--dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

import torch


def copy_bandwidth(nbytes: int = 1 << 30) -> dict:
    from swap import aligned_empty

    host = aligned_empty(nbytes, torch.uint8, pin=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, (dst, src) in {"h2d_gbps": (dev, host), "d2h_gbps": (host, dev)}.items():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[name] = 5 * nbytes / (time.perf_counter() - t0) / 1e9
    return out


def train(preset: str, steps: int, directory: str, dev: str) -> dict:
    import offload
    from offload.data import BatchSampler, load_tokens
    from offload.models import build_model, loss_of

    model = build_model(preset, seed=0).cuda()
    sampler = BatchSampler(load_tokens(), 4, 512, seed=0)
    cfg = {"precision": "bf16", "offload_param": {"device": dev}, "offload_optimizer": {"device": dev if dev != "none" else "cpu"},
           "nvme_path": directory}
    times = []
    with offload.initialize(model, cfg) as eng:
        for i in range(steps + 1):
            ids, labels = (t.cuda() for t in sampler.batch(i))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = loss_of(eng(ids, labels))
            eng.backward(loss)
            eng.step()
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
        st = eng.stats()
    step = sorted(times)[len(times) // 2]
    return {"step_s": step, "stall_share": st["stall_seconds"] / sum(times) if times else None,
            "links": {k: v["bytes"] / v["seconds"] / 1e9 if v["seconds"] else None for k, v in st["links"].items()},
            "hbm_peak_gb": st["tiers"]["hbm"]["peak_bytes"] / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="bench-200m")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device visible; run this on a machine with a GPU")
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/"], capture_output=True, text=True)
    print(tests.stdout[-2000:])
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "gpu_tests_rc": tests.returncode,
              **copy_bandwidth()}
    directory = args.dir or tempfile.mkdtemp(prefix="gpu-check-")
    for dev in ("none", "cpu", "nvme"):
        result[f"{dev}_offload"] = train(args.preset, args.steps, directory, dev)
    print(f"{'mode':14s} {'step s':>8s} {'stall':>6s} {'hbm peak GB':>12s}")
    for dev in ("none", "cpu", "nvme"):
        r = result[f"{dev}_offload"]
        print(f"{dev:14s} {r['step_s']:8.3f} {r['stall_share'] or 0:6.1%} {r['hbm_peak_gb']:12.2f}")
    print(f"pinned copies: h2d {result['h2d_gbps']:.1f} GB/s, d2h {result['d2h_gbps']:.1f} GB/s")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
