"""Telemetry: bytes and seconds per link, stall seconds (compute waiting on a transfer), and a trace.

The trace is a list of spans (track, name, start, end) written as Chrome/Perfetto trace JSON: one
track each for compute, the copy streams, NVMe I/O and CPU Adam. Stall spans on the compute track
are the same measurements that `stall_seconds` adds up, so the two agree by construction.
"""

from __future__ import annotations

import json
import threading
import time

LINKS = ("nvme_to_dram", "dram_to_hbm", "hbm_to_dram", "dram_to_nvme")
TRACKS = ("step", "compute", "h2d", "d2h", "nvme", "cpu_adam")


class Telemetry:
    """Counters for one engine. Link seconds run from a transfer's submission to its observed completion."""

    def __init__(self):
        self._lock = threading.Lock()
        self.links = {name: {"bytes": 0, "seconds": 0.0} for name in LINKS}
        self.collectives: dict[str, dict] = {}  # over ranks: name -> bytes handed in, seconds, calls
        self.stall_seconds = 0.0
        self._spans: list[tuple[str, str, float, float]] | None = None
        self._t0 = time.perf_counter()

    def link(self, name: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.links[name]["bytes"] += int(nbytes)
            self.links[name]["seconds"] += seconds
        if self._spans is not None and seconds > 0:
            end = time.perf_counter()
            self.span("nvme" if "nvme" in name else ("h2d" if name == "dram_to_hbm" else "d2h"),
                      f"{name} {nbytes / 2**20:.1f} MiB", end - seconds, end)

    def collective(self, name: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            c = self.collectives.setdefault(name, {"bytes": 0, "seconds": 0.0, "calls": 0})
            c["bytes"] += int(nbytes)
            c["seconds"] += seconds
            c["calls"] += 1
        if self._spans is not None and seconds > 0:
            end = time.perf_counter()
            self.span("d2h", f"{name} {nbytes / 2**20:.1f} MiB", end - seconds, end)

    def exposed(self, name: str, seconds: float) -> None:
        """Of collective `name`'s time, `seconds` the compute thread waited for (`exposed_s`)."""
        with self._lock:
            c = self.collectives.setdefault(name, {"bytes": 0, "seconds": 0.0, "calls": 0})
            c["exposed_s"] = c.get("exposed_s", 0.0) + seconds

    def stall(self, seconds: float, what: str = "wait") -> None:
        with self._lock:
            self.stall_seconds += seconds
        if seconds > 0:
            end = time.perf_counter()
            self.span("compute", f"stall: {what}", end - seconds, end)

    # -- trace ----------------------------------------------------------------------------------------
    def start_trace(self) -> None:
        with self._lock:
            self._spans, self._t0 = [], time.perf_counter()

    def span(self, track: str, name: str, start: float, end: float) -> None:
        if self._spans is None:
            return
        with self._lock:
            self._spans.append((track, name, start, end))

    def spans(self) -> list[tuple[str, str, float, float]]:
        with self._lock:
            return list(self._spans or [])

    def chrome_trace(self) -> dict:
        """The trace as Chrome/Perfetto JSON (load it at ui.perfetto.dev or chrome://tracing)."""
        tid = {t: i for i, t in enumerate(TRACKS)}
        events = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": i, "args": {"name": t}} for t, i in tid.items()]
        for track, name, start, end in self.spans():
            events.append({"name": name, "ph": "X", "pid": 1, "tid": tid.get(track, len(tid)),
                           "ts": (start - self._t0) * 1e6, "dur": max(0.0, end - start) * 1e6,
                           "cat": track})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save_trace(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)

    def snapshot(self) -> dict:
        with self._lock:
            links = {k: dict(v) for k, v in self.links.items()}
            return {"links": links, "collectives": {k: dict(v) for k, v in self.collectives.items()},
                    "stall_seconds": self.stall_seconds,
                    "overlap_fraction": overlap_fraction(links, self.stall_seconds)}


def overlap_fraction(links: dict, stall_seconds: float) -> float | None:
    """The share of transfer time that compute did not wait for: 1 - stall / seconds moved on all links."""
    moved = sum(v["seconds"] for v in links.values())
    return max(0.0, 1.0 - stall_seconds / moved) if moved else None
