"""Markers that need something of the machine: `gpu` (CUDA), `libaio` (Linux AIO through the libaio
package) and `compiled_kernel` (the compiled CPU Adam kernel). Without it the test skips, except the fast
paths under OFFLOAD_CI=1 (.ci/run sets it): there a missing libaio or kernel fails the test, so a green
CI means the fast paths ran."""

import os

import pytest
import torch

STRICT = os.environ.get("OFFLOAD_CI") == "1"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _libaio_missing() -> str | None:
    from offload.swap import libaio_available

    return None if libaio_available() else "needs libaio (apt-get install libaio1; pip install libaio)"


def _kernel_missing() -> str | None:
    from offload.kernels import cpu_adam

    return None if cpu_adam._get_kernel() is not None else f"compiled kernel unavailable: {cpu_adam._kernel_error}"


FAST_PATHS = {"libaio": _libaio_missing, "compiled_kernel": _kernel_missing}


def pytest_runtest_setup(item):
    for marker, missing in FAST_PATHS.items():
        if item.get_closest_marker(marker) is None:
            continue
        reason = missing()
        if reason is not None and STRICT:
            pytest.fail(f"{reason} (OFFLOAD_CI=1: CI must run the fast paths)", pytrace=False)
        if reason is not None:
            pytest.skip(reason)
