"""CPU Adam: the optimizer step over offloaded fp32 states, at memory-bandwidth speed.

Two backends compute the same update ("auto": the compiled kernel when it builds and loads, else torch;
$OFFLOAD_CPU_ADAM_BACKEND overrides):
- "compiled": offload/kernels/csrc/cpu_adam.cpp (one library with host_alloc.cpp, the CPU backend's allocator:
  open_host_cache), built on first use into a cache directory ($OFFLOAD_CACHE_DIR, else $XDG_CACHE_HOME/offload
  or ~/.cache/offload) named by a hash of what the binary depends on (_build_key), loaded from there after the
  checks of [Note: trusting a cached kernel] (offload/kernels/kernel_cache.py). One pass per element reads the
  fp32 states and the gradient and writes the states and the new weight; AVX-512 (with AVX512_BF16) or AVX2,
  chosen at run time ($OFFLOAD_CPU_ADAM_ISA or `set_isa` caps it), over 64 Ki-element chunks on
  get_num_threads() threads (`set_num_threads(n)` leaves cores to I/O threads).
- "torch": torch._fused_adamw_ / _fused_adam_ over cache-sized tiles, the gradient and weight casts done per
  tile so they hit cache, on torch's thread pool.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import math
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import NamedTuple

import torch

from offload import swap
from offload.kernels import kernel_cache
from offload.swap.integrity import tensor_digests

__all__ = ["CPUAdam", "StepDigests", "adam_step", "grad_sq_sum", "kernel_backend", "kernel_isa", "set_isa",
           "set_num_threads", "get_num_threads", "open_host_cache", "close_host_cache", "host_cache_stats"]

log = logging.getLogger(__name__)

# the kernels (cpu_adam.cpp, with the module's bindings) and torch's CPU allocator on the CPU backend
_SOURCES = tuple(Path(__file__).with_name("csrc") / name for name in ("cpu_adam.cpp", "host_alloc.cpp"))
LIBRARY_NAME = "offload_cpu_adam"  # the extension module (TORCH_EXTENSION_NAME) and its library, <LIBRARY_NAME>.so
_CFLAGS = ("-O3", "-ffp-contract=off")  # no fused multiply-add but where written (the int8 step: [Note: the int8 step])
_BACKENDS = ("auto", "compiled", "torch")
_ISAS = ("scalar", "avx2", "avx512", "avx512bf16")  # index = the kernel's ISA code (avx512bf16: AVX-512
# plus vcvtneps2bf16 for the bf16 weight output)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.bfloat16, torch.float16)
# [Note: fallback tile size] 256 Ki elements = 1 MiB per fp32 array: the tile's gradient cast, the fused
# step and the weight cast run back to back while the tile is still in L2/L3, and the per-tile Python
# overhead stays small next to the tile's work.
_TILE_NUMEL = 1 << 18
_VEC_PAD = 64  # elements: a multiple of every vector width torch's kernel uses (see _torch_adam_step)
_MASK64 = (1 << 64) - 1

_lock = threading.Lock()
_kernel = None          # the loaded extension module, once built
_kernel_error = None    # why it could not be built/loaded (str), once tried
_auto_backend = None    # what "auto" resolves to, once decided
_num_threads = None     # None: follow torch.get_num_threads()
_isa_cap = None         # None: the best the CPU supports (or $OFFLOAD_CPU_ADAM_ISA)


# ---------------------------------------------------------------------------------------------- building

def _build_key(source: bytes, compiler: str, flags: tuple[str, ...] = _CFLAGS) -> str:
    """What the built library depends on: the source, the compiler (its --version), torch, the Python ABI
    and the flags. Not PATH, not ninja, not the checkout: the cache is reused whatever else changes."""
    h = hashlib.sha256()
    for part in (source, compiler, torch.__version__, sys.implementation.cache_tag, " ".join(flags)):
        h.update(hashlib.sha256(part if isinstance(part, bytes) else part.encode()).digest())
    return h.hexdigest()[:16]


def _source_bytes() -> bytes:
    return b"".join(path.name.encode() + b"\0" + path.read_bytes() for path in _SOURCES)


def _compiler_version() -> str:
    cxx = os.environ.get("CXX", "c++")  # what torch.utils.cpp_extension compiles with
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler: {cxx!r} is not on PATH (install g++ or set CXX)")
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"the C++ compiler {cxx!r} does not run: {e}") from e


def cache_dir() -> Path:
    root = os.environ.get("OFFLOAD_CACHE_DIR")
    if root is None:
        root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "offload"
    key = _build_key(_source_bytes(), _compiler_version())
    tag = f"torch{torch.__version__.replace('+', '_')}-{sys.implementation.cache_tag}"
    return Path(root) / "cpu_adam" / f"{tag}-{key}"


def _import(library: Path) -> object:
    """The extension module from its built library, as cpp_extension.load would import it (without ninja)."""
    spec = importlib.util.spec_from_file_location(LIBRARY_NAME, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build() -> object:
    """Load the kernel built for this key, or compile it first (once per key: the build directory is named
    by _build_key, so a cached build never runs ninja again). A cached library is loaded only when it can
    be trusted ([Note: trusting a cached kernel] in offload/kernels/kernel_cache.py); else it is built again and
    one line says why. Raises RuntimeError saying what failed."""
    build_dir = cache_dir()
    try:
        unsafe = kernel_cache.unsafe_ancestry(build_dir.parent)
        if unsafe is not None:  # the cache cannot be made safe from here: build for this process alone
            return _build_into(kernel_cache.private_dir("offload-cpu-adam-"), cached=False, why=(
                f"not in the cache: {unsafe}; chmod go-w it, or set OFFLOAD_CACHE_DIR to a directory only you "
                "can write, to keep the build"))
        kernel_cache.private_dirs(build_dir.parent)
        with kernel_cache.locked(build_dir.parent / f"{build_dir.name}.lock"):
            library = build_dir / f"{LIBRARY_NAME}.so"
            if not library.exists():
                return _build_into(build_dir)
            why = kernel_cache.why_untrusted(build_dir, library)
            if why is None:
                try:
                    return _import(library)
                except ImportError as e:  # trusted, yet it does not load here
                    why = f"{library} does not load ({e})"
            return _build_into(build_dir, why=f"the cached build was not loaded: {why}")
    except OSError as e:
        raise RuntimeError(f"the CPU Adam kernel cache in {build_dir.parent}: {e}") from e


def _build_into(build_dir: Path, cached: bool = True, why: str | None = None) -> object:
    """Compile into `build_dir` (emptied first: ninja would reuse object files found there), seal the
    library (kernel_cache.seal: no group or others' write bit, its digest beside it), return the module.
    One line on stderr says so, ending with `why` (when given)."""
    kernel_cache.fresh_dir(build_dir)
    print(f"offload: building the CPU Adam kernel ({'once, ' if cached else ''}~25 s) in {build_dir}"
          + (f" ({why})" if why else ""), file=sys.stderr, flush=True)
    module = _compile(build_dir)
    kernel_cache.seal(build_dir / f"{LIBRARY_NAME}.so")
    return module


def _compile(build_dir: Path) -> object:
    """torch.utils.cpp_extension.load of the kernel's source into `build_dir`; RuntimeError if it fails."""
    from torch.utils import cpp_extension
    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError as e:
        raise RuntimeError("ninja is not installed (pip install ninja)") from e
    # Compile copies inside the cache directory: ninja records the source paths, so building the package's
    # own files from two checkouts (worktrees, venvs) with the same contents would rebuild on every load.
    sources = [build_dir / path.name for path in _SOURCES]
    for path, copy in zip(_SOURCES, sources):
        shutil.copyfile(path, copy)
    try:
        return cpp_extension.load(name=LIBRARY_NAME, sources=[str(c) for c in sources], extra_cflags=list(_CFLAGS),
                                  build_directory=str(build_dir), verbose=False)
    except Exception as e:  # compiler errors surface as RuntimeError/CalledProcessError/ImportError
        raise RuntimeError(f"building/loading {', '.join(map(str, _SOURCES))} in {build_dir} failed: {e}") from e


def _get_kernel():
    """The compiled kernel module, or None with `_kernel_error` saying why (built/tried once)."""
    global _kernel, _kernel_error
    if _kernel is None and _kernel_error is None:
        with _lock:
            if _kernel is None and _kernel_error is None:
                try:
                    _kernel = _build()
                except RuntimeError as e:
                    _kernel_error = str(e)
    return _kernel


def kernel_backend() -> str:
    """What backend="auto" resolves to here: "compiled" or "torch". Logs the choice and why, once."""
    global _auto_backend
    if _auto_backend is not None:
        return _auto_backend
    forced = os.environ.get("OFFLOAD_CPU_ADAM_BACKEND", "auto")
    if forced not in _BACKENDS:
        raise ValueError(f"OFFLOAD_CPU_ADAM_BACKEND={forced}: not a backend; use one of {_BACKENDS}")
    if forced == "torch":
        _auto_backend = "torch"
        log.info("offload: CPU Adam uses the torch backend (OFFLOAD_CPU_ADAM_BACKEND=torch)")
    elif _get_kernel() is not None:
        _auto_backend = "compiled"
        log.info("offload: CPU Adam uses the compiled kernel (%s, %d threads)", kernel_isa(), get_num_threads())
    elif forced == "compiled":
        raise RuntimeError(f"OFFLOAD_CPU_ADAM_BACKEND=compiled but the kernel is unavailable: {_kernel_error}")
    else:
        _auto_backend = "torch"
        log.warning("offload: CPU Adam falls back to the torch backend (slower): %s", _kernel_error)
    return _auto_backend


def use_for_swap_digests() -> bool:
    """Hands swap.integrity the compiled kernel's single pass for its block digests (swap.integrity.use_word_digest)
    when CPU Adam's backend here is the compiled one; True if it did. The same (sum, xor) as numpy's two
    passes, faster: with swap checksums on, every block read from nvme is hashed, tens of GB a step for a 7b
    LoRA (bench/RESULTS.md, "LoRA on the 7b preset" and "Figures that code comments carried")."""
    if kernel_backend() != "compiled":
        return False
    kernel = _get_kernel()
    swap.integrity.use_word_digest(lambda addr, n8: kernel.word_digest(addr, n8, -1))
    return True


HOST_CACHE_THRESHOLD = 1 << 20  # bytes: smaller blocks stay with torch's own CPU allocator


def open_host_cache() -> bool:
    """Makes the compiled library torch's CPU allocator while an engine runs on the CPU backend (installed
    once, counted per engine; close_host_cache() ends one): blocks of HOST_CACHE_THRESHOLD bytes or more are
    mapped by it and, once freed, kept for a later request of the same size, never more mapped than an
    eighth (at least 16 MiB) above what was live at once ([Note: reusing activations' host memory] in
    offload/kernels/csrc/host_alloc.cpp). True if it did; False where the backend is not the compiled one or
    another allocator holds torch's CPU slot (then the C library's heap, as
    swap.buffers.map_large_allocations sets it, serves them)."""
    if kernel_backend() != "compiled":
        return False
    return bool(_get_kernel().host_cache_open(HOST_CACHE_THRESHOLD))


def close_host_cache() -> None:
    """Ends one open_host_cache(): when none is left open, the kept blocks are unmapped, and later frees
    unmap at once."""
    _get_kernel().host_cache_close()


def host_cache_stats() -> dict[str, int]:
    """The allocator's byte counts (live, kept, peak_live, mapped_fresh, reused, ...); {} if not installed."""
    return dict(_kernel.host_cache_stats()) if _kernel is not None else {}


def _resolve(backend: str):
    """The kernel module for backend, or None for the torch path."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r}: not a backend; use one of {_BACKENDS}")
    if backend == "auto":
        backend = kernel_backend()
    if backend == "torch":
        return None
    kernel = _get_kernel()
    if kernel is None:
        raise RuntimeError(f"backend='compiled': the CPU Adam kernel is unavailable: {_kernel_error}; "
                           "use backend='torch' or fix the build")
    return kernel


# ---------------------------------------------------------------------------------------------- knobs

def set_num_threads(n: int | None) -> None:
    """Threads for the compiled kernel: n >= 1 (capped by torch.get_num_threads()), or None to follow torch."""
    global _num_threads
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ValueError(f"num_threads={n!r}: must be an int >= 1 or None; None follows torch.get_num_threads()")
    _num_threads = n


def get_num_threads() -> int:
    """Threads the compiled kernel uses now."""
    torch_threads = torch.get_num_threads()
    return torch_threads if _num_threads is None else min(_num_threads, torch_threads)


def set_isa(name: str | None) -> None:
    """Cap the compiled kernel's instruction set ("avx512bf16", "avx512", "avx2", "scalar"); None: the best."""
    global _isa_cap
    if name is not None and name not in _ISAS:
        raise ValueError(f"isa={name!r}: unknown; use one of {_ISAS} or None")
    _isa_cap = name


def _isa_code(kernel) -> int:
    cap = _isa_cap or os.environ.get("OFFLOAD_CPU_ADAM_ISA") or None
    best = kernel.best_isa()
    if cap is None:
        return best
    if cap not in _ISAS:
        raise ValueError(f"OFFLOAD_CPU_ADAM_ISA={cap}: unknown; use one of {_ISAS}")
    if _ISAS.index(cap) > best:
        raise ValueError(f"isa={cap}: this CPU supports at most {_ISAS[best]}; choose a lower one")
    return _ISAS.index(cap)


def kernel_isa() -> str | None:
    """The instruction set the compiled kernel runs with here, or None when it is unavailable."""
    kernel = _get_kernel()
    return None if kernel is None else _ISAS[_isa_code(kernel)]


# ---------------------------------------------------------------------------------------------- the step

def _check_flat(name: str, t, numel: int | None, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}={type(t).__name__}: not a tensor; pass a CPU torch.Tensor")
    if t.device.type != "cpu":
        raise ValueError(f"{name}.device={t.device}: CPU Adam runs on CPU tensors; move it to the CPU")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}.dtype={t.dtype}: unsupported; use one of {list(dtypes)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: not contiguous; pass a flat contiguous tensor (.contiguous())")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name}.numel()={t.numel()}: differs from param.numel()={numel}; pass equal-sized shards")


