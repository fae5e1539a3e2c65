"""CPU Adam API: CPUAdam against torch.optim, input validation, what a failed build says, and where a
build is cached."""

import copy
import logging
import os
import re
import subprocess
import sys

import pytest
import torch

from offload.kernels import cpu_adam
from offload.kernels.cpu_adam import CPUAdam, adam_step, grad_sq_sum

BACKENDS = ["torch", "compiled"]


def _model(seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(13, 7), (7,), (5, 3, 2), (1,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    params.append(torch.nn.Parameter(torch.randn(9, 4, generator=gen).t()))  # non-contiguous
    return params


def _train(params, opt, steps=6, seed=1, grad_scale=None):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        if grad_scale is None:
            opt.step()
        else:
            for p in params:
                p.grad *= grad_scale
            opt.step(grad_scale=grad_scale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_cpu_adam_matches_torch(backend, adamw):
    ours, ref = _model(0), _model(0)
    groups = lambda ps: [{"params": ps[:3]}, {"params": ps[3:], "lr": 3e-3, "weight_decay": 0.0}]  # noqa: E731
    torch_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    _train(ours, CPUAdam(groups(ours), lr=1e-2, weight_decay=0.1, adamw=adamw, backend=backend))
    _train(ref, torch_cls(groups(ref), lr=1e-2, weight_decay=0.1, foreach=False))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
        assert a.is_contiguous() == b.is_contiguous()  # the non-contiguous parameter stays as it was


@pytest.mark.parametrize("backend", BACKENDS)
def test_cpu_adam_grad_scale_and_state_dict(backend):
    """step(grad_scale=s) equals unscaled grads; the state dict loads into torch.optim.AdamW and back."""
    ours, ref = _model(2), _model(2)
    opt = CPUAdam(ours, lr=1e-2, backend=backend)
    _train(ours, opt, grad_scale=512.0)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    _train(ref, ref_opt)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
    # Continue training both from the other's state: states are interchangeable.
    # (deep copies: load_state_dict keeps the very tensors it is given)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    opt2 = CPUAdam(ours, lr=1e-2, backend=backend)
    opt2.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    _train(ours, opt2, seed=9)
    _train(ref, ref_opt, seed=9)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


def test_cpu_adam_rejects_bad_params():
    p = torch.nn.Parameter(torch.randn(100))
    half = torch.nn.Parameter(torch.randn(4).half())
    half.grad = torch.randn(4).half()
    with pytest.raises(ValueError, match="fp32 CPU parameters"):
        CPUAdam([half]).step()
    with pytest.raises(ValueError, match="beta1=1.0"):
        CPUAdam([p], betas=(1.0, 0.999))


def _good_args(n=8):
    return dict(param=torch.zeros(n), grad=torch.zeros(n, dtype=torch.bfloat16), exp_avg=torch.zeros(n),
                exp_avg_sq=torch.zeros(n))


HP = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("field, value, match", [
    ("grad", torch.zeros(9, dtype=torch.bfloat16), r"grad.numel\(\)=9: differs from param.numel\(\)=8"),
    ("grad", torch.zeros(8, dtype=torch.int32), r"grad.dtype=torch.int32: unsupported"),
    ("exp_avg", torch.zeros(8, dtype=torch.bfloat16), r"exp_avg.dtype=torch.bfloat16"),
    ("param", torch.zeros(16)[::2], r"param: not contiguous"),
    ("out", torch.zeros(8), r"out.dtype=torch.float32: unsupported"),
    ("out", torch.zeros(7, dtype=torch.bfloat16), r"out.numel\(\)=7"),
])
def test_adam_step_rejects_bad_tensors(backend, field, value, match):
    args = _good_args()
    args[field] = value
    out = args.pop("out", None)
    with pytest.raises(ValueError, match=match):
        adam_step(*args.values(), out=out, backend=backend, **HP)
    assert torch.equal(_good_args()["param"], torch.zeros(8))


@pytest.mark.parametrize("field, value", [("step", 0), ("lr", -1.0), ("beta2", 1.0), ("grad_scale", 0.0),
                                          ("grad_scale", float("inf")), ("eps", -1e-8)])
def test_adam_step_rejects_bad_hparams(field, value):
    hp = dict(HP, grad_scale=1.0)
    hp[field] = value
    args = _good_args()
    with pytest.raises(ValueError, match=f"{field}="):
        adam_step(*args.values(), **hp)
    assert torch.equal(args["param"], torch.zeros(8)) and torch.equal(args["exp_avg_sq"], torch.zeros(8))


def test_knobs_validate():
    with pytest.raises(ValueError, match="backend='gpu'"):
        grad_sq_sum(torch.zeros(3), backend="gpu")
    with pytest.raises(ValueError, match="num_threads=0"):
        cpu_adam.set_num_threads(0)
    with pytest.raises(ValueError, match="isa='sse'"):
        cpu_adam.set_isa("sse")
    assert grad_sq_sum(torch.zeros(0)) == 0.0


@pytest.fixture
def fresh_kernel_state(monkeypatch, tmp_path):
    """Forget the loaded kernel so the next call builds again, into an empty cache."""
    monkeypatch.setattr(cpu_adam, "_kernel", None)
    monkeypatch.setattr(cpu_adam, "_kernel_error", None)
    monkeypatch.setattr(cpu_adam, "_auto_backend", None)
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("OFFLOAD_CPU_ADAM_BACKEND", raising=False)
    return tmp_path


def _assert_falls_back(caplog, reason: str):
    with caplog.at_level(logging.WARNING, logger="offload.kernels.cpu_adam"):
        assert cpu_adam.kernel_backend() == "torch"
    assert "falls back to the torch backend" in caplog.text and reason in caplog.text
    args = _good_args()
    adam_step(*args.values(), **HP)  # auto still works, through torch
    unavailable = re.compile(f"backend='compiled': the CPU Adam kernel is unavailable: .*{re.escape(reason)}", re.S)
    with pytest.raises(RuntimeError, match=unavailable):
        adam_step(*args.values(), backend="compiled", **HP)


def test_build_failure_says_what_failed(fresh_kernel_state, monkeypatch, caplog):
    broken = [fresh_kernel_state / path.name for path in cpu_adam._SOURCES]  # all: the build waits for every file
    for path in broken:
        path.write_text("#error deliberately broken source\n")
    monkeypatch.setattr(cpu_adam, "_SOURCES", tuple(broken))
    _assert_falls_back(caplog, "deliberately broken source")


def test_missing_compiler_says_so(fresh_kernel_state, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "no-such-compiler-offload")
    _assert_falls_back(caplog, "no C++ compiler: 'no-such-compiler-offload' is not on PATH")


def test_backend_env_override(fresh_kernel_state, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CPU_ADAM_BACKEND", "torch")
    assert cpu_adam.kernel_backend() == "torch"
    assert cpu_adam._kernel is None  # forcing torch never builds


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _failing_ninja_first_on_path(tmp_path) -> str:
    """PATH with a `ninja` that fails if it ever runs in front (as a venv's ninja replacing the system's)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ninja = bin_dir / "ninja"
    ninja.write_text("#!/bin/sh\necho 'this ninja must not run' >&2\nexit 1\n")
    ninja.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def test_the_build_directory_is_named_by_sources_compiler_torch_and_flags_not_by_path(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    here = cpu_adam.cache_dir()
    monkeypatch.setenv("PATH", _failing_ninja_first_on_path(tmp_path))
    assert cpu_adam.cache_dir() == here
    source, compiler = cpu_adam._source_bytes(), cpu_adam._compiler_version()
    key = cpu_adam._build_key(source, compiler)
    assert here.name.endswith(key) and here.parent == tmp_path / "cache" / "cpu_adam"
    assert cpu_adam._build_key(source + b"\n", compiler) != key
    assert cpu_adam._build_key(source, compiler + "(another version)") != key
    assert cpu_adam._build_key(source, compiler, flags=("-O2",)) != key


@pytest.mark.compiled_kernel
def test_a_cached_kernel_loads_in_a_new_process_without_running_ninja(tmp_path):
    """Built once (by the marker's check, in this process): a new process with another ninja first on PATH
    loads it from its directory, never runs ninja and never says it builds."""
    code = "from offload.kernels import cpu_adam; assert cpu_adam._get_kernel() is not None, cpu_adam._kernel_error"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PATH": _failing_ninja_first_on_path(tmp_path), "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "building the CPU Adam kernel" not in proc.stderr and "must not run" not in proc.stderr
