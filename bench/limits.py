"""The precision a bench runs at, and the compute floor it states its step times against.

Every bench takes `--precision` (default auto: what the engine picks on this host, offload/plan/precision.py),
runs every mode at that precision, and records beside `io_bound_s`:

    matmul_gflops   = the host's F.linear GFLOP/s in that dtype on the compute device, measured in the run
                      (offload.doctor.matmul_gflops: the figure `offload doctor` prints)
    compute_floor_s = 6 x params x tokens per step / matmul_gflops

6 FLOPs per parameter and token: 2 in the forward's products, 4 in the backward's (ignoring attention's
sequence-squared products and every non-matmul op, so no step can beat it). A step time is then stated
against both physical limits measured in the same run: the drive (io_bound_s) and the arithmetic.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

FLOPS_PER_PARAM_TOKEN = 6


def add_precision_argument(ap) -> None:
    ap.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp16", "fp32"),
                    help="compute dtype of every mode (default auto: what the engine picks on this host; "
                         "docs/precision.md)")


def resolve(precision: str) -> str:
    """The precision that runs: "auto" resolved for this host's compute device, as the engine does."""
    from offload.plan.precision import resolve_precision

    return resolve_precision(precision).name


def matmul_gflops(precision: str) -> float:
    """The host's matmul GFLOP/s in `precision` on the compute device the engine uses."""
    import torch

    from offload.doctor import matmul_gflops as measure
    from offload.plan.precision import DTYPES

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return measure(DTYPES[precision], device)


def compute_floor_s(params: int, tokens_per_step: int, gflops: float) -> float:
    """6 x params x tokens / the measured matmul speed: no step is faster (module docstring)."""
    return FLOPS_PER_PARAM_TOKEN * params * tokens_per_step / (gflops * 1e9)


def describe(precision: str, gflops: float, floor_s: float, io_bound: float | None) -> str:
    """One line: the two limits a step time is stated against."""
    io = f", io bound {io_bound:.2f} s" if io_bound is not None else ""
    return (f"precision {precision}: matmul {gflops:,.1f} GFLOP/s measured in this run; compute floor "
            f"{floor_s:.2f} s (6 x params x tokens / matmul){io}")
