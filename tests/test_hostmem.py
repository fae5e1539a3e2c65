"""offload.swap.hostmem: the host memory a plan may count on is what the tightest memory cgroup leaves (its
limit less what it is charged, inactive page cache excepted) where that is less than the kernel's figure; cgroup v1
and v2 trees built in a temporary directory, and a real cgroup where this host lets us make one."""

import os
import sys
from pathlib import Path

import psutil
import pytest

from offload.swap import hostmem

MiB = 2**20
REPO = Path(__file__).resolve().parent.parent


def _tree(tmp_path, cgroup_line: str, mount: str, groups: dict) -> str:
    """A /proc/self/{cgroup,mountinfo} and cgroup directories {relative dir: {file: text}} under tmp_path."""
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(f"3:cpu:/\n{cgroup_line}\n")
    (proc / "mountinfo").write_text("22 1 0:21 / /sys rw - sysfs sysfs rw\n" + mount.format(root=tmp_path) + "\n")
    for rel, files in groups.items():
        d = tmp_path / rel
        d.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (d / name).write_text(text)
    return str(tmp_path / "proc")


def _v1(limit, usage, inactive):
    return {"memory.limit_in_bytes": str(limit), "memory.usage_in_bytes": str(usage),
            "memory.stat": f"cache 1\ninactive_file 7\ntotal_inactive_file {inactive}\n"}


def _v2(limit, current, inactive):
    return {"memory.max": str(limit), "memory.current": str(current), "memory.stat": f"anon 1\ninactive_file {inactive}\n"}


UNLIMITED = 9223372036854771712


def test_v1_the_tightest_cgroup_up_the_hierarchy_binds(tmp_path):
    proc = _tree(tmp_path, "4:memory:/job/step", "35 31 0:32 / {root}/mem rw - cgroup cgroup rw,memory",
                 {"mem": _v1(UNLIMITED, 10 * MiB, 0), "mem/job": _v1(800 * MiB, 700 * MiB, 0),
                  "mem/job/step": _v1(1024 * MiB, 600 * MiB, 100 * MiB)})
    room = hostmem.cgroup_room(proc)
    assert room == hostmem.CgroupRoom(100 * MiB, 800 * MiB, str(tmp_path / "mem" / "job"))
    assert hostmem.available(proc) == 100 * MiB
    assert "under the memory cgroup limit of 0.78 GiB" in hostmem.describe(proc)
    # the step's own limit binds once its parent leaves more: page cache that can go is not counted as used
    (tmp_path / "mem" / "job" / "memory.usage_in_bytes").write_text(str(100 * MiB))
    assert hostmem.cgroup_room(proc).bytes == 1024 * MiB - 500 * MiB


def test_v2_and_a_container_that_sees_its_cgroup_as_the_root(tmp_path):
    proc = _tree(tmp_path, "0::/user.slice/app", "30 23 0:26 / {root}/cg2 rw - cgroup2 cgroup2 rw",
                 {"cg2": {}, "cg2/user.slice": _v2(2048 * MiB, 1536 * MiB, 512 * MiB),
                  "cg2/user.slice/app": _v2("max", 1536 * MiB, 512 * MiB)})
    assert hostmem.cgroup_room(proc).bytes == 1024 * MiB
    container = tmp_path / "c"
    proc = _tree(container, "4:memory:/docker/abc",
                 "35 31 0:32 /docker/abc {root}/mem rw - cgroup cgroup rw,memory",
                 {"mem": _v1(300 * MiB, 100 * MiB, 0)})
    assert hostmem.cgroup_room(proc) == hostmem.CgroupRoom(200 * MiB, 300 * MiB, str(container / "mem"))


def test_no_binding_limit_is_the_kernels_figure(tmp_path):
    total = psutil.virtual_memory().total
    proc = _tree(tmp_path, "4:memory:/a", "35 31 0:32 / {root}/mem rw - cgroup cgroup rw,memory",
                 {"mem": _v1(UNLIMITED, 0, 0), "mem/a": _v1(total, 0, 0)})  # at or above the RAM: no limit
    assert hostmem.cgroup_room(proc) is None
    assert hostmem.cgroup_room(str(tmp_path / "absent")) is None
    assert hostmem.describe(proc).endswith("GiB available")
    assert 0 < hostmem.available(proc) <= total


def test_a_plan_over_a_cgroup_limit_is_refused_not_oom_killed(tmp_path):
    """bench-200m with weights and fp32 states in dram needs ~4.2 GiB of host memory: under a 1.5 GiB cgroup
    limit it is refused, with the limit named, before anything is allocated; planned on the host's free memory
    it was accepted and the kernel killed it (SIGKILL) while placing the units."""
    sys.path.insert(0, str(REPO / "bench"))
    import memcap

    if memcap.cgroup_parent() is None:
        pytest.skip("no memory cgroup to make here (Linux cgroups, as root)")
    cmd = [sys.executable, "-m", "offload", "train", "--model", "bench-200m", "--steps", "1", "--offload-param",
           "cpu", "--offload-optimizer", "cpu", "--nvme-path", str(tmp_path / "swap")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc, info = memcap.run(cmd, 1536 * MiB, cwd=tmp_path, env=env)
    assert not info["oom_killed"] and proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "host memory: needs" in proc.stderr and "under the memory cgroup limit of 1.50 GiB" in proc.stderr
    assert info["peak_bytes"] < 1024 * MiB


def test_the_host_memory_refusal_names_the_activations_share(tmp_path, monkeypatch, capsys):
    """Everything on nvme and still over the host's memory: the refusal says how much of the need is the planned
    batch's activations, and what lowers them (offloading more cannot)."""
    from offload.cli import main
    from offload.plan import placement

    monkeypatch.setattr(placement.hostmem, "available", lambda: 1 << 20)
    assert main(["train", "--model", "tiny", "--steps", "1", "--offload-param", "nvme", "--offload-optimizer", "nvme",
                 "--nvme-path", str(tmp_path / "swap"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "host memory: needs " in err and "of it the activations of batch " in err
    assert "(a smaller batch or sequence, or activation_checkpointing, lowers them) but only 1048576 bytes" in err
