"""Ranks never disagree on the order of collectives ([Note: collective order] in offload/state/ranks.py): a
fault on one rank that used to make it alone gather a unit (and hang both) trains to the numbers of a
run without it, and a rank that stops entering collectives ends every rank with an error naming the
collective, the unit and the step, within the collective timeout, leaving no swap bytes."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from offload.scheduler.trace import ExecutionTrace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 20  # tests/rank_worker.py's collective_timeout_s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(out: str, steps: int, fault: str = "none", fault_step: int = 0, env0=None, deadline=150):
    """Both ranks of tests/rank_worker.py; returns [(exit code, output, seconds)] per rank. A rank still
    running at the deadline is killed and fails the test: that is the hang."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
           "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "RANK_WORKER_TIMEOUT_S": str(TIMEOUT_S)}
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "rank_worker.py"), out, str(steps), fault,
                               str(fault_step)], env={**env, "RANK": str(r), **((env0 or {}) if r == 0 else {})},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    results = []
    try:
        for r, p in enumerate(procs):
            try:
                text = p.communicate(timeout=max(1.0, deadline - (time.monotonic() - t0)))[0]
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {r} still running after {deadline} s: the ranks hang")
            results.append((p.returncode, text, time.monotonic() - t0))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def _losses(out: str, results) -> list[list[float]]:
    for r, (code, text, _) in enumerate(results):
        assert code == 0, f"rank {r} failed (exit {code}):\n{text[-4000:]}"
    return [json.load(open(f"{out}.rank{r}.json"))["losses"] for r in range(2)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ref") / "run")
    return _losses(out, run_ranks(out, steps=4))


@pytest.mark.parametrize("fault,env0", [
    ("refs", None),                                       # one rank alone saw the table's refs move
    pytest.param("none", {"OFFLOAD_TEST_COPY_DELAY_S": "0.02"}, marks=pytest.mark.slow),  # one rank's threads late
])
def test_a_fault_on_one_rank_trains_like_a_run_without_it(tmp_path, reference, fault, env0):
    out = str(tmp_path / "run")
    assert _losses(out, run_ranks(out, steps=4, fault=fault, fault_step=2, env0=env0)) == reference


def test_a_rank_that_stops_entering_collectives_ends_every_rank_with_an_error_naming_it(tmp_path):
    out = str(tmp_path / "run")
    results = run_ranks(out, steps=4, fault="stall", fault_step=2, deadline=TIMEOUT_S * 4 + 60)
    (code0, text0, t0), (code1, text1, t1) = results
    assert code0 != 0 and code1 != 0, (text0[-2000:], text1[-2000:])
    assert "CollectiveError" in text0 and "at step 2" in text0 and f"collective_timeout_s {TIMEOUT_S}" in text0, text0[-3000:]
    assert "CollectiveError" in text1, text1[-3000:]  # its peer is gone when it comes back: at once
    assert t0 < t1  # rank 0 ended on its own timeout, not when rank 1 came back
    left = [os.path.join(d, f) for d, _, fs in os.walk(out + ".swap") for f in fs
            if os.path.getsize(os.path.join(d, f)) > 4096]  # owner.json may stay; no swap data
    assert not left, left


def test_the_ranks_keep_a_new_recording_only_if_all_recorded_the_same_order():
    def run(mine: list[int], theirs: list[int], recorded=None) -> ExecutionTrace:
        """This rank's trace after a step in which it used `mine` and the other rank `theirs`."""
        other = ExecutionTrace(2)
        other.recorded = recorded
        other.begin_step()
        for u in theirs:
            other.observe(u)
        other_changed = other.recorded is None or other._diverged or other._pos != len(other.recorded)
        import zlib
        d, n = zlib.crc32(repr(other._current).encode()), len(other._current)
        theirs_values = [float(other_changed), d, -d, n, -n]
        trace = ExecutionTrace(2, agree=lambda values, op: [max(a, b) for a, b in zip(values, theirs_values)])
        trace.recorded = recorded
        trace.begin_step()
        for u in mine:
            trace.observe(u)
        trace.end_step()
        return trace

    assert run([0, 1, 2], [0, 1, 2]).recorded == [0, 1, 2]                   # both recorded the same
    assert run([0, 1, 2], [0, 2, 1]).recorded is None                        # they differ: all record again
    assert run([0, 1, 2], [0, 1, 2, 3], recorded=[0, 1, 2]).recorded is None  # the other diverged alone
    assert run([0, 1, 2], [0, 1, 2], recorded=[0, 1, 2]).recorded == [0, 1, 2]  # nobody changed: kept


def test_a_failed_collective_is_named_and_no_later_one_is_entered():
    from offload.state.ranks import CollectiveError, Ranks

    ranks = Ranks(0, 1, timeout_s=7)
    ranks.step = 3

    def timed_out():
        raise RuntimeError("Timed out waiting 7000ms for recv operation to complete")

    with pytest.raises(CollectiveError, match=r"all_gather of layers\.1 at step 3 failed .*collective_timeout_s 7"):
        ranks.run("all_gather", "layers.1", timed_out)
    entered = []
    with pytest.raises(CollectiveError, match="not entered: an earlier collective failed"):
        ranks.run("reduce", "layers.0 window 0", lambda: entered.append(1))
    assert not entered
