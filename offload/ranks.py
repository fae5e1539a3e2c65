"""Scalars the ranks of the default process group must agree on (a norm, a decision, a setting each rank
derived from its own budgets): one small all-reduce, in fp64 (integers below 2**53 stay exact)."""

from __future__ import annotations

import torch


def reduced(values: list[float], op: str = "sum") -> list[float]:
    """`values` reduced elementwise over the ranks: "sum", "min" or "max"."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op])
    return t.tolist()
