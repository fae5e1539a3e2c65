"""Tiers and their accountants: every byte the runtime holds in hbm or dram is charged to one of them.

An accountant knows a budget, the bytes in use and the peak, and refuses an allocation that would go
over the budget with a message naming tier, requested, used and budget. The nvme tier is a directory;
its accountant counts the bytes the swap files hold (budget: the free disk at start).
"""

from __future__ import annotations

import threading

import torch

from swap import aligned_empty

TIERS = ("hbm", "dram", "nvme")


class TierBudgetError(MemoryError):
    """An allocation would exceed a tier's budget."""

    def __init__(self, tier: str, requested_bytes: int, used_bytes: int, budget_bytes: int, what: str):
        self.tier, self.requested_bytes = tier, requested_bytes
        self.used_bytes, self.budget_bytes = used_bytes, budget_bytes
        super().__init__(
            f"{tier}: cannot allocate {_fmt(requested_bytes)} for {what}: {_fmt(used_bytes)} used of a "
            f"{_fmt(budget_bytes)} budget; raise budgets.{tier}_bytes, offload more (offload_param / "
            f"offload_optimizer), or use smaller units (units.min_numel)"
        )


def _fmt(n: int) -> str:
    return f"{n / 2**20:.1f} MiB ({n} bytes)"


class Accountant:
    """Bytes charged to one tier, with a budget and a peak. Thread-safe (the copy worker allocates too)."""

    def __init__(self, tier: str, budget_bytes: int):
        self.tier, self.budget_bytes = tier, int(budget_bytes)
        self.used_bytes = self.peak_bytes = 0
        self._lock = threading.Lock()

    def charge(self, nbytes: int, what: str) -> None:
        with self._lock:
            if self.used_bytes + nbytes > self.budget_bytes:
                raise TierBudgetError(self.tier, nbytes, self.used_bytes, self.budget_bytes, what)
            self.used_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def refund(self, nbytes: int) -> None:
        with self._lock:
            assert nbytes <= self.used_bytes, f"{self.tier}: refund of {nbytes} > used {self.used_bytes}"
            self.used_bytes -= nbytes

    def fits(self, nbytes: int) -> bool:
        return self.used_bytes + nbytes <= self.budget_bytes

    def stats(self) -> dict:
        return {"used_bytes": self.used_bytes, "peak_bytes": self.peak_bytes, "budget_bytes": self.budget_bytes}


class Tiers:
    """The three accountants plus allocation helpers for hbm and dram tensors."""

    def __init__(self, hbm_device: torch.device, hbm_budget: int, dram_budget: int, nvme_budget: int, pin: bool):
        self.hbm_device, self.pin = hbm_device, pin
        self.acct = {"hbm": Accountant("hbm", hbm_budget), "dram": Accountant("dram", dram_budget),
                     "nvme": Accountant("nvme", nvme_budget)}

    def empty(self, tier: str, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """A 1-D tensor in `tier`, charged to its accountant (refund with `free`)."""
        nbytes = numel * dtype.itemsize
        self.acct[tier].charge(nbytes, what)
        try:
            if tier == "hbm":  # the default allocator: hbm storages are resized to 0 on release
                return torch.empty(numel, dtype=dtype, device=self.hbm_device)
            return aligned_empty(numel, dtype, pin=self.pin and tier == "dram")
        except BaseException:
            self.acct[tier].refund(nbytes)
            raise

    def free(self, tier: str, tensor: torch.Tensor) -> None:
        self.acct[tier].refund(tensor.numel() * tensor.element_size())

    def stats(self) -> dict:
        return {name: a.stats() for name, a in self.acct.items()}
