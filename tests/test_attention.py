"""Attention that does not hold the sequence squared ([Note: which attention runs] in offload/step/activations.py):
on the CPU backend the presets and Hugging Face models run SDPA's flash kernel, which keeps no T x T scores for
the backward, and the memory plan says which attention runs."""

import contextlib

import pytest
import torch

import offload
from offload.models import build_model
from tests.engine_util import MLP, LlamaLoss, llama

T = 40  # no other dimension of these models is 40


def _preset():
    return build_model("tiny", seed=0), 257


def _hf(impl: str = "sdpa"):
    lm = llama()
    lm.set_attn_implementation(impl)
    return LlamaLoss(lm), 128


def _hf_eager():
    return _hf("eager")


def kept_shapes(model, vocab: int, precision: str, tmp_path, around=contextlib.nullcontext) -> list[tuple]:
    """The shapes of the tensors one engine forward saves for its backward; the forward and backward run
    inside around()."""
    ids = torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(0))
    shapes = []
    with offload.initialize(model, {"precision": precision, "units": {"min_numel": 512},
                                    "nvme_path": str(tmp_path)}) as eng, around():
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            loss = eng(ids, ids)
        eng.backward(loss)
    return shapes


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("build", [_preset, _hf])
def test_presets_and_hf_models_keep_nothing_of_the_sequence_squared(tmp_path, build, precision):
    """Their attention runs torch's flash kernel for the CPU, forward and backward, and the forward keeps no
    tensor with T x T in it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = set()

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    model, vocab = build()
    shapes = kept_shapes(model, vocab, precision, tmp_path, around=Ops)
    assert {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"} <= ops
    assert shapes and not [s for s in shapes if s[-2:] == (T, T)]


def test_eager_attention_keeps_the_sequence_squared(tmp_path):
    """The check above sees the scores where a model keeps them."""
    model, vocab = _hf_eager()
    assert [s for s in kept_shapes(model, vocab, "fp32", tmp_path) if s[-2:] == (T, T)]


@pytest.mark.parametrize("build,line", [
    (_preset, "attention: sdpa, torch's flash kernel for the CPU (no T x T scores kept)"),
    (_hf, "attention: sdpa, torch's flash kernel for the CPU (no T x T scores kept)"),
    (_hf_eager, "attention: eager (keeps each layer's batch x heads x T x T attention weights for its backward; "
                'attn_implementation="sdpa" keeps none of them)'),
    (lambda: (MLP(), 0), None),
])
def test_the_memory_plan_says_which_attention_runs(tmp_path, capsys, build, line):
    model, _ = build()
    offload.initialize(model, {"units": {"min_numel": 512}, "nvme_path": str(tmp_path)}).close()
    err = capsys.readouterr().err
    if line is None:
        assert "attention:" not in err  # a model that names no attention
    else:
        assert f"\n  {line}\n" in err + "\n"


def test_the_kernel_is_asked_without_drawing_from_the_rng():
    """SDPA's choice on the CPU with dropout: its math path (the plan says so), and the global RNG as before."""
    from offload.plan.attention import sdpa_kernel

    cpu = torch.device("cpu")
    before = torch.get_rng_state()
    assert sdpa_kernel(cpu, torch.float32, 16, 0.1) is None
    assert torch.equal(torch.get_rng_state(), before)
    assert sdpa_kernel(cpu, torch.bfloat16, 16, 0.0) == "torch's flash kernel for the CPU"
