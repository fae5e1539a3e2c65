"""A window's fp32 master read from and written to its home, whatever optimizer.master keeps there: the fp32
master itself, or a split master's record, joined with the window's working weights when read ([Note: split
master] in offload/kernels/split.py). Initialization, checkpoints and state dicts go through these; the step
joins and splits in its own pipeline (offload.step.windows)."""

from __future__ import annotations

import torch

from offload.kernels import split
from offload.plan.chunks import chunk_key
from offload.state.optim import OptimState
from offload.state.residency import WeightHandle
from offload.state.runtime import Runtime


def write_master(rt: Runtime, st: OptimState, i: int, master: torch.Tensor, pool=None) -> None:
    """Window i's fp32 `master` into its home (a split one as its record; its working weights are the caller's
    to write: they are the master rounded to nearest even). pool: the chunk pool a record passes through."""
    home = st.t["master"][st.kspans["master"][i]] if st.home != "nvme" else None
    if not st.split:
        if home is None:
            rt.store.write(st.key("master", i), master).wait()
        else:
            home.copy_(master)
        return
    if home is not None and home.device.type == "cpu":
        split.split_(master, home)
        return
    pool = pool or rt.staging
    record = pool.acquire(split.record_bytes(master.numel()), torch.uint8, f"{st.unit.name} master record")
    try:
        split.split_(master, record)
        if home is None:
            rt.store.write(st.key("master", i), record).wait()
        else:
            home.copy_(record)
    finally:
        pool.release(record)


def read_master(rt: Runtime, w: WeightHandle, st: OptimState, i: int, out: torch.Tensor, pool=None,
                hold=None) -> torch.Tensor:
    """Window i's fp32 master into `out` (returned); a split one joined with the window's weights, read from
    their home (`w`, the unit's weight handle; over ranks the window's owner holds both). pool: the chunk pool
    nvme chunks pass through (two at once for a split master on nvme). hold: nvme chunks read as a swap hold
    keeps them (SwapStore.hold: the record's and, on nvme, the weights')."""
    home = st.t["master"][st.kspans["master"][i]] if st.home != "nvme" else None
    src = hold if hold is not None else rt.store
    if not st.split:
        if home is None:
            src.read(st.key("master", i), into=out).wait()
        else:
            out.copy_(home)
        return out
    pool = pool or rt.staging
    b, e = st.chunks[i]
    taken = []
    try:
        if home is None:
            record = pool.acquire(split.record_bytes(e - b), torch.uint8, f"{st.unit.name} master record")
            taken.append(record)
            src.read(st.key("master", i), into=record).wait()
        else:
            record = home.cpu()
        if w.home == "nvme":
            if hold is None:
                w.writer.wait_for_write()  # new weights written behind by the last step (a hold settled them)
            cb, ce = w.chunks[i]
            chunk = pool.acquire(ce - cb, w.dtype, f"{w.unit.name} weights")
            taken.append(chunk)
            src.read(chunk_key(w.key, i), into=chunk).wait()
            weights = chunk[b - cb:e - cb]
        else:
            weights = (w.dram[w.span(i, b, e)] if w.home == "dram" else w.hbm[b:e]).cpu()
        return split.join(weights, record, out)
    finally:
        for t in taken:
            pool.release(t)
