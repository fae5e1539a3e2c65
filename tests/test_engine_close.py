"""close() after errors: whatever forward, backward or step raised (a user error, a custom backward, a flipped
byte in a swap file caught as SwapCorruptionError), close() succeeds, stops every thread the engine started,
returns every fd and budget byte, and removes the run's swap files; the engine then refuses to train."""

import faulthandler
import os
import threading

import pytest
import torch

import offload
from offload.swap import SwapCorruptionError
from tests.engine_util import MLP, mlp_batches

PLACEMENTS = {"cpu": ("cpu", "cpu"), "nvme": ("nvme", "nvme")}
FAILURES = ["forward", "backward", "corrupt weights", "corrupt optimizer state"]


@pytest.fixture(autouse=True)
def no_hang():
    faulthandler.dump_traceback_later(300, exit=True)  # a close() that hangs fails with stacks, not a stuck CI
    yield
    faulthandler.cancel_dump_traceback_later()


def cfg(tmp_path, placement, **extra):
    param, optim = PLACEMENTS[placement]
    return {"precision": "bf16", "offload_param": {"device": param}, "offload_optimizer": {"device": optim},
            "nvme_path": str(tmp_path / "swap"), "units": {"min_numel": 512}, "aio": {"block_bytes": 8192}, **extra}


def swap_files(tmp_path):
    return [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "swap") for f in fs]


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


class Boom(torch.autograd.Function):
    """Identity whose backward raises while `armed`: an error from inside autograd."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if Boom.armed:
            raise RuntimeError("injected backward failure")
        return grad


def flip_a_byte(eng, key):
    entry = eng.store._index[key]
    with open(eng.store.fd_path, "r+b") as f:
        f.seek(entry.offset + 100)
        b = f.read(1)
        f.seek(entry.offset + 100)
        f.write(bytes([b[0] ^ 0x10]))


def fail_once(eng, model, failure):
    """Arms `failure`, runs one step, and returns what it raised."""
    unit = next(u for u in eng.units if u.name == "blocks.1")
    if failure == "forward":
        def pre_hook(module, args):
            raise ValueError("injected forward failure")
        model.blocks[1].register_forward_pre_hook(pre_hook)  # after the engine's fetch hook: the unit is in hbm
    elif failure == "backward":
        model.blocks[1].register_forward_hook(lambda module, args, out: Boom.apply(out))
        Boom.armed = True
    elif failure == "corrupt weights":
        flip_a_byte(eng, eng.weights[unit.index].key + "#0")
    else:
        flip_a_byte(eng, eng.states[unit.index].key("exp_avg_sq", 0))
    x, y = mlp_batches(2)[1]
    try:
        with pytest.raises(Exception) as e:
            eng.backward(eng(x, y))
            eng.step()
    finally:
        Boom.armed = False
    return e.value


@pytest.mark.parametrize("clip", [0.0, 1.0])  # the step overlapped with backward (on the d2h thread), or after it
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("failure", FAILURES)
def test_close_after_an_error_leaves_nothing_behind(tmp_path, placement, failure, clip):
    if placement == "cpu" and failure.startswith("corrupt"):
        pytest.skip("no swap files to corrupt")
    with offload.initialize(MLP(), cfg(tmp_path / "warm", placement)) as warm:  # kernels, lazy imports, caches
        warm.backward(warm(*mlp_batches(1)[0]))
        warm.step()
    threads, fds = set(threading.enumerate()), open_fds()

    model = MLP()
    eng = offload.initialize(model, cfg(tmp_path, placement, gradient_clipping=clip))
    eng.backward(eng(*mlp_batches(1)[0]))
    eng.step()
    assert set(threading.enumerate()) - threads  # the engine runs threads of its own
    assert bool(swap_files(tmp_path)) == (placement == "nvme")  # the run directory (owner.json)
    assert (eng.store is not None and eng.store.disk_bytes > 0) == (placement == "nvme")  # its unlinked data file
    err = fail_once(eng, model, failure)
    expected = {"forward": ValueError, "backward": RuntimeError}.get(failure, SwapCorruptionError)
    assert isinstance(err, expected), repr(err)

    eng.close()  # does not raise the stored error again
    assert swap_files(tmp_path) == []
    assert set(threading.enumerate()) - threads == set()
    assert open_fds() == fds
    assert {t: a.used_bytes for t, a in eng.tiers.acct.items()} == {"hbm": 0, "dram": 0, "nvme": 0}
    eng.close()  # idempotent


def test_the_engine_refuses_to_train_after_close(tmp_path):
    eng = offload.initialize(MLP(), cfg(tmp_path, "nvme"))
    x, y = mlp_batches(1)[0]
    loss = eng(x, y)
    eng.close()
    for call in (lambda: eng(x, y), lambda: eng.backward(loss), eng.step, eng.flush, eng.full_state_dict):
        with pytest.raises(RuntimeError, match=r"engine is closed: .* create a new one with offload.initialize"):
            call()
    assert eng.stats()["tiers"]["nvme"]["used_bytes"] == 0  # stats still answer


def test_a_part_failing_to_close_does_not_stop_the_rest(tmp_path, monkeypatch, caplog):
    eng = offload.initialize(MLP(), cfg(tmp_path, "nvme"))
    eng.backward(eng(*mlp_batches(1)[0]))
    eng.step()

    def broken():
        raise OSError("injected close failure")

    monkeypatch.setattr(eng.weights[1], "close", broken)
    eng.close()
    assert swap_files(tmp_path) == [] and eng.staging._pool is None
    assert any("injected close failure" in r.message for r in caplog.records)
