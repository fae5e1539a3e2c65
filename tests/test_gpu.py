"""The CUDA backend: pinned buffers, copy streams with events, hbm on the GPU. Run with a GPU
(bench/gpu_check.py runs these and prints a table); skipped on CPU-only machines."""

import pytest
import torch

import offload
from offload.scheduler.streams import CopyStream
from offload.swap import aligned_empty
from tests.engine_util import MLP, Reference, max_state_err, mlp_batches

pytestmark = pytest.mark.gpu


def test_pinned_aligned_buffers():
    t = aligned_empty(1 << 20, torch.bfloat16, pin=True)
    assert t.is_pinned() and t.data_ptr() % 4096 == 0


def test_copy_stream_orders_with_compute():
    s = CopyStream("h2d", torch.device("cuda"))
    src = aligned_empty(1 << 22, torch.float32, pin=True).fill_(3.0)
    dst = torch.empty(1 << 22, device="cuda")
    s.copy(dst, src).wait_on_compute()
    assert float(dst.sum()) == 3.0 * (1 << 22)


@pytest.mark.parametrize("param,optim", [("none", "none"), ("none", "cpu"), ("cpu", "cpu"), ("nvme", "nvme")])
def test_cuda_parity_with_reference(tmp_path, param, optim):
    torch.manual_seed(0)
    model = MLP()
    ref = Reference(model, "fp32", lr=1e-2, kernel=False)
    cfg = {"precision": "fp32", "offload_param": {"device": param}, "offload_optimizer": {"device": optim},
           "nvme_path": str(tmp_path), "units": {"min_numel": 512}, "optimizer": {"lr": 1e-2}}
    with offload.initialize(model.cuda(), cfg) as eng:
        assert eng.device.type == "cuda"
        for x, y in mlp_batches(5):
            loss = eng(x.cuda(), y.cuda())
            eng.backward(loss)
            eng.step()
            ref_loss = ref.micro_step(x, y)
            ref.step()
            assert loss.item() == pytest.approx(ref_loss, rel=1e-3)  # cuBLAS vs CPU matmuls
        assert max_state_err(eng.full_state_dict(), ref.state()) < 1e-3
        st = eng.stats()
        assert st["tiers"]["hbm"]["peak_bytes"] > 0
        if param != "none":
            assert st["links"]["dram_to_hbm"]["bytes"] > 0


@pytest.mark.parametrize("precision,ckpt,extra", [
    ("bf16", False, {}), ("bf16", True, {}), ("bf16", False, {"overlap_step": False}),
    ("bf16", False, {"delayed_update": True}), ("fp16", False, {"loss_scale": {"initial": 1024.0}}),
    ("fp16", True, {"delayed_update": True, "gradient_clipping": 1.0})])
def test_cuda_offload_modes_train_like_hbm_resident_weights(tmp_path, precision, ckpt, extra):
    """The tiny preset (tied embedding) on CUDA: weights in dram or on nvme train to the numbers of
    weights kept in hbm, with the same CPU Adam (cuBLAS backward may add in another order: 1e-3)."""
    import dataclasses

    from offload.data import BatchSampler, load_tokens
    from offload.models import PRESETS, build_model, loss_of

    mc = dataclasses.replace(PRESETS["tiny"], checkpoint_activations=ckpt)
    assert mc.tie_embeddings
    sampler = BatchSampler(load_tokens(), 2, 64, seed=0)
    runs = {}
    for param, optim in [("none", "cpu"), ("cpu", "cpu"), ("nvme", "nvme")]:
        cfg = {"precision": precision, "offload_param": {"device": param}, "offload_optimizer": {"device": optim},
               "nvme_path": str(tmp_path / param), "optimizer": {"lr": 1e-3}, **extra}
        losses = []
        with offload.initialize(build_model(mc, seed=0), cfg) as eng:
            assert eng.device.type == "cuda"
            for i in range(4):
                ids, labels = (t.cuda() for t in sampler.batch(i))
                loss = loss_of(eng(ids, labels))
                eng.backward(loss)
                eng.step()
                losses.append(loss.item())
        runs[param] = losses
    for param in ("cpu", "nvme"):
        assert runs[param] == pytest.approx(runs["none"], rel=1e-3), runs
