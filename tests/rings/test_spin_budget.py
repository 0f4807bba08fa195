"""A queue wait that names no spin spins as the queue's recent waits say:
the whole budget while answers come quickly, none once they typically take
far longer (a spinning waiter takes a core from whoever computes the answer),
and quick answers bring the spin back within a few waits."""

from __future__ import annotations

from superfluid.rings.queue import DEFAULT_SPIN_NS, SpinBudget


def test_quick_answers_spin_long_ones_do_not_and_it_comes_back():
    s = SpinBudget()
    assert s.spin_ns() == DEFAULT_SPIN_NS  # nothing known yet: spin
    for _ in range(20):
        s.waited(30_000)  # an empty tick's round trip
    assert s.spin_ns() == DEFAULT_SPIN_NS
    for _ in range(20):
        s.waited(20_000_000)  # ticks of 20 ms
    assert s.spin_ns() == 0
    for _ in range(8):  # an idle spell counts as long, not as forever
        s.waited(30_000)
    assert s.spin_ns() == DEFAULT_SPIN_NS


def test_a_queue_wait_without_a_spin_learns_from_its_own_waits(segment):
    q = segment.plan_queue
    assert q.peek_within(1_000_000) is None  # a timed-out wait counts as a wait
    assert 0 < q.spin.typical_ns <= 4 * DEFAULT_SPIN_NS
    q.try_reserve()[:8] = b"\0" * 8
    q.publish()
    before = q.spin.typical_ns
    assert q.peek_within(1_000_000) is not None  # there at once: a short wait
    assert q.spin.typical_ns < before
    q.release()
