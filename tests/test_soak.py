"""A 500-step soak (issue #13): after warm-up, training holds its resources flat: resident memory,
open file descriptors, threads and the swap files' bytes. A leak of one chunk, ticket, fd or thread
per step shows here long before it shows in a user's week-long run."""

import os
import threading

import psutil
import pytest

import offload
from offload.data import BatchSampler, load_tokens
from offload.models import build_model, loss_of

STEPS, WARMUP, EVERY = int(os.environ.get("SOAK_STEPS", 500)), 50, 50
RSS_SLACK = 48 << 20  # allocator and interpreter noise; a leak of one 32 KiB chunk per step is 14 MiB over 450


@pytest.mark.slow
def test_500_steps_nvme_nvme_hold_rss_fds_threads_and_swap_bytes_flat(tmp_path):
    cfg = {"precision": "bf16", "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"},
           "nvme_path": str(tmp_path), "optimizer": {"lr": 3e-3}}
    sampler = BatchSampler(load_tokens(), 2, 64, seed=0)
    proc, samples, losses = psutil.Process(), [], []
    with offload.initialize(build_model("small", seed=0), cfg) as eng:
        for step in range(STEPS):
            loss = loss_of(eng(*sampler.batch(step)))
            eng.backward(loss)
            eng.step()
            losses.append(loss.item())
            if (step + 1) % EVERY == 0:
                samples.append({"step": step + 1, "rss": proc.memory_info().rss, "fds": len(os.listdir("/proc/self/fd")),
                                "threads": sorted(t.name.rsplit("_", 1)[0] for t in threading.enumerate()), "swap": eng.store.disk_bytes,
                                "lent": eng.staging.lent, "hbm": eng.tiers.acct["hbm"].used_bytes})
    warm = samples[0]
    print("\n".join(str(s) for s in samples))  # the figures for the note (pytest -s)
    # Thread pools start their workers lazily, up to their size: those may still grow after warm-up.
    pools = {"swap-digest": 2, "swap-io": eng.cfg.aio.threads}
    for s in samples[1:]:
        assert s["rss"] - warm["rss"] <= RSS_SLACK, (s, warm)
        assert (s["fds"], s["swap"], s["lent"], s["hbm"]) == (warm["fds"], warm["swap"], warm["lent"], warm["hbm"]), (s, warm)
        assert set(s["threads"]) == set(warm["threads"]), (s, warm)
        for name in set(s["threads"]):
            assert s["threads"].count(name) <= pools.get(name, warm["threads"].count(name)), (name, s, warm)
    assert sum(losses[-EVERY:]) < sum(losses[:EVERY])
