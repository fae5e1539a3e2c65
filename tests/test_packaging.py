"""The package as pip builds it and as `make demo` installs it."""

import pathlib
import re
import subprocess
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_pyproject_metadata_builds_without_a_deprecation_warning():
    """setuptools 77+ warns on a license table (a build failure from 2027); the SPDX string needs 77+."""
    pytest.importorskip("setuptools", minversion="77")
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dist = apply_configuration(Distribution(), str(ROOT / "pyproject.toml"))
    assert dist.metadata.license_expression == "Apache-2.0"
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert "setuptools>=77" in requires  # what pip's isolated build must fetch for that string


def test_make_demo_installs_the_extras_the_readme_commands_need():
    """The README's `offload train ... --lora` lines run after `make demo` (peft is the lora extra)."""
    proc = subprocess.run(["make", "-n", "-C", str(ROOT), "setup"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    [install] = [line for line in proc.stdout.splitlines() if "pip install" in line and " -e " in line]
    extras = set(re.search(r"\.\[([\w,]+)\]", install).group(1).split(","))
    readme = (ROOT / "README.md").read_text()
    assert "--lora" in readme and {"hf", "lora"} <= extras


def test_the_package_data_holds_the_kernel_sources_cpu_adam_builds_from():
    """A wheel carries offload/'s non-Python files by pyproject's package-data globs: the sources the CPU Adam
    kernel is built from must match one (a moved csrc/ would leave an installed package unable to build it)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from offload.kernels import cpu_adam

    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["offload"]
    shipped = {p for g in globs for p in (ROOT / "offload").glob(g)}
    sources = cpu_adam._SOURCES
    assert sources and all(src.exists() and src in shipped for src in sources), (globs, sources)
