"""CPU Adam parity: the compiled kernel (every ISA this CPU has) and the torch fallback against
torch.optim.AdamW / Adam (foreach=False), with bf16/fp16 outputs bit-exact against casting the master."""

import math

import pytest
import torch

from offload.kernels import cpu_adam
from offload.kernels.cpu_adam import adam_step, grad_sq_sum

# (backend, isa): the compiled kernel is tested at every ISA the CPU supports, so an AVX-512 machine also
# checks the AVX2 and scalar code (tails included). Without the kernel those skip (fail under OFFLOAD_CI=1:
# tests/conftest.py).
BACKENDS = [pytest.param(("torch", None), id="torch")] + [
    pytest.param(("compiled", isa), id=f"compiled-{isa}", marks=pytest.mark.compiled_kernel)
    for isa in ("avx512bf16", "avx512", "avx2", "scalar")]
SIZES = [1, 7, 4097, 1_000_003]
LR, BETAS, EPS = 1e-2, (0.9, 0.999), 1e-8
# "Within 1e-6 relative": params are O(1); values that cross zero get an absolute floor of 1e-7
# (about one fp32 ulp at 1), since their relative error is unbounded for any float implementation.
RTOL, ATOL = 1e-6, 1e-7


def _use_backend(name, isa):
    if name == "compiled" and cpu_adam._ISAS.index(isa) > cpu_adam._kernel.best_isa():
        pytest.skip(f"CPU lacks {isa}")
    cpu_adam.set_isa(isa)
    return name


@pytest.fixture(params=BACKENDS)
def backend(request):
    yield _use_backend(*request.param)
    cpu_adam.set_isa(None)


@pytest.fixture(params=BACKENDS[:2])
def main_backend(request):
    """The two paths users get: the torch fallback and the compiled kernel at its best ISA here."""
    name, isa = request.param
    if name == "compiled":
        isa = cpu_adam._ISAS[cpu_adam._kernel.best_isa()]
    yield _use_backend(name, isa)
    cpu_adam.set_isa(None)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if torch.equal(a.view(torch.int16), b.view(torch.int16)):
        return True
    nan = torch.isnan(a.float())  # nan payloads may differ (torch's vector cast gives 0xFFFF, c10 0x7FC0)
    if not torch.equal(nan, torch.isnan(b.float())):
        return False
    return torch.equal(a.view(torch.int16)[~nan], b.view(torch.int16)[~nan])


def _run_parity(backend, numel, adamw, wd, grad_dtype, scaled, steps=20):
    gen = torch.Generator().manual_seed(numel + 17 * int(adamw))
    p0 = torch.randn(numel, generator=gen)
    ref = torch.nn.Parameter(p0.clone())
    ref_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref_opt = ref_cls([ref], lr=LR, betas=BETAS, eps=EPS, weight_decay=wd, foreach=False)
    p, m, v = p0.clone(), torch.zeros(numel), torch.zeros(numel)
    out_dtype = torch.float16 if grad_dtype == torch.float16 else torch.bfloat16
    out = torch.empty(numel, dtype=out_dtype)
    # One factor folds the loss scale and a clip coefficient (not a power of two on purpose).
    scale = 1024.0 / 0.37 if scaled else 1.0
    skip_at = 7 if scaled else None
    step = 0
    for i in range(steps):
        g_low = (torch.randn(numel, generator=gen) * scale).to(grad_dtype)
        if i == skip_at:
            g_low[numel // 2] = float("inf")
        if not math.isfinite(grad_sq_sum(g_low, backend=backend)):
            assert i == skip_at, "finite gradients reported as overflow"
            continue  # the caller skips the step: nothing is touched, the step count does not advance
        assert i != skip_at, "overflow not detected"
        step += 1
        ref.grad = g_low.float() / scale
        ref_opt.step()
        adam_step(p, g_low, m, v, step=step, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=wd,
                  adamw=adamw, grad_scale=scale, out=out, backend=backend)
        assert _bits_equal(out, p.to(out_dtype)), f"step {step}: {out_dtype} output differs from the RNE cast"
    state = ref_opt.state[ref]
    torch.testing.assert_close(p, ref.detach(), rtol=RTOL, atol=ATOL)
    for ours, theirs in ((m, state["exp_avg"]), (v, state["exp_avg_sq"])):  # within 1e-6 of the state's scale
        torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=RTOL * float(theirs.abs().max()))
    assert step == (steps - 1 if scaled else steps)


