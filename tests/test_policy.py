"""The residency policy alone: unit ids and byte sizes, no tensors (scheduler/policy.py)."""

from offload.scheduler.policy import ResidencyPolicy
from offload.scheduler.trace import ExecutionTrace

STEP = [(u, False) for u in range(4)] + [(u, True) for u in reversed(range(4))]  # forward, then backward


def policy(lookahead=2, nbytes=(10, 10, 10, 10), reuse_distance=0, reuse_bytes=0, grad_reserve=0):
    trace = ExecutionTrace(lookahead)
    return ResidencyPolicy(trace, list(nbytes), reuse_distance, reuse_bytes, grad_reserve), trace


def run(p, trace, order, room=10**9, recorded=True):
    """One step; returns [(unit, fetched ahead, released after)]."""
    out = []
    trace.begin_step()
    for u, backward in order:
        ahead = p.before_use(u, room - sum(p.nbytes[r] for r in p.resident), backward)
        out.append((u, ahead, p.after_use(u)))
    trace.end_step()
    return out


def test_the_first_step_records_and_fetches_on_demand_then_prefetches_along_the_trace():
    p, trace = policy()
    assert all(ahead == [] for _, ahead, _ in run(p, trace, STEP))
    second = run(p, trace, STEP)
    assert [a for _, a, _ in second[:3]] == [[1, 2], [3], []]  # 1 and 2 already on their way when 1 runs


def test_prefetch_keeps_the_gradient_reserve_free_and_stops_at_the_first_unit_that_does_not_fit():
    p, trace = policy(nbytes=(10, 30, 10, 10), grad_reserve=15)
    run(p, trace, STEP)
    trace.begin_step()
    assert p.before_use(0, room=44) == []        # unit 1 (30 B) + reserve 15 > 44: nothing, not unit 2 first
    assert p.before_use(1, room=100) == [2, 3]   # unit 1 fetched on demand; 2 and 3 fit


def test_a_unit_used_again_within_reuse_distance_is_kept():
    for distance, released in [(0, [True, True, True, False]), (2, [True, True, False, False])]:
        p, trace = policy(reuse_distance=distance)
        run(p, trace, STEP)
        assert [r for _, _, r in run(p, trace, STEP)[:4]] == released  # the last unit's backward comes next


def test_reuse_bytes_keeps_forward_units_for_their_backward_while_they_fit():
    p, trace = policy(reuse_bytes=20)
    run(p, trace, STEP)
    trace.begin_step()
    released = [p.after_use(u) for u, _ in STEP[:4] if p.before_use(u, 100) is not None]
    assert released == [False, False, True, False]  # 0 and 1 fill the 20 B; 3 by distance 0
    assert p.kept == {0: 10, 1: 10}


def test_a_recomputed_forward_is_kept_and_release_all_forgets_everything():
    p, trace = policy()
    trace.begin_step()
    p.before_use(0, room=100)
    assert p.after_use(0, recompute=True) is False and p.resident == {0}
    p.release_all()
    assert p.resident == set() and p.kept == {}


def test_a_diverged_step_fetches_on_demand_only():
    p, trace = policy()
    run(p, trace, STEP)
    order = [(u, False) for u in (0, 2, 1, 3)] + [(u, True) for u in (3, 1, 2, 0)]
    assert all(ahead == [] for _, ahead, _ in run(p, trace, order)[1:])


def test_a_held_unit_stays_from_a_forward_use_to_its_next_use_and_goes_after_its_backward():
    # unit 0 is used twice in the forward (a tied embedding: lookup, then output head) and once in backward
    tied = [(0, False), (1, False), (2, False), (3, False), (0, False), (0, True), (3, True), (2, True), (1, True)]
    trace = ExecutionTrace(0)
    p = ResidencyPolicy(trace, [10] * 4, 0, 0, 0, held=frozenset({0}))
    run(p, trace, tied)
    released = {(u, b): r for (u, b), (_, _, r) in zip(tied, run(p, trace, tied))}
    assert released[(0, False)] is False and released[(0, True)] is True  # held in forward only
    assert released[(1, False)] is True  # the others as before
    unheld, trace = policy(lookahead=0)
    run(unheld, trace, tied)
    assert run(unheld, trace, tied)[0][2] is True  # without it, released after the lookup


def test_free_holds_keeps_a_tied_unit_only_where_holding_it_raises_no_peak():
    from offload.plan.memory import Knobs, free_holds, working_set_peak

    order = [0, 1, 2, 3, 0]  # unit 0 used again at the forward's end
    knobs = Knobs(prefetch_units=1, reuse_distance=0, reuse_bytes=0)
    # a large tied unit: the peak is at the turn, where it is held anyway; holding it through the forward is free
    numels, trainables = [40, 10, 10, 10], [40, 10, 10, 10]
    held = free_holds(order, numels, trainables, 1, knobs, 0)
    assert held == {0}
    assert working_set_peak(order, numels, trainables, 1, Knobs(prefetch_units=1, reuse_distance=0, held=held), 0) \
        == working_set_peak(order, numels, trainables, 1, knobs, 0)
    # a frozen block larger than the turn: the forward at it is the peak, and holding unit 0 beside it raises
    # it (220 -> 250 B), so unit 0 is released after its lookup and fetched again for the head
    big, frozen = [40, 10, 200, 10], [40, 10, 0, 10]
    assert free_holds(order, big, frozen, 1, knobs, 0) == frozenset()


def test_before_a_step_the_recorded_first_units_that_fit_are_fetched_ahead_and_held():
    p, trace = policy(nbytes=(10, 10, 30, 10), grad_reserve=5)
    assert p.before_step(room=100) == []  # nothing recorded yet: the first step fetches on demand
    run(p, trace, STEP)
    p.release_all()
    assert p.before_step(room=40) == [0, 1]  # the trace's first 2 (lookahead); each with the reserve free
    assert p.resident == {0, 1}
    trace.begin_step()
    assert p.before_use(0, room=20) == []  # 1 is on its way already; 2 (30 B) does not fit the room left
    p.release_all()
    assert p.before_step(room=20) == [0]  # unit 1 (10 B) + reserve 5 > the 10 left after unit 0
