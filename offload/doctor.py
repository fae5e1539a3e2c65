"""`offload doctor`: the host, measured (our `ds_report` / `torch.utils.collect_env`, with numbers).

Each probe returns Checks: a name, what was found, a status ("ok", "warn": works but slower than it
could, "fail": a part is missing) and, for warn and fail, the fix in one line. A probe that raises becomes
one failed Check naming the error, never a traceback. The measured figures are also the physical limits
the benches state their ratios against (matmul GFLOP/s per dtype, host memory copy GB/s, swap GB/s):
`matmul_gflops` is the one function both use.
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

MATMUL_SHAPE = (512, 1024, 4096)  # F.linear: (m x k) by (n x k), a layer's size (bench/RESULTS.md quotes it)
COPY_BYTES = 256 << 20
SWAP_BYTES = 256 << 20


@dataclass
class Check:
    name: str
    value: str
    status: str = "ok"    # "ok" | "warn" | "fail"
    fix: str = ""

    def line(self) -> str:
        fix = f"  -> {self.fix}" if self.fix else ""
        return f"{self.name:18s} {self.status:4s}  {self.value}{fix}"


def matmul_gflops(dtype: torch.dtype, device: torch.device | str = "cpu", min_s: float = 0.25) -> float:
    """GFLOP/s of F.linear at MATMUL_SHAPE in `dtype` on `device`, timed over at least `min_s` after one
    warm-up call: the compute floor of a step is its FLOPs over this."""
    m, k, n = MATMUL_SHAPE
    device = torch.device(device)
    x = torch.randn(m, k, device=device).to(dtype)
    w = torch.randn(n, k, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.nn.functional.linear(x, w)
    sync()
    calls, t0 = 0, time.perf_counter()
    while calls < 2 or time.perf_counter() - t0 < min_s:
        torch.nn.functional.linear(x, w)
        calls += 1
        if device.type == "cuda" and calls % 16 == 0:
            sync()
    sync()
    return 2 * m * k * n * calls / (time.perf_counter() - t0) / 1e9


def copy_gbps(nbytes: int = COPY_BYTES) -> float:
    """Host memory bandwidth: bytes copied per second by one tensor copy (each byte read once, written once)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # faulted in
    t0, n = time.perf_counter(), 0
    while n < 3 or time.perf_counter() - t0 < 0.2:
        dst.copy_(src)
        n += 1
    return nbytes * n / (time.perf_counter() - t0) / 1e9


# --- probes: each returns a list of Checks --------------------------------------------------------------


def probe_versions(report: dict) -> list[Check]:
    from offload import __version__

    cuda = torch.version.cuda or "none (a CPU build of torch)"
    report["versions"] = {"python": platform.python_version(), "torch": torch.__version__,
                          "cuda": torch.version.cuda, "offload": __version__}
    return [Check("versions", f"python {platform.python_version()}, torch {torch.__version__}, CUDA {cuda}, "
                              f"offload {__version__}")]


def _cpu_model() -> tuple[str, set[str]]:
    name, flags = platform.processor() or "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return name, flags


def probe_devices(report: dict) -> list[Check]:
    import psutil

    name, flags = _cpu_model()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    from offload.swap import hostmem

    mem = psutil.virtual_memory()
    report["devices"] = {"cpu": name, "cores": cores, "isa": isa, "ram_bytes": mem.total,
                         "ram_available_bytes": hostmem.available(), "gpus": []}
    checks = [Check("cpu", f"{name}, {cores} cores usable, {' '.join(isa) or 'no AVX2'}"),
              Check("memory", f"{mem.total / 2**30:.1f} GiB RAM, {hostmem.describe()}")]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            report["devices"]["gpus"].append({"name": p.name, "capability": [p.major, p.minor],
                                              "memory_bytes": p.total_memory})
            checks.append(Check(f"gpu {i}", f"{p.name}, compute capability {p.major}.{p.minor}, "
                                            f"{p.total_memory / 2**30:.1f} GiB"))
    else:
        checks.append(Check("gpu", "none visible: the engine runs on the CPU backend (hbm is host memory)"))
    return checks


