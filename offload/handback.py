"""engine.close(keep_weights=True): the trained weights back in the model's own parameters, so that it runs in
plain PyTorch once the engine is gone (docs/python.md "After close()"). Each unit's weights are read whole,
in the compute dtype the engine's forward reads (a quantized weight as bitsandbytes stores it), after
flush(), before anything is freed; the parameters then point at them. Over ranks every rank calls it and
every rank gets the whole model (partitioned weights are gathered)."""

from __future__ import annotations

import torch

from offload.checkpoint.values import unit_weights
from offload.plan.placement import PlacementError
from offload.swap import hostmem


def take(engine) -> list[torch.Tensor]:
    """Each unit's weights, flat (offload.checkpoint.values.unit_weights). Refuses, with nothing freed or
    changed, an engine that failed, or weights that do not fit the RAM available (agreed over ranks)."""
    check_room([engine])
    engine.flush()  # every accepted update in the homes
    engine.prefetcher.release_all()
    return [unit_weights(engine.rt, w) for w in engine.weights]


def check_room(engines: list) -> None:
    """Refuses (PlacementError, nothing freed) engines that cannot close(keep_weights=True): one that failed,
    or weights that together do not fit the RAM available, on this rank or another (agreed over ranks)."""
    for engine in engines:
        engine.pipeline.check_usable("close(keep_weights=True)")
    need = sum(w.nbytes for engine in engines for w in engine.weights if not _in_place(w))
    free = hostmem.available()
    fits = engines[0].rt.ranks.agree([float(need <= free)], "min", "close(keep_weights=True): the RAM check")[0]
    if not fits:
        where = "here" if need > free else "on another rank"
        raise PlacementError(f"close(keep_weights=True): the weights need {need / 2**30:.2f} GiB of RAM and "
                             f"{free / 2**30:.2f} GiB is available {where}; nothing was freed: read them a unit at "
                             "a time with engine.state_items() (full_state_dict() holds them whole) or save them "
                             "(engine.save_checkpoint(), offload train --save), then close()")


def give(engine, flats: list[torch.Tensor]) -> None:
    """After the engine closed: the parameters (quantized ones: their records' tensors) point at their places
    in `flats`; on a CUDA engine the buffers come to the CPU too (the model is whole in host memory)."""
    for unit, flat in zip(engine.units, flats):
        for slot in unit.slots:
            slot.attach(flat)
    if engine.device.type != "cpu":
        for module in engine.module.modules():
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = b.cpu()


def _in_place(w) -> bool:
    """The parameters keep this unit's buffer as it is: an hbm home on the CPU (no copy, no new RAM)."""
    return w.home == "hbm" and not w.partitioned and w.hbm.device.type == "cpu"
