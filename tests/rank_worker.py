"""One rank of tests/test_rank_agreement.py: a tied HF Llama at zero_stage 3 (weights and states on nvme),
with a fault made on purpose on one rank. Run with RANK / WORLD_SIZE / MASTER_* set; writes
<out>.rank<r>.json (losses) when it finishes.

argv: out, steps, fault, fault_step. Faults (rank 0 unless said):
  none      nothing
  refs      at fault_step, the embedding lookup's reference count moves during its forward, as when
            another thread drops a reference at that moment: this rank alone would fetch (gather) the
            table again for the lookup's backward
  stall     rank 1 stops entering collectives at fault_step (it sleeps past the collective timeout)
"""

import itertools
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import offload  # noqa: E402
from tests.engine_util import LlamaLoss, llama, llama_batches  # noqa: E402

TIMEOUT_S = float(os.environ.get("RANK_WORKER_TIMEOUT_S", "20"))


def main() -> None:
    out, steps, fault, fault_step = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = {"precision": "fp32", "zero_stage": 3, "offload_param": {"device": "nvme"},
           "offload_optimizer": {"device": "nvme"}, "nvme_path": os.path.join(out + ".swap", f"rank{rank}"),
           "chunk_bytes": 1 << 16, "units": {"min_numel": 512}, "collective_timeout_s": TIMEOUT_S}
    losses = []
    try:
        with offload.initialize(LlamaLoss(llama(tied=True)), cfg) as eng:
            lookup = next(w for w in eng.weights if isinstance(w.unit.module, torch.nn.Module)
                          and any(isinstance(m, torch.nn.Embedding) for m in w.unit.module.modules()))
            for i, (ids, labels) in enumerate(llama_batches(steps * world)):
                if i % world != rank:
                    continue  # each rank its own batches
                step = len(losses) + 1
                restore = _fault(eng, lookup, fault, step == fault_step, rank)
                loss = eng(ids, labels)
                restore()
                eng.backward(loss)
                eng.step()
                losses.append(loss.item())
        with open(f"{out}.rank{rank}.json", "w") as f:
            json.dump({"losses": losses}, f)
    finally:
        dist.destroy_process_group()


def _fault(eng, lookup, fault: str, now: bool, rank: int):
    """Makes the fault for this step; returns what undoes it after the forward."""
    if not now:
        return lambda: None
    if fault == "refs" and rank == 0:
        real, calls = lookup.refs, itertools.count()
        lookup.refs = lambda: real() + next(calls)  # before the forward: n; after it: n + 1

        def restore():
            del lookup.refs
        return restore
    if fault == "stall" and rank == 1:
        time.sleep(TIMEOUT_S + 10)
    return lambda: None


if __name__ == "__main__":
    main()