def probe_precision(report: dict) -> list[Check]:
    from offload.plan.precision import Device, resolve_precision

    dev = Device.of()
    choice = resolve_precision("auto", dev)
    report["precision"] = {"auto": choice.name, "reason": choice.reason, "device": str(dev),
                           "bf16_native": dev.bf16, "fp16_native": dev.fp16}
    if dev.kind == "cpu" and not dev.bf16:
        return [Check("precision auto", f"{choice.name}: {choice.reason}", "warn",
                      "auto trains in fp32 here (right for this CPU); for bf16 speed use a CPU with AVX512_BF16 "
                      "or AMX, or a GPU of compute capability >= 8.0")]
    return [Check("precision auto", f"{choice.name}: {choice.reason}")]


def probe_matmul(report: dict) -> list[Check]:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    names = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    figures = {name: matmul_gflops(dtype, device) for name, dtype in names.items()}
    report["limits"]["matmul_gflops"] = figures
    report["limits"]["matmul_device"] = str(device)
    m, k, n = MATMUL_SHAPE
    return [Check("matmul", ", ".join(f"{name} {g:,.1f}" for name, g in figures.items())
                  + f" GFLOP/s on {device} (F.linear {m}x{k} by {n}x{k}, {torch.get_num_threads()} threads)")]


def probe_copy(report: dict) -> list[Check]:
    gbps = copy_gbps()
    report["limits"]["copy_gbps"] = gbps
    return [Check("memory bandwidth", f"{gbps:.1f} GB/s copied ({COPY_BYTES >> 20} MiB tensor copy: each byte "
                                      f"read and written once; CPU Adam moves about 28-30 B per parameter)")]


def probe_cpu_adam(report: dict, build: bool) -> list[Check]:
    from offload.kernels import cpu_adam

    library = cpu_adam.cache_dir() / f"{cpu_adam.LIBRARY_NAME}.so"
    cached = library.exists()
    if not cached and not build:
        report["cpu_adam"] = {"built": False, "dir": str(library.parent)}
        return [Check("CPU Adam kernel", f"not built yet (it builds on first use, ~25 s, into {library.parent})",
                      "warn", "run `offload doctor --build` (or any training run) to build it once")]
    t0 = time.perf_counter()
    backend = cpu_adam.kernel_backend()
    took = time.perf_counter() - t0
    if backend != "compiled":
        report["cpu_adam"] = {"built": False, "error": cpu_adam._kernel_error}
        return [Check("CPU Adam kernel", f"torch fallback (slower): {cpu_adam._kernel_error}", "fail",
                      "install g++ and ninja (pip install ninja), then run `offload doctor --build`")]
    isa = cpu_adam.kernel_isa()
    how = f"loaded from the cache in {took:.1f} s" if cached else f"built in {took:.1f} s"
    report["cpu_adam"] = {"built": True, "cached": cached, "isa": isa, "seconds": took, "dir": str(library.parent)}
    return [Check("CPU Adam kernel", f"compiled, ISA {isa}, {how} ({library.parent})")]


def probe_libaio(report: dict) -> list[Check]:
    try:
        import libaio  # noqa: F401  (loads libaio.so.1)
    except ImportError:
        report["libaio"] = False
        return [Check("libaio", "the libaio Python package is missing: swap I/O uses a thread pool of preadv/pwritev",
                      "fail", "pip install 'offload[aio]' (and apt-get install libaio1)")]
    except OSError as e:
        report["libaio"] = False
        return [Check("libaio", f"libaio.so.1 does not load ({e}): swap I/O uses a thread pool of preadv/pwritev",
                      "fail", "apt-get install libaio1")]
    report["libaio"] = True
    return [Check("libaio", "present: swap I/O through Linux AIO")]


def direct_io_ok(directory: str) -> bool:
    """Whether a file in `directory` takes O_DIRECT (open + one aligned 4 KiB write)."""
    from offload.swap import aligned_empty

    os.makedirs(directory, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=".offload-doctor-", dir=directory)
    os.close(fd)
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        except OSError:
            return False
        try:
            os.pwritev(fd, [memoryview(aligned_empty(4096).numpy())], 0)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
    finally:
        os.unlink(path)


