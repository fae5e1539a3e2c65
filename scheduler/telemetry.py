"""Telemetry: bytes and seconds per link, stall seconds (compute waiting on a transfer), and spans."""

from __future__ import annotations

import threading
import time

LINKS = ("nvme_to_dram", "dram_to_hbm", "hbm_to_dram", "dram_to_nvme")


class Telemetry:
    """Counters for one engine. Link seconds run from a transfer's submission to its observed completion."""

    def __init__(self):
        self._lock = threading.Lock()
        self.links = {name: {"bytes": 0, "seconds": 0.0} for name in LINKS}
        self.stall_seconds = 0.0

    def link(self, name: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.links[name]["bytes"] += int(nbytes)
            self.links[name]["seconds"] += seconds

    def stall(self, seconds: float) -> None:
        with self._lock:
            self.stall_seconds += seconds

    def snapshot(self) -> dict:
        with self._lock:
            return {"links": {k: dict(v) for k, v in self.links.items()}, "stall_seconds": self.stall_seconds}


class Timer:
    """`with Timer() as t: ...; t.seconds`"""

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
