"""The CPU Adam kernel cache loads only a library it can trust ([Note: trusting a cached kernel] in
offload/kernels/kernel_cache.py): its digest recorded at build time, owned by this user, in directories nobody
else can write; anything else is built again with one line saying why.

cpp_extension.load is replaced by one that writes a stand-in library and the import by one that records
what it was asked to load, so these tests exercise the cache's decisions without a compiler (the real build
and its digest: the last test)."""

import grp
import hashlib
import os
import pwd
import stat
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from offload.kernels import cpu_adam, kernel_cache


class FakeToolchain:
    """Stand-ins for torch.utils.cpp_extension.load and cpu_adam._import: `built` lists the build
    directories compiled into, `loaded` the libraries imported from the cache (with their bytes then)."""

    def __init__(self):
        self.built, self.loaded = [], []

    def compile(self, name, sources, extra_cflags, build_directory, verbose):
        build_dir = Path(build_directory)
        (build_dir / f"{name}.so").write_bytes(b"library built in " + bytes(build_dir))
        (build_dir / f"{name}.so").chmod(0o775)  # as a linker leaves it under umask 002
        self.built.append(build_dir)
        return ("built", build_dir)

    def load(self, library):
        self.loaded.append((library, library.read_bytes()))
        return ("loaded", library)


@pytest.fixture
def toolchain(monkeypatch, tmp_path):
    fake = FakeToolchain()
    monkeypatch.setattr(cpp_extension, "load", fake.compile)
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", lambda: None)
    monkeypatch.setattr(cpu_adam, "_import", fake.load)
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    return fake


def _built_once(toolchain, capfd):
    """A first build into the empty cache; returns its build directory and library."""
    assert cpu_adam._build()[0] == "built"
    [build_dir] = toolchain.built
    assert "building the CPU Adam kernel (once, ~25 s)" in capfd.readouterr().err
    return build_dir, build_dir / "offload_cpu_adam.so"


def _rebuilt_saying(toolchain, capfd, reason: str):
    before = len(toolchain.built)
    assert cpu_adam._build()[0] == "built" and len(toolchain.built) == before + 1
    err = capfd.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "building the CPU Adam kernel" in err and reason in err, err
    return toolchain.built[-1], err


def test_a_build_records_its_digest_and_a_matching_library_loads_without_a_build(toolchain, capfd):
    build_dir, library = _built_once(toolchain, capfd)
    digest = (build_dir / "offload_cpu_adam.so.sha256").read_text().strip()
    assert digest == hashlib.sha256(library.read_bytes()).hexdigest()
    assert stat.S_IMODE(build_dir.stat().st_mode) == 0o700 and stat.S_IMODE(library.stat().st_mode) == 0o755
    assert cpu_adam._build() == ("loaded", library)
    assert len(toolchain.built) == 1 and "building" not in capfd.readouterr().err


def test_a_tampered_library_is_built_again_not_loaded(toolchain, capfd):
    build_dir, library = _built_once(toolchain, capfd)
    library.write_bytes(library.read_bytes() + b"\x90")  # one byte appended, owner and mode unchanged
    assert _rebuilt_saying(toolchain, capfd, "does not match the digest recorded when it was built")[0] == build_dir
    assert toolchain.loaded == []
    assert cpu_adam._build() == ("loaded", library)  # the new build's digest is recorded


def test_a_library_without_a_recorded_digest_is_built_again(toolchain, capfd):
    build_dir, library = _built_once(toolchain, capfd)
    (build_dir / "offload_cpu_adam.so.sha256").unlink()  # as an earlier version's cache
    _rebuilt_saying(toolchain, capfd, "no digest recorded beside offload_cpu_adam.so")
    assert toolchain.loaded == []


