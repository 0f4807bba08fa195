"""Plans with no lists take a short path (abi.plan_codec.empty_plan,
Executor.tick_empty, Worker._empty, encode_bare_events_into): it must leave
the state, events, counters and metrics the general path leaves, and hand
everything else to that path."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings, strategies as st

from superfluid.abi import PLAN_SEQ_MAX, PlanFlag, Status, codec
from superfluid.abi.plan_codec import (
    PlanReject,
    decode_plan,
    empty_plan,
    encode_bare_events_into,
    encode_events_into,
)
from superfluid.abi.records import TickEvents, TickMemCounters, TickTimings
from superfluid.client.builder import PlanBuilder
from superfluid.testing.executor import WORKER_SEGMENT, admit_and_prefill, make_executor

_U64 = st.integers(0, (1 << 64) - 1)


def _plan(seq: int, **kw) -> bytearray:
    return bytearray(PlanBuilder(seq, **kw).encode())


def test_empty_plan_reads_only_what_decode_plan_would_run_as_empty():
    assert empty_plan(_plan(7, max_decode_lanes=3)) == (7, 3)
    assert empty_plan(_plan(8, flags=int(PlanFlag.DRAIN))) == (8, decode_plan(_plan(8)).max_decode_lanes)
    others = [
        PlanBuilder(7).decode(1).encode(), PlanBuilder(7).retire(1).encode(), PlanBuilder(7).commit(1, 2, 3).encode(),
        PlanBuilder(7).prefill(1, 0, 4).encode(),
    ]
    for msg in others:  # a list: the general path's
        assert empty_plan(bytearray(msg)) is None and decode_plan(bytearray(msg)) is not None
    c = codec.CODECS["TickPlan"]
    bad = []
    for field, value in (("flags", 1 << 30), ("evictable_cache_classes", 1 << 30), ("plan_seq", PLAN_SEQ_MAX + 1)):
        m = _plan(7)
        struct.pack_into("<Q" if field == "plan_seq" else "<I", m, codec.MSG_HEADER_BYTES + _offset(field), value)
        bad.append(m)
    m = _plan(7) + bytearray(8)
    struct.pack_into("<Q", m, 8, 8)  # arena bytes no span uses: valid, and the general path's
    assert empty_plan(m) is None and decode_plan(m) == decode_plan(_plan(7))
    m = _plan(7)
    struct.pack_into("<I", m, 4, c.size - 8)  # record_bytes
    bad.append(m)
    m = _plan(7)
    struct.pack_into("<Q", m, codec.MSG_HEADER_BYTES, c.size + 8)  # struct_size
    bad.append(m)
    for m in bad:
        assert empty_plan(m) is None
        with pytest.raises(PlanReject):
            decode_plan(m)
    assert empty_plan(_plan(7)[:40]) is None  # short


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 127), st.integers(0, 255)), min_size=1, max_size=4), st.booleans())
def test_what_empty_plan_takes_decode_plan_runs_as_that_empty_plan(pokes, listed):
    """Bytes of a plan changed anywhere: what empty_plan takes, decode_plan
    takes too, as a plan with no lists of that plan_seq and lane budget."""
    m = bytearray(PlanBuilder(7, max_decode_lanes=2).decode(1).encode() if listed else _plan(7, max_decode_lanes=2))
    for at, byte in pokes:
        m[at] = byte
    head = empty_plan(m)
    if head is None:
        return
    p = decode_plan(m)
    assert (p.plan_seq, p.max_decode_lanes) == head
    assert not (p.admits or p.prefills or p.decodes or p.commits or p.retires)


def _offset(field: str) -> int:
    from superfluid.abi import ffi
    return ffi.offsetof("TickPlan", field)


@settings(max_examples=60, deadline=None)
@given(_U64, _U64, st.tuples(*[_U64] * 6), st.integers(0, (1 << 32) - 1), _U64)
def test_bare_events_are_the_codecs_bytes(seq, wall, mem, epoch, session):
    ev = TickEvents(plan_seq=seq, timings=TickTimings(wall, 0, 0, 0, 0), mem=TickMemCounters(*mem), worker_epoch=epoch)
    a, b = bytearray(b"\xaa" * 512), bytearray(b"\x55" * 512)
    n = encode_events_into(a, ev, session=session)
    encode_bare_events_into(b, seq, wall, TickMemCounters(*mem), epoch, session)
    assert a[:n] == b[:n]
    assert codec.decode(b, "TickEvents") == ev._replace(struct_size=codec.CODECS["TickEvents"].size)


def _states():
    """Executor states an empty plan meets: (name, builder of a fresh executor
    in that state, the next plan_seq)."""
    def idle():
        return make_executor(), 1

    def lanes():
        ex = make_executor()
        admit_and_prefill(ex, 1, 5, [1, 2, 3, 4, 5, 6], decode=2)
        admit_and_prefill(ex, 2, 6, [7, 8, 9])
        return ex, 3

    def cached_and_leased():
        ex = make_executor()
        admit_and_prefill(ex, 1, 5, list(range(1, 13)), decode=1)
        assert ex.tick(PlanBuilder(2).retire(5, publish_to_cache=True).build()).ok
        done = ex.op({"op": "LEASE_SEED", "op_id": 1, "tokens": list(range(1, 13)), "ttl_ticks": 1}, queue=True)
        assert done.status == 0 and len(ex.leases) == 1, done
        assert _general(ex, decode_plan(_plan(3))).status == Status.OK
        ex.op({"op": "DESCRIBE", "op_id": 2}, queue=True)
        return ex, 4  # the lease's tick is up: the next plan's sweep drops it

    def completions():
        ex = make_executor()
        ex.op({"op": "DESCRIBE", "op_id": 9}, queue=True)
        return ex, 1

    def over_limit():
        ex, seq = cached_and_leased()
        ex.cache.max_bytes = 0  # the cache must shrink: evictions to report
        assert ex.cache.resident_bytes > 0
        return ex, seq

    def pending_shed():
        ex = make_executor()
        admit_and_prefill(ex, 1, 5, list(range(1, 13)), decode=1)
        assert ex.tick(PlanBuilder(2).retire(5, publish_to_cache=True).build()).ok
        assert ex.op({"op": "CACHE_CLEAR", "op_id": 3}).status == 0 and ex.pending.shed
        return ex, 3

    def dead():
        ex = make_executor()
        ex.dead = "a test said so"
        return ex, 1

    return [idle, lanes, cached_and_leased, completions, over_limit, pending_shed, dead]


def _general(ex, plan):
    """check then apply, as Executor.tick does without the short path."""
    if ex.dead:
        return ex._refused(plan.plan_seq, Status.Fatal, "executor", ex.dead).events
    try:
        v = ex.check(plan)
    except PlanReject as r:
        ex.counters.rejects += 1
        return ex._refused(plan.plan_seq, r.status, r.field, r.message).events
    return ex.apply(v, ex.clock())


def _same(a: TickEvents, b: TickEvents) -> None:
    assert a._replace(timings=None) == b._replace(timings=None)


@pytest.mark.parametrize("state", _states(), ids=lambda f: f.__name__)
@pytest.mark.parametrize("offset", [0, -1, 5])
def test_tick_empty_leaves_what_check_and_apply_leave(state, offset):
    fast_ex, seq = state()
    slow_ex, _ = state()
    assert fast_ex.state_digest() == slow_ex.state_digest()
    seq = max(1, seq + offset)  # -1: not above the last plan_seq, a reject
    plan = decode_plan(_plan(seq, max_decode_lanes=1))
    got = fast_ex.tick(plan, decoded=True)
    want = _general(slow_ex, plan)
    _same(got.events, want)
    if state.__name__ == "cached_and_leased" and offset == 0:
        assert len(fast_ex.leases) == 0 and got.events.op_completions  # the sweep ran; the ops' answer went out
    assert fast_ex.state_digest() == slow_ex.state_digest()
    assert fast_ex.counters.rejects == slow_ex.counters.rejects


def test_tick_empty_declines_without_changing_anything():
    for state in _states():
        ex, seq = state()
        before = ex.state_digest()
        if ex.tick_empty(seq, 1) is None:
            assert ex.state_digest() == before, state.__name__
        else:
            assert ex.counters.last_plan_seq == seq and ex.state_digest() != before
    ex, seq = _states()[0]()
    assert ex.tick_empty(seq, ex.desc.max_batch + 1) is None  # the budget rule: the general path rejects
    assert ex.tick(PlanBuilder(seq, max_decode_lanes=ex.desc.max_batch + 1).build()).status == Status.RejectBudget


def test_worker_answers_an_empty_plan_as_the_general_path(seg_name):
    from superfluid.daemon.metrics import _AT, WorkerMetrics
    from superfluid.daemon.segment_rings import SegmentRings
    from superfluid.daemon.worker_loop import Worker
    from superfluid.engine.fake import FakeRuntime
    from superfluid.executor import Executor
    from superfluid.rings.segment import Segment

    seg = Segment.create(seg_name, 0, WORKER_SEGMENT)
    metrics = [WorkerMetrics.create(f"{seg_name}.{i}") for i in range(2)]
    try:
        w = Worker(seg, Executor(FakeRuntime(vocab_size=64, page=4), SegmentRings(seg), epoch=3), epoch=3,
                   metrics=metrics[0])
        for seq in (1, 2, 3):
            seg.plan_queue.send("TickPlan", PlanBuilder(seq).build(), session=0)
            w._plan(seg.plan_queue.try_peek())
            slot = seg.event_queue.try_peek()
            raw = bytes(slot[:codec.CODECS["TickEvents"].message.size])
            ev = codec.decode(slot, "TickEvents")
            seg.event_queue.release()
            assert (ev.status, ev.plan_seq, ev.worker_epoch) == (Status.OK, seq, 3)
            again = bytearray(len(raw))
            encode_events_into(again, ev, session=0)
            assert bytes(again) == raw
            metrics[1].tick(decode_plan(_plan(seq)), ev)  # what the general path tells metrics
        assert w.ex.counters.last_plan_seq == 3 and w.ex.counters.tick_count == 3
        beat = _AT["heartbeat_ns"]  # the watchdog's: stamped as the worker takes a plan (a clock, not a count)
        assert metrics[0].heartbeat() > 0
        metrics[0]._w[beat] = 0
        assert list(metrics[0]._w) == list(metrics[1]._w)
        assert metrics[0]._w != [0] * len(metrics[0]._w)  # (negative control: something was counted)
    finally:
        for m in metrics:
            m.close()
        seg.close()
        seg.unlink()
