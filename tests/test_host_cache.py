"""torch's CPU allocator while an engine runs on the CPU backend (offload/kernels/csrc/host_alloc.cpp): large blocks
freed are kept for the next request of their size, the bytes mapped never exceed the most that was live at
once by more than an eighth (at least 16 MiB), and closing the last engine unmaps what was kept. Each case
runs in a fresh process: the allocator, once installed, stays torch's CPU allocator for the process."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.compiled_kernel,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mmap/munmap and /proc")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PRELUDE = """
import gc, json, resource, sys
import psutil, torch
from offload.kernels import cpu_adam
MB = 1 << 20
def stats():
    return cpu_adam.host_cache_stats()
def rss():
    return psutil.Process().memory_info().rss
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def out(**kw):
    print(json.dumps(kw), flush=True)
"""


def _run(body: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _PRELUDE + body], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_freed_block_serves_the_next_request_of_its_size_without_faulting_again():
    r = _run("""
assert cpu_adam.open_host_cache()
def step():  # an activation-like pattern: 40 tensors of 3 sizes held, then freed; touched as a kernel would
    held = [torch.empty(s * MB // 4).fill_(1.0) for s in (3, 5, 11) * 13 + (2,)]
    return sum(t.numel() for t in held)
step()
first = stats()
f0 = faults()
for _ in range(5):
    step()
out(first=first, after=stats(), faults=faults() - f0)
""")
    first, after = r["first"], r["after"]
    assert first["mapped_fresh_bytes"] == after["mapped_fresh_bytes"]  # nothing mapped after the first pass
    assert after["reused_bytes"] - first["reused_bytes"] == 5 * first["mapped_fresh_bytes"]
    assert after["live_bytes"] == 0 and after["kept_bytes"] == first["mapped_fresh_bytes"]
    assert r["faults"] < 2000  # mapping afresh: 5 x 240 MB = 300,000 page faults


def test_what_is_mapped_never_exceeds_the_most_that_was_live_at_once_by_more_than_the_slack():
    """Sizes that change from step to step (the kept blocks of the old size are unmapped, oldest first, as
    new ones are mapped) and a small heap allocation between large ones (as glibc's heap would strand)."""
    r = _run("""
assert cpu_adam.open_host_cache()
base, worst, pins = rss(), 0, []
for i in range(30):
    held = [torch.empty((4 + i % 7) * MB // 4).fill_(1.0) for _ in range(25)]
    pins.append(torch.empty(25000).fill_(1.0))
    s = stats()
    slack = max(s["peak_live_bytes"] // 8, 16 * MB)
    worst = max(worst, s["live_bytes"] + s["kept_bytes"] - s["peak_live_bytes"] - slack)
    del held
out(worst=worst, stats=stats(), grew=rss() - base)
""")
    s = r["stats"]
    assert r["worst"] <= 0
    assert s["peak_live_bytes"] == 25 * 10 * (1 << 20)  # the largest step: 25 tensors of 10 MiB
    assert s["kept_bytes"] <= s["peak_live_bytes"] * 9 // 8
    assert r["grew"] < s["peak_live_bytes"] * 9 // 8 + (40 << 20)  # about what was live at once, not 30 steps' worth


def test_after_the_last_engine_closes_large_blocks_come_from_the_replaced_allocator():
    """With no engine open, a large tensor is not mapped afresh by the cache (each one's pages faulted in anew:
    torch work after close() ran 2.2x slower, bench/RESULTS.md) but served as before the first engine."""
    r = _run("""
assert cpu_adam.open_host_cache()
t = torch.empty(64 * MB // 4).fill_(1.0)
del t
cpu_adam.close_host_cache()
closed = stats()
u = torch.empty(64 * MB // 4).fill_(1.0)
out(closed=closed, with_u=stats())
""")
    assert r["closed"]["engines"] == 0 and r["closed"]["mapped_fresh_bytes"] == 64 << 20
    assert r["with_u"]["mapped_fresh_bytes"] == 64 << 20 and r["with_u"]["live_bytes"] == 0


def test_the_heap_threshold_is_given_back_when_the_last_holder_releases(monkeypatch):
    """map_large_allocations() is counted; the last release_large_allocations() sets glibc's mmap threshold to
    32 MiB and its trim threshold to 64 MiB (where its own adjustment takes them), and only the last."""
    from offload.swap import buffers

    calls = []

    class Libc:
        def mallopt(self, param, value):
            calls.append((param.value, value.value))
            return 1

    monkeypatch.setattr(buffers, "_libc", Libc())
    monkeypatch.setitem(buffers._large, "holders", 0)
    assert buffers.map_large_allocations() and buffers.map_large_allocations()
    assert calls == [(-3, 1 << 20)] * 2
    buffers.release_large_allocations()
    assert len(calls) == 2  # one holder left
    buffers.release_large_allocations()
    assert calls[2:] == [(-3, 32 << 20), (-1, 64 << 20)]


def test_closing_the_last_engine_unmaps_what_was_kept_and_frees_unmap_at_once():
    r = _run("""
assert cpu_adam.open_host_cache() and cpu_adam.open_host_cache()  # two engines
t = torch.empty(64 * MB // 4).fill_(1.0)
del t
base = rss()
cpu_adam.close_host_cache()
one_open = stats()["kept_bytes"]
cpu_adam.close_host_cache()
closed = stats()
dropped = base - rss()
u = torch.empty(64 * MB // 4).fill_(1.0)
before = rss()
del u
out(one_open=one_open, closed=closed, dropped=dropped, freed_after_close=before - rss())
""")
    assert r["one_open"] == 64 << 20  # one engine still open: kept
    assert r["closed"]["kept_bytes"] == 0 and r["closed"]["engines"] == 0
    assert r["dropped"] > 60 << 20 and r["freed_after_close"] > 60 << 20


def test_small_blocks_and_raw_allocations_stay_with_torchs_own_allocator():
    r = _run("""
import numpy as np
assert cpu_adam.open_host_cache()
small = torch.arange(1000, dtype=torch.float32)
big = torch.arange(1 << 20, dtype=torch.float32)
s = stats()
ok = bool((big.numpy()[:1000] == small.numpy()).all()) and float(big.sum()) == float(np.arange(1 << 20).sum())
del small, big
storage = torch.UntypedStorage(8 * MB)  # through the allocator too
storage.resize_(16 * MB)  # copy_data
del storage
out(live_with_big=s["live_bytes"], ok=ok, after=stats())
""")
    assert r["ok"] and r["live_with_big"] == 4 << 20 and r["after"]["live_bytes"] == 0


def test_a_forked_child_allocates_while_another_thread_of_the_parent_does():
    """The lock is taken across fork (pthread_atfork): a child forked while another thread allocates
    (a DataLoader worker forked beside the engine's I/O threads) does not find it held forever."""
    r = _run("""
import os, threading
assert cpu_adam.open_host_cache()
stop = threading.Event()
def churn():
    while not stop.is_set():
        torch.empty(2 * MB // 4)
t = threading.Thread(target=churn)
t.start()
codes = []
for _ in range(20):
    pid = os.fork()
    if pid == 0:
        x = torch.empty(3 * MB // 4).fill_(2.0)
        os._exit(0 if float(x[0]) == 2.0 else 1)
    _, status = os.waitpid(pid, 0)
    codes.append(status)
stop.set()
t.join()
out(codes=codes)
""")
    assert r["codes"] == [0] * 20


def test_a_cpu_engine_opens_it_and_its_steps_map_nothing_afresh(tmp_path):
    """The engine's activations come back from what the last step freed: after the first steps (the
    trace, the pool), a step maps (and faults in) no new large block; closing the engine ends it."""
    r = _run(f"""
import offload
from offload.models import build_model, loss_of
from offload.data import BatchSampler, load_tokens
model = build_model("tiny", device="cpu")
cfg = {{"precision": "fp32", "offload_param": {{"device": "nvme"}}, "nvme_path": {str(tmp_path)!r}}}
sampler = BatchSampler(load_tokens(), 8, 128, seed=0)
fresh = []
with offload.initialize(model, cfg) as engine:
    opened = stats()["engines"]
    for i in range(5):
        ids, labels = sampler.batch(i)
        before = stats()["mapped_fresh_bytes"]
        engine.backward(loss_of(engine(ids, labels=labels)))
        engine.step()
        fresh.append(stats()["mapped_fresh_bytes"] - before)
out(opened=opened, fresh=fresh, closed=stats())
""")
    assert r["opened"] == 1
    assert r["fresh"][0] > 0 and r["fresh"][-2:] == [0, 0], r["fresh"]
    assert r["closed"]["engines"] == 0 and r["closed"]["kept_bytes"] == 0


def test_initialization_leaves_nothing_kept_and_sets_no_peak(tmp_path):
    """A meta-built model's units pass through fp32 values as large as a unit while the engine materializes
    them: the cache opens after that, so none of it stays mapped for training (a 70B layer's 3.4 GB did)."""
    r = _run(f"""
import offload
from offload.models import ModelConfig, build_model
mc = ModelConfig(d_model=512, n_layers=2, n_heads=8, n_kv_heads=8, d_ff=2048)
model = build_model(mc, device="meta")
cfg = {{"precision": "fp32", "offload_param": {{"device": "nvme"}}, "offload_optimizer": {{"device": "nvme"}},
       "nvme_path": {str(tmp_path)!r}}}
with offload.initialize(model, cfg) as engine:
    out(after_init=stats(), unit_bytes=max(u.numel for u in engine.units) * 4)
""")
    st = r["after_init"]
    assert st["engines"] == 1 and r["unit_bytes"] > 16 * (1 << 20)
    assert st["kept_bytes"] == 0 and st["peak_live_bytes"] < r["unit_bytes"], r