def _check_hparams(step, lr, beta1, beta2, eps, weight_decay, grad_scale) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"step={step!r}: must be an int >= 1 (the 1-based count for bias correction)")
    checks = (("lr", lr, lr >= 0), ("beta1", beta1, 0 <= beta1 < 1), ("beta2", beta2, 0 <= beta2 < 1),
              ("eps", eps, eps >= 0), ("weight_decay", weight_decay, weight_decay >= 0),
              ("grad_scale", grad_scale, grad_scale > 0 and math.isfinite(grad_scale)))
    for name, value, ok in checks:
        if not ok:
            raise ValueError(f"{name}={value}: out of range; use lr, eps, weight_decay >= 0, "
                             "0 <= betas < 1 and a finite grad_scale > 0")


class StepDigests(NamedTuple):
    """Swap block digests of (param, exp_avg, exp_avg_sq) before and after a step; one tuple of
    swap.integrity.block_digest values per array, one value per span of the `digest_bounds` given."""
    before: tuple[tuple[int, ...], ...]
    after: tuple[tuple[int, ...], ...]


def adam_step(param, grad, exp_avg, exp_avg_sq, *, step: int, lr: float, beta1: float, beta2: float,
              eps: float, weight_decay: float, adamw: bool = True, grad_scale: float = 1.0,
              out=None, backend: str = "auto", digest_bounds=None, split=None) -> StepDigests | None:
    """One Adam/AdamW update of a flat fp32 shard, in place, using grad / grad_scale.

    param, exp_avg, exp_avg_sq: contiguous fp32 CPU tensors; grad: bf16/fp16/fp32, same numel.
    `step` is the 1-based step count for bias correction. adamw=True: decoupled decay
    (param *= 1 - lr*wd); adamw=False: L2 (grad += wd*param), like torch.optim.Adam. `out` (bf16/fp16)
    receives the new weight rounded to nearest even, in the same pass. The caller checks grad_sq_sum
    for inf/nan first and skips the step (this function does not look).
    digest_bounds: element offsets [0, ..., numel] of swap blocks (SwapStore.digest_bounds): the step also
    returns the states' block digests before and after the update, hashed in the same pass (compiled kernel).
    split: a split master's (weights, low halves, tie bits), joined into param and split back in the pass."""
    numel = param.numel() if isinstance(param, torch.Tensor) else None
    _check_flat("param", param, None, (torch.float32,))
    _check_flat("grad", grad, numel, _GRAD_DTYPES)
    _check_flat("exp_avg", exp_avg, numel, (torch.float32,))
    _check_flat("exp_avg_sq", exp_avg_sq, numel, (torch.float32,))
    if out is not None:
        _check_flat("out", out, numel, _OUT_DTYPES)
    lr, beta1, beta2, eps, weight_decay, grad_scale = map(float, (lr, beta1, beta2, eps, weight_decay, grad_scale))
    _check_hparams(step, lr, beta1, beta2, eps, weight_decay, grad_scale)
    bounds = None if digest_bounds is None else _check_bounds(digest_bounds, numel)
    kernel = _resolve(backend)
    if split is not None and kernel is None:
        raise ValueError("split=: a split master steps fused in the compiled kernel only; join and split around it")
    if numel == 0:
        return None if bounds is None else StepDigests(((),) * 3, ((),) * 3)
    if kernel is None:
        states = (param, exp_avg, exp_avg_sq)
        before = None if bounds is None else tuple(tensor_digests(t, bounds) for t in states)
        _torch_adam_step(param.view(-1), grad.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1),
                         None if out is None else out.view(-1), step, lr, beta1, beta2, eps, weight_decay,
                         bool(adamw), grad_scale)
        return None if bounds is None else StepDigests(before, tuple(tensor_digests(t, bounds) for t in states))
    with torch.profiler.record_function("offload::cpu_adam"):
        d = kernel.adam_step(param, grad, exp_avg, exp_avg_sq, out, step, lr, beta1, beta2, eps, weight_decay,
                             bool(adamw), grad_scale, get_num_threads(), _isa_code(kernel),
                             None if bounds is None else torch.tensor(bounds, dtype=torch.int64), split)
    if bounds is None:
        return None
    cells = d.tolist()  # [before/after][array][block][sum, xor] as signed int64
    return StepDigests(*(tuple(tuple(((x & _MASK64) << 64) | (s & _MASK64) for s, x in arr) for arr in io)
                         for io in cells))


