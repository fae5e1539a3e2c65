"""The checkpoint tests' config and their train-then-save, imported by the tests and by the child processes
they start (tests/test_checkpoint.py)."""

import copy

import offload


def config(tmp_path, mode: str, **extra) -> dict:
    return {"precision": "bf16", "offload_param": {"device": mode}, "offload_optimizer": {"device": mode},
            "nvme_path": str(tmp_path / "swap"), "units": {"min_numel": 512}, "reuse_bytes": 0,
            "optimizer": {"lr": 1e-2, "weight_decay": 0.01}, **extra}


def train(model, cfg, batches, save_to, load=None):
    """A new engine on a copy of `model` (loading `load` first) trains on the micro-batches, then saves.
    Returns (losses, checkpoint path)."""
    with offload.initialize(copy.deepcopy(model), cfg) as eng:
        if load is not None:
            eng.load_checkpoint(load)
        losses = []
        for x, y in batches:
            loss = eng(x, y)
            eng.backward(loss)
            eng.step()  # a no-op between accumulation boundaries
            losses.append(loss.item())
        return losses, eng.save_checkpoint(str(save_to))
