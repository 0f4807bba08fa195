"""The executor's steps_done hook (once a tick's model steps are done, before
its events are built) and the worker's use of it: a heads-up to a planner
asleep on the event queue, and the runtime's threads parked."""

from __future__ import annotations

from superfluid.abi import Status
from superfluid.client.builder import PlanBuilder
from superfluid.daemon.segment_rings import SegmentRings
from superfluid.daemon.worker_loop import Worker
from superfluid.executor import Executor
from superfluid.testing.executor import admit_and_prefill, fake, make_executor
from superfluid.testing.heads_up import woken_by


def _counting(ex: Executor) -> list[int]:
    calls: list[int] = []
    ex.steps_done = lambda: calls.append(ex.counters.tick_count)
    return calls


def test_once_per_tick_that_ran_and_before_its_events():
    ex = make_executor()
    calls = _counting(ex)
    emitted_then: list[int] = []
    hook = ex.steps_done
    ex.steps_done = lambda: (hook(), emitted_then.append(ex.counters.tokens_emitted))
    admit_and_prefill(ex, 1, 5, [1, 2, 3, 4], decode=3)
    assert calls == [1]
    # The events (which count the emitted tokens) are built after the hook.
    assert emitted_then == [0] and ex.counters.tokens_emitted == 3
    r = ex.tick(PlanBuilder(2).decode(5, 2).build())
    assert r.status == Status.OK and calls == [1, 2]
    r = ex.tick(PlanBuilder(3).retire(5).build())  # no steps, still a tick that changed state
    assert r.status == Status.OK and calls == [1, 2, 3]


def test_not_for_a_rejected_plan_nor_an_empty_one():
    ex = make_executor()
    calls = _counting(ex)
    admit_and_prefill(ex, 4, 5, [1, 2, 3], decode=1)
    r = ex.tick(PlanBuilder(4).decode(5, 1).build())  # plan_seq not above the last
    assert r.status == Status.RejectIllegalCombination
    r = ex.tick(PlanBuilder(5).decode(99, 1).build())  # an unknown lane
    assert r.status == Status.RejectUnknownLane
    r = ex.tick(PlanBuilder(6).build())  # nothing to run: answered without a tick's phases
    assert r.status == Status.OK
    assert calls == [1]


def test_the_worker_wakes_its_planner_and_parks_the_runtime(segment):
    rt = fake()
    parked: list[int] = []
    rt.idle = lambda: parked.append(1)
    ex = Executor(rt, SegmentRings(segment))
    Worker(segment, ex, epoch=segment.bump_epoch())
    assert ex.steps_done is not None
    q = segment.event_queue
    assert woken_by(q, ex.steps_done)
    assert parked and len(q) == 0  # nothing published by the heads-up itself