def _check_bounds(bounds, numel: int) -> list[int]:
    b = [int(x) for x in bounds]
    if len(b) < 2 or b[0] != 0 or b[-1] != numel or any(y <= x for x, y in zip(b, b[1:])) \
            or any(x % 32 for x in b[:-1]):
        raise ValueError(f"digest_bounds={b[:4]}...{b[-1:]}: must increase from 0 to numel={numel} with block "
                         "starts in multiples of 32 elements; use SwapStore.digest_bounds(numel, 4)")
    return b


def _torch_adam_step(param, grad, exp_avg, exp_avg_sq, out, step, lr, beta1, beta2, eps, weight_decay,
                     adamw, grad_scale) -> None:
    """The fallback: torch's fused CPU Adam over tiles, with the casts fused per tile.

    [Note: a position-independent fallback]
    torch's kernel runs whole vectors and then a scalar tail that rounds differently (no FMA), so an
    element's result would depend on where its tensor ends: a parameter stepped alone would differ by an
    ulp from the same parameter inside a unit's flat buffer. So the last numel % _VEC_PAD elements run as
    one zero-padded full-vector tile, and every element takes the vector path wherever it sits."""
    fused = torch._fused_adamw_ if adamw else torch._fused_adam_
    step_t = torch.tensor(float(step))  # the fused op reads the step count from a tensor
    # grad_scale: the op divides grads by it in place, so scaled grads always go through our tile buffer.
    scale_t = None if grad_scale == 1.0 else torch.tensor(grad_scale, dtype=torch.float32)
    needs_copy = grad.dtype != torch.float32 or scale_t is not None
    numel = param.numel()
    body = numel - numel % _VEC_PAD
    tile = torch.empty(min(max(body, 1), _TILE_NUMEL), dtype=torch.float32) if needs_copy else None

    def run(p, g, m, v) -> None:
        fused([p], [g], [m], [v], [], [step_t], lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
              eps=eps, amsgrad=False, maximize=False, grad_scale=scale_t, found_inf=None)

    with torch.profiler.record_function("offload::cpu_adam_torch"):
        for s in range(0, body, _TILE_NUMEL):
            e = min(body, s + _TILE_NUMEL)
            run(param[s:e], grad[s:e] if not needs_copy else tile[: e - s].copy_(grad[s:e]),
                exp_avg[s:e], exp_avg_sq[s:e])
            if out is not None:
                out[s:e].copy_(param[s:e])  # while the tile is in cache
        if body < numel:
            pads = [torch.zeros(_VEC_PAD) for _ in range(4)]
            for pad, t in zip(pads, (param, grad, exp_avg, exp_avg_sq)):
                pad[: numel - body].copy_(t[body:])
            run(*pads)
            for pad, t in zip(pads[:1] + pads[2:], (param, exp_avg, exp_avg_sq)):
                t[body:].copy_(pad[: numel - body])
            if out is not None:
                out[body:].copy_(param[body:])