@pytest.mark.parametrize("numel", SIZES[:3] + [pytest.param(SIZES[3], marks=pytest.mark.slow)])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("wd", [0.0, 0.1], ids=["wd0", "wd0.1"])
@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "scaled+skip"])
def test_parity_bf16_grads(backend, numel, adamw, wd, scaled):
    _run_parity(backend, numel, adamw, wd, torch.bfloat16, scaled)


@pytest.mark.parametrize("adamw, wd, scaled", [(True, 0.1, True), (False, 0.1, False), (False, 0.0, True)],
                         ids=["adamw-wd-scaled+skip", "adam-wd-unscaled", "adam-scaled+skip"])
def test_parity_large(main_backend, adamw, wd, scaled):
    """1,000,003 elements by default on the two user-facing paths; the full matrix runs with -m slow."""
    _run_parity(main_backend, SIZES[3], adamw, wd, torch.bfloat16, scaled)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.compiled_kernel
def test_isas_bit_identical(grad_dtype, adamw):
    """Every ISA of the compiled kernel rounds alike (FMA in the same places), so AVX2 and scalar
    results equal the best ISA's bit for bit; at 1,000,003 this covers many chunks and the tails."""
    gen = torch.Generator().manual_seed(1)
    numel = SIZES[3]
    p0, m0 = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen) * 0.1
    v0 = torch.rand(numel, generator=gen) * 0.01
    g = (torch.randn(numel, generator=gen) * 100).to(grad_dtype)
    results = []
    try:
        for isa in cpu_adam._ISAS[: cpu_adam._kernel.best_isa() + 1]:
            cpu_adam.set_isa(isa)
            p, m, v = p0.clone(), m0.clone(), v0.clone()
            out = torch.empty(numel, dtype=torch.bfloat16)
            adam_step(p, g, m, v, step=5, lr=LR, beta1=0.9, beta2=0.999, eps=EPS, weight_decay=0.1, adamw=adamw,
                      grad_scale=100.0, out=out, backend="compiled")
            results.append((isa, p, m, v, out))
    finally:
        cpu_adam.set_isa(None)
    best = results[-1]
    for other in results[:-1]:
        for a, b in zip(other[1:], best[1:]):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{other[0]} differs from {best[0]}"


@pytest.mark.parametrize("numel", [7, 4097, 100_003])
@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_parity_other_grad_dtypes(backend, numel, grad_dtype, adamw):
    _run_parity(backend, numel, adamw, 0.05, grad_dtype, scaled=True)


def test_no_out_and_fp32_grads_unchanged(backend):
    """Without `out` only the states change; the caller's fp32 gradient is not modified by unscaling."""
    gen = torch.Generator().manual_seed(3)
    p, g = torch.randn(5000, generator=gen), torch.randn(5000, generator=gen)
    g_before = g.clone()
    m, v = torch.zeros(5000), torch.zeros(5000)
    adam_step(p, g, m, v, step=1, lr=LR, beta1=0.9, beta2=0.999, eps=EPS, weight_decay=0.0, grad_scale=4.0,
              backend=backend)
    assert torch.equal(g, g_before)
    torch.testing.assert_close(m, 0.1 * g / 4.0, rtol=1e-6, atol=0)


