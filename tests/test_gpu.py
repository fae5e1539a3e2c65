"""The CUDA backend: pinned buffers, copy streams with events, hbm on the GPU. Run with a GPU
(bench/gpu_check.py runs these and prints a table); skipped on CPU-only machines."""

import pytest
import torch

import offload
from scheduler.streams import CopyStream
from swap import aligned_empty
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
