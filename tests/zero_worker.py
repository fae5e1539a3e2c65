"""One rank of tests/test_zero.py: trains the MLP on its slice of each global batch and writes what it
saw as JSON (and, rank 0, the final fp32 weights). Run by the test with RANK / WORLD_SIZE / MASTER_* set."""

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import offload  # noqa: E402
from tests.engine_util import MLP, mlp_batches  # noqa: E402


def main() -> None:
    cfg, out, steps, gas = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg["nvme_path"] = os.path.join(cfg["nvme_path"], f"rank{rank}")
    torch.manual_seed(0)
    losses = []
    try:
        with offload.initialize(MLP(), cfg) as eng:
            for x, y in mlp_batches(steps * gas):
                n = x.shape[0] // world
                loss = eng(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
                eng.backward(loss)
                eng.step()
                losses.append(loss.item())
            stats = eng.stats()
            if rank == 0:
                torch.save(eng.full_state_dict(), out + ".pt")
        with open(f"{out}.rank{rank}.json", "w") as f:
            json.dump({"losses": losses, "collectives": stats["collectives"],
                       "params": sum(p.numel() for p in MLP().parameters())}, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