def _tricky_floats(numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(11)
    bits = torch.randint(-2**31, 2**31 - 1, (numel,), generator=gen, dtype=torch.int64)
    special = torch.tensor([0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001,  # bf16 ties (even/odd), near ties
                            0x00000001, 0x00008000, 0x00018000, 0x807F8000,   # denormals, denormal ties
                            0x7F7FFFFF, 0x7F7F8000, 0xFF7FFFFF, 0x477FF000,   # overflow to inf on rounding
                            0x477FEFFF, 0x33800000, 0x33000000, 0x387FC000,   # fp16 limits, fp16 denormals
                            0x7F800000, 0xFF800000, 0x80000000, 0x7FC00001], dtype=torch.int64)
    bits[: special.numel()] = special
    bits[-special.numel():] = special  # again in the vector tail
    return bits.to(torch.int32).view(torch.float32).clone()


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_out_rounding_bit_exact(backend, out_dtype):
    """lr=0 leaves the master as is, so `out` must equal master.to(out_dtype) for any bit pattern:
    ties to even, denormals, values that round to inf, inf, nan (nan-ness compared)."""
    p = _tricky_floats(10_013)
    expected = p.to(out_dtype)
    g, m, v = torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)
    out = torch.empty(p.numel(), dtype=out_dtype)
    adam_step(p, g, m, v, step=1, lr=0.0, beta1=0.9, beta2=0.999, eps=EPS, weight_decay=0.0, out=out,
              backend=backend)
    assert _bits_equal(out, expected)


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_grad_sq_sum(backend, numel, dtype):
    gen = torch.Generator().manual_seed(numel)
    g = (torch.randn(numel, generator=gen) * 3).to(dtype)
    expected = float(g.double().square().sum())
    assert grad_sq_sum(g, backend=backend) == pytest.approx(expected, rel=1e-12)
    for pos in {0, numel // 2, numel - 1}:
        for bad, want in ((float("inf"), math.inf), (float("-inf"), math.inf), (float("nan"), None)):
            h = g.clone()
            h[pos] = bad
            total = grad_sq_sum(h, backend=backend)
            assert (math.isnan(total) if want is None else total == want), (pos, bad, total)


def test_grad_sq_sum_large_finite_and_threads(backend):
    """Squares accumulate in fp64: a finite 1e20 must not read as overflow; any thread count, same sum."""
    g = torch.full((300_001,), 1e20, dtype=torch.float32)
    x = float(g[0])  # 1e20 rounded to fp32
    assert grad_sq_sum(g, backend=backend) == pytest.approx(x * x * g.numel(), rel=1e-9)
    h = torch.randn(1_000_003, dtype=torch.float32)
    try:
        cpu_adam.set_num_threads(1)
        one = grad_sq_sum(h, backend=backend)
    finally:
        cpu_adam.set_num_threads(None)
    assert grad_sq_sum(h, backend=backend) == one


@pytest.mark.compiled_kernel
def test_kernel_runs_on_several_threads():
    """The compiled kernel really spreads chunks over threads (a serial loop passed every parity test)."""
    kernel = cpu_adam._get_kernel()
    chunk = 1 << 16
    assert kernel.threads_used(8 * chunk, 2) == 2
    assert kernel.threads_used(8 * chunk, 4) == 4
    assert kernel.threads_used(2 * chunk, 4) <= 2   # never more threads than chunks (one may take both under load)
    assert kernel.threads_used(8 * chunk, 1) == 1


@pytest.mark.compiled_kernel
def test_threads_do_not_change_the_step():
    if cpu_adam.kernel_backend() != "compiled":
        pytest.skip("OFFLOAD_CPU_ADAM_BACKEND=torch: auto is the torch backend")
    gen = torch.Generator().manual_seed(5)
    p0, g = torch.randn(700_001, generator=gen), torch.randn(700_001, generator=gen).bfloat16()
    results = []
    for threads in (1, None):
        cpu_adam.set_num_threads(threads)
        p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
        adam_step(p, g, m, v, step=3, lr=LR, beta1=0.9, beta2=0.999, eps=EPS, weight_decay=0.1)
        results.append(p)
    cpu_adam.set_num_threads(None)
    assert torch.equal(results[0], results[1])
    assert cpu_adam.get_num_threads() == torch.get_num_threads()


@pytest.mark.parametrize("offset", [0, 1, 8], ids=["aligned", "odd", "16B"])
def test_out_alignment(backend, offset):
    """Large shards stream `out` with non-temporal stores when it is 32-byte aligned, and fall back to
    normal stores otherwise (a shard view at any offset): bit-exact either way, tails included."""
    numel = (1 << 18) + 37
    gen = torch.Generator().manual_seed(offset)
    p = torch.randn(numel, generator=gen)
    g = torch.randn(numel, generator=gen).bfloat16()
    m, v = torch.zeros(numel), torch.zeros(numel)
    storage = torch.zeros(numel + 16, dtype=torch.bfloat16)
    out = storage[offset:offset + numel]
    adam_step(p, g, m, v, step=1, lr=LR, beta1=0.9, beta2=0.999, eps=EPS, weight_decay=0.1, out=out,
              backend=backend)
    assert _bits_equal(out, p.bfloat16())
    assert not storage[:offset].any() and not storage[offset + numel:].any()  # nothing written outside


@pytest.mark.parametrize("numel", [1, 7, 1024, 1025, 3 * 2048 + 5, 200_001])
@pytest.mark.parametrize("block_bytes", [8192, 1 << 20])  # 1 MiB: several 64 Ki-element chunks per block
def test_step_digests_match_the_swap_store(backend, numel, block_bytes, tmp_path):
    """[Note: swap digests in the step]: the digests the step returns are swap.integrity.block_digest of each
    block before and after the update (odd tails, partial last pages, chunks split at block starts), and
    the update itself is the same as without them."""
    from offload.swap import SwapStore

    with SwapStore(tmp_path, backend="threads", block_bytes=block_bytes, checksum=True) as store:
        gen = torch.Generator().manual_seed(numel)
        p, m, g = (torch.randn(numel, generator=gen) for _ in range(3))
        v = torch.rand(numel, generator=gen)
        g = g.to(torch.bfloat16)
        out = torch.empty(numel, dtype=torch.bfloat16)
        for key, t in zip("pmv", (p, m, v)):
            store.write(key, t).wait()
        bounds = store.digest_bounds(numel, 4)
        ref = [t.clone() for t in (p, m, v)]
        adam_step(*ref[:1], g, *ref[1:], step=2, lr=LR, beta1=0.9, beta2=0.999, eps=EPS, weight_decay=0.1,
                  backend=backend)
        d = adam_step(p, g, m, v, step=2, lr=LR, beta1=0.9, beta2=0.999, eps=EPS, weight_decay=0.1, out=out,
                      backend=backend, digest_bounds=bounds)
        assert all(torch.equal(a, b) for a, b in zip((p, m, v), ref))
        for key, t, before, after in zip("pmv", (p, m, v), d.before, d.after):
            store.check_digests(key, before)  # what was written: matches
            store.write(key, t).wait()
            store.check_digests(key, after)   # what the store hashes of the update: matches
        with pytest.raises(ValueError, match="digest_bounds"):
            adam_step(p, g, m, v, step=3, lr=LR, beta1=0.9, beta2=0.999, eps=EPS, weight_decay=0.0,
                      backend=backend, digest_bounds=[0, 5, numel + 1])


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("numel", [4, 7, 100, 4100])  # tails that are not whole vectors
@pytest.mark.parametrize("adamw, wd, scale", [(True, 0.1, 3.0), (True, 0.0, 1.0), (False, 0.1, 1.0)])
def test_torch_fallback_is_position_independent(grad_dtype, numel, adamw, wd, scale):
    """[Note: a position-independent fallback]: a parameter stepped alone and the same values inside a
    larger flat buffer (at a 2048-element offset, as units lay them out) give the same bits, so the
    engine's exact parity holds on machines without a compiler too."""
    gen = torch.Generator().manual_seed(5)
    flat = [torch.randn(8192, generator=gen) for _ in range(3)]
    flat[2] = flat[2].abs()
    g = torch.randn(8192, generator=gen).to(grad_dtype)
    alone = [t[2048:2048 + numel].clone() for t in flat]
    hp = dict(step=3, lr=LR, beta1=0.9, beta2=0.999, eps=EPS, weight_decay=wd, adamw=adamw, grad_scale=scale,
              backend="torch")
    adam_step(alone[0], g[2048:2048 + numel].clone(), alone[1], alone[2], **hp)
    adam_step(flat[0], g, flat[1], flat[2], **hp)
    for a, f in zip(alone, flat):
        assert torch.equal(a.view(torch.int32), f[2048:2048 + numel].view(torch.int32))