@pytest.mark.parametrize("target", ["build directory", "library"])
def test_a_group_writable_build_directory_or_library_is_built_again(toolchain, capfd, target):
    build_dir, library = _built_once(toolchain, capfd)
    planted = build_dir / "cpu_adam.o"
    planted.write_bytes(b"an object file someone else put there")
    path = build_dir if target == "build directory" else library
    path.chmod(stat.S_IMODE(path.stat().st_mode) | stat.S_IWGRP)
    _rebuilt_saying(toolchain, capfd, f"{path} is writable by group or others")
    assert toolchain.loaded == [] and not planted.exists()  # emptied before the build: ninja reuses nothing
    assert stat.S_IMODE(build_dir.stat().st_mode) == 0o700


def _refused_cache(toolchain, capfd, tmp_path, mode: int, gid: int = -1):
    """The cache directory made `mode` (and group `gid`): the kernel is built in a private directory, not
    loaded from the cache; once the mode is 0700 again the cached build loads."""
    build_dir, library = _built_once(toolchain, capfd)
    cache = tmp_path / "cache"
    os.chown(cache, -1, gid)
    cache.chmod(mode)
    private, line = _rebuilt_saying(toolchain, capfd, f"not in the cache: {cache} is writable by group or others")
    assert toolchain.loaded == [] and private != build_dir and not private.is_relative_to(cache)
    assert stat.S_IMODE(private.stat().st_mode) == 0o700 and "set OFFLOAD_CACHE_DIR" in line  # and the fix
    cache.chmod(0o700)
    assert cpu_adam._build() == ("loaded", library)


def test_a_world_writable_cache_is_refused_and_the_kernel_built_in_a_private_directory(toolchain, capfd, tmp_path):
    _refused_cache(toolchain, capfd, tmp_path, 0o757)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another group needs root")
def test_a_cache_writable_by_another_group_is_refused(toolchain, capfd, tmp_path):
    _refused_cache(toolchain, capfd, tmp_path, 0o775, gid=12345)


def test_a_cache_writable_only_by_the_user_s_private_group_is_used(toolchain, capfd, tmp_path, monkeypatch):
    """Debian's user private groups with umask 002: ~/.cache is 0775, its group the user's own."""
    build_dir, library = _built_once(toolchain, capfd)
    cache = tmp_path / "cache"
    cache.chmod(0o775)
    user = pwd.getpwuid(os.geteuid()).pw_name
    group = lambda gid, members=(): grp.struct_group((user, "x", gid, list(members)))  # noqa: E731
    monkeypatch.setattr(grp, "getgrgid", group)
    assert cpu_adam._build() == ("loaded", library)  # the user's own group
    monkeypatch.setattr(grp, "getgrgid", lambda gid: group(gid, [user, "someone-else"]))
    _rebuilt_saying(toolchain, capfd, f"{cache} is writable by group or others")  # a group of two


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner needs root")
def test_a_library_owned_by_another_user_is_built_again(toolchain, capfd):
    build_dir, library = _built_once(toolchain, capfd)
    os.chown(library, 12345, -1)
    _rebuilt_saying(toolchain, capfd, f"{library} is owned by uid 12345, not by this user (0)")
    assert toolchain.loaded == []


def test_a_library_replaced_by_a_symlink_is_built_again(toolchain, capfd, tmp_path):
    build_dir, library = _built_once(toolchain, capfd)
    elsewhere = tmp_path / "elsewhere.so"
    elsewhere.write_bytes(library.read_bytes())  # the same bytes: the digest alone would accept it
    library.unlink()
    library.symlink_to(elsewhere)
    _rebuilt_saying(toolchain, capfd, "is not a file (a symlink)")
    assert toolchain.loaded == [] and elsewhere.exists()


@pytest.mark.compiled_kernel
def test_the_real_build_is_sealed():
    """The real build's library passes the checks (a new process then loads it without a build:
    tests/test_cpu_adam_api.py, test_a_cached_kernel_loads_in_a_new_process_without_running_ninja)."""
    assert cpu_adam._get_kernel() is not None  # built (or loaded) by the marker's check
    build_dir = cpu_adam.cache_dir()
    assert kernel_cache.why_untrusted(build_dir, build_dir / "offload_cpu_adam.so") is None