def grad_sq_sum(grad, *, backend: str = "auto") -> float:
    """Sum of squares of grad (bf16/fp16/fp32, any contiguous CPU tensor), accumulated in fp64.

    inf/nan in grad give inf/nan: use it for the global norm and for fp16 overflow detection before any
    adam_step, so a skipped step touches nothing. Deterministic: independent of the thread count.
    """
    _check_flat("grad", grad, None, _GRAD_DTYPES)
    kernel = _resolve(backend)
    if grad.numel() == 0:
        return 0.0
    if kernel is not None:
        return kernel.grad_sq_sum(grad, get_num_threads(), _isa_code(kernel))
    flat, total = grad.view(-1), 0.0
    for s in range(0, flat.numel(), _TILE_NUMEL):
        t = flat[s:s + _TILE_NUMEL].to(torch.float64)
        total += float(torch.dot(t, t))
    return total


# ---------------------------------------------------------------------------------------------- optimizer

class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW over CPU fp32 parameters with the fast kernel; a drop-in for torch.optim.AdamW/Adam.

    adamw=True (default) is torch.optim.AdamW (decoupled decay, default weight_decay=1e-2);
    adamw=False is torch.optim.Adam with L2 decay. State keys match torch's ("step" as a float tensor,
    "exp_avg", "exp_avg_sq"), so state dicts move between them. Gradients may be fp32, bf16 or fp16.
    step(grad_scale=s) uses grad / s (fp16 loss scaling and/or clipping folded into one factor).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, adamw: bool = True, *, backend: str = "auto"):
        _check_hparams(1, float(lr), float(betas[0]), float(betas[1]), float(eps), float(weight_decay), 1.0)
        if backend not in _BACKENDS:
            raise ValueError(f"backend={backend!r}: not a backend; use one of {_BACKENDS}")
        self.backend = backend
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw=adamw)
        super().__init__(params, defaults)

    def _state_for(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return state

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float = 1.0):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_param(p, group, grad_scale)
        return loss

    def _step_param(self, p: torch.Tensor, group: dict, grad_scale: float) -> None:
        if p.device.type != "cpu" or p.dtype != torch.float32:
            raise ValueError(f"param (shape {tuple(p.shape)}) is {p.dtype} on {p.device}: CPUAdam updates fp32 "
                             "CPU parameters; keep fp32 master weights on the CPU")
        if p.grad.is_sparse:
            raise ValueError("grad: sparse gradients are not supported by CPUAdam; use torch.optim.SparseAdam")
        state = self._state_for(p)
        state["step"] += 1
        work = p if p.is_contiguous() else p.contiguous()  # the kernel wants flat memory
        beta1, beta2 = group["betas"]
        adam_step(work.view(-1), p.grad.contiguous().view(-1), state["exp_avg"].view(-1),
                  state["exp_avg_sq"].view(-1), step=int(state["step"]), lr=float(group["lr"]),
                  beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                  adamw=group["adamw"], grad_scale=grad_scale, backend=self.backend)
        if work is not p:
            p.copy_(work)