def probe_direct(report: dict, nvme_path: str) -> list[Check]:
    ok = direct_io_ok(nvme_path)
    report["o_direct"] = ok
    if ok:
        return [Check("O_DIRECT", f"{nvme_path} takes O_DIRECT: swap bypasses the page cache")]
    return [Check("O_DIRECT", f"{nvme_path} refuses O_DIRECT (a tmpfs or a network file system?): swap falls back "
                              "to buffered I/O, so the page cache holds swapped bytes too", "warn",
                  "pass --nvme-path on a local drive (ext4/xfs on NVMe)")]


def probe_swap(report: dict, nvme_path: str) -> list[Check]:
    from offload.swap.measure import measure

    r = measure(nvme_path, SWAP_BYTES, checksum=False)
    report["limits"].update(swap_read_gbps=r["read_gbps"], swap_write_gbps=r["write_gbps"])
    mode = "O_DIRECT" if r["direct"] else "buffered"
    longer = f"offload bench nvme --dir {shlex.quote(str(nvme_path))} --size 4G"
    return [Check("swap", f"write {r['write_gbps']:.2f} GB/s, read {r['read_gbps']:.2f} GB/s ({SWAP_BYTES >> 20} MiB "
                          f"in {nvme_path}, {r['engine']}, {mode}; `{longer}` for a longer run)")]


def probe_pinned(report: dict) -> list[Check]:
    if not torch.cuda.is_available():
        report["pinned"] = None
        return [Check("pinned memory", "not applicable: no CUDA (the CPU backend needs none)")]
    from offload.swap import aligned_empty

    t0 = time.perf_counter()
    buf = aligned_empty(64 << 20, pin=True)
    took = time.perf_counter() - t0
    dev = torch.empty(buf.numel(), dtype=torch.uint8, device="cuda")
    dev.copy_(buf, non_blocking=True)
    torch.cuda.synchronize()
    report["pinned"] = {"bytes": buf.numel(), "register_s": took}
    return [Check("pinned memory", f"64 MiB registered with cudaHostRegister in {took * 1e3:.0f} ms; a non_blocking "
                                   "copy from it ran")]


def run(nvme_path: str, build: bool = False) -> dict:
    """Every probe, in order; a probe that raises is one failed Check. Returns the JSON report."""
    report: dict = {"limits": {}, "nvme_path": nvme_path}
    probes = [("versions", probe_versions), ("devices", probe_devices), ("precision auto", probe_precision),
              ("matmul", probe_matmul), ("memory bandwidth", probe_copy),
              ("CPU Adam kernel", lambda r: probe_cpu_adam(r, build)), ("libaio", probe_libaio),
              ("O_DIRECT", lambda r: probe_direct(r, nvme_path)), ("swap", lambda r: probe_swap(r, nvme_path)),
              ("pinned memory", probe_pinned)]
    checks: list[Check] = []
    t0 = time.perf_counter()
    for name, probe in probes:
        try:
            checks += probe(report)
        except Exception as e:  # noqa: BLE001  (a probe's failure is a line of the report)
            checks.append(Check(name, f"the probe failed: {type(e).__name__}: {e}".replace("\n", " "), "fail",
                                _fix_for(name)))
    report["checks"] = [asdict(c) for c in checks]
    report["seconds"] = time.perf_counter() - t0
    return report


def _fix_for(name: str) -> str:
    return {"O_DIRECT": "pass --nvme-path with a writable directory on a local drive",
            "swap": "pass --nvme-path with a writable directory on a local drive; `offload bench nvme --dir DIR` "
                    "shows the error in full"}.get(name, "report it with `offload doctor --json` attached")


def table(report: dict) -> str:
    lines = [f"offload doctor: {sys.platform}, {report['seconds']:.1f} s"]
    lines += [Check(**c).line() for c in report["checks"]]
    bad = sum(c["status"] != "ok" for c in report["checks"])
    lines.append(f"{bad} of {len(report['checks'])} checks need attention (each says what to do)" if bad
                 else "every check ok")
    return "\n".join(lines)
