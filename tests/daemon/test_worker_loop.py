"""The worker loop over a real segment, in a second process: plans in,
events out, ops between ticks, partial emits on the stream queue, a stop
request, and a fatal runtime error exiting 70."""

from __future__ import annotations

import multiprocessing as mp
import socket

import msgpack
import pytest

from superfluid.abi import MsgKind, OpStatus, PlanFlag, Status, WorkerState, codec
from superfluid.client import PlanBuilder
from superfluid.daemon.control import STOP
from superfluid.rings.segment import Segment
from superfluid.testing.executor import WORKER_SEGMENT

FORK = mp.get_context("fork")


def _serve(name: str, epoch: int, fatal_after: int | None, fault_injection: bool, control_fd: int) -> None:
    from superfluid.daemon.control import Control
    from superfluid.daemon.segment_rings import SegmentRings
    from superfluid.daemon.worker_loop import Worker
    from superfluid.engine.fake import FakeRuntime
    from superfluid.executor import Executor

    seg = Segment.open(name, 0)
    rt = FakeRuntime(vocab_size=64, max_seq_len=128, page=4, engine_sampling=True)
    if fatal_after is not None:
        rt.inject_fatal(on="step", times=1)
    ex = Executor(rt, SegmentRings(seg), epoch=epoch, fatal_exit=True, fault_injection=fault_injection)
    raise SystemExit(Worker(seg, ex, epoch=epoch, control=Control(control_fd)).run())


@pytest.fixture
def worker(seg_name):
    procs = []

    def start(*, fatal_after=None, fault_injection=False):
        seg = Segment.create(seg_name, 0, WORKER_SEGMENT)
        epoch = seg.bump_epoch()
        ours, theirs = socket.socketpair()
        p = FORK.Process(target=_serve, args=(seg_name, epoch, fatal_after, fault_injection, theirs.fileno()))
        p.start()
        theirs.close()
        seg.control = ours  # the daemon's end: the tests stop the worker through it
        procs.append((p, seg))
        from superfluid.daemon.worker_loop import wait_ready

        wait_ready(seg, epoch, 30)
        return seg, epoch, p

    yield start
    for p, seg in procs:
        if p.is_alive():
            seg.control.send(STOP)
            p.join(10)
        seg.control.close()
        if p.is_alive():
            p.kill()
            p.join()
        seg.close()
        seg.unlink()


def _events(seg, epoch):
    slot = seg.event_queue.peek(10, epoch=epoch)
    try:
        kind, _, _ = codec.read_header(slot)
        return kind, codec.decode(slot, "TickEvents" if kind == MsgKind.EVENTS else "OpEvents")
    finally:
        seg.event_queue.release()


def test_plans_in_events_out(worker):
    seg, epoch, _ = worker()
    prompt = seg.prompt_ring.write([1, 2, 3, 4, 5])
    PlanBuilder(1, prefill_token_budget=64).admit(9, prompt).prefill(9, 0, 5).decode(9, 4).encode_into(
        seg.plan_queue.reserve(5))
    seg.plan_queue.publish()
    kind, ev = _events(seg, epoch)
    assert kind == MsgKind.EVENTS and ev.status == Status.OK and ev.worker_epoch == epoch
    (emit,) = ev.emits
    assert emit.lane_tag == 9 and emit.n_tokens == 4 and len(seg.token_ring.read(emit.token_ref)) == 4
    # a reject comes back as events too, naming the field
    PlanBuilder(1).decode(9, 1).encode_into(seg.plan_queue.reserve(5))
    seg.plan_queue.publish()
    _, ev = _events(seg, epoch)
    assert ev.status == Status.RejectIllegalCombination and ev.message.startswith(b"TickPlan.plan_seq")
    assert seg.counters.ticks == 1 and seg.counters.rejects == 1 and seg.counters.live_lanes == 1


def test_an_undecodable_plan_is_answered(worker):
    seg, epoch, _ = worker()
    raw = bytearray(PlanBuilder(33).decode(1).decode(1).encode())
    slot = seg.plan_queue.reserve(5)
    slot[:len(raw)] = raw
    seg.plan_queue.publish()
    _, ev = _events(seg, epoch)
    assert ev.plan_seq == 33 and ev.status == Status.RejectIllegalCombination


def test_ops_between_ticks_complete_at_once(worker):
    seg, epoch, _ = worker()
    seg.op_queue.send_bytes(MsgKind.OP, msgpack.packb({"op": "DESCRIBE", "op_id": 77}))
    kind, ev = _events(seg, epoch)
    assert kind == MsgKind.OP_EVENTS
    (done,) = ev.op_completions
    assert done.op_id == 77 and done.status == OpStatus.OK
    assert msgpack.unpackb(done.payload)["runtime"]["vocab_size"] == 64
    seg.op_queue.send_bytes(MsgKind.OP, b"\xc1")  # never valid msgpack
    _, ev = _events(seg, epoch)
    assert ev.op_completions[0].status == OpStatus.BadRequest


def test_partial_emits_stream(worker):
    seg, epoch, _ = worker()
    prompt = seg.prompt_ring.write([3, 4])
    PlanBuilder(1, flags=PlanFlag.PARTIAL_EMITS, prefill_token_budget=8).admit(5, prompt).prefill(5, 0, 2).decode(
        5, 3).encode_into(seg.plan_queue.reserve(5))
    seg.plan_queue.publish()
    _, ev = _events(seg, epoch)
    streamed = []
    while (slot := seg.stream_queue.try_peek()) is not None:
        streamed.append(codec.decode(slot, "PartialEmit"))
        seg.stream_queue.release()
    tokens = seg.token_ring.read(ev.emits[0].token_ref).tolist()
    assert [p.token_id for p in streamed] == tokens and [p.index for p in streamed] == [0, 1, 2]
    assert all(p.plan_seq == 1 and p.lane_tag == 5 for p in streamed)


def test_an_unread_stream_stalls_a_tick_once_not_per_token(worker):
    # The stream queue (64 slots) is never read: the first tick fills it; the second
    # waits once for room (PARTIAL_WAIT_S), then drops the rest of its partials at once.
    import time

    from superfluid.abi import ParamFlag
    from superfluid.abi.records import SamplingParams
    from superfluid.daemon.outbox import PARTIAL_WAIT_S

    seg, epoch, _ = worker()
    noeos = SamplingParams(flags=int(ParamFlag.IGNORE_EOS))
    PlanBuilder(1, flags=PlanFlag.PARTIAL_EMITS, prefill_token_budget=8).admit(
        5, seg.prompt_ring.write([3, 4]), params=noeos).prefill(5, 0, 2).decode(5, 64).encode_into(
        seg.plan_queue.reserve(5))
    seg.plan_queue.publish()
    _, ev = _events(seg, epoch)
    assert ev.emits[0].n_tokens == 64 and len(seg.stream_queue) == 64
    t0 = time.monotonic()
    PlanBuilder(2, flags=PlanFlag.PARTIAL_EMITS).decode(5, 5).encode_into(seg.plan_queue.reserve(5))
    seg.plan_queue.publish()
    _, ev = _events(seg, epoch)
    took = time.monotonic() - t0
    assert ev.status == Status.OK and ev.emits[0].n_tokens == 5
    assert 0.9 * PARTIAL_WAIT_S <= took < 3 * PARTIAL_WAIT_S, f"{took:.1f}s: one wait, not one per dropped token"
    assert len(seg.stream_queue) == 64  # nothing overwritten


def test_stop_request(worker):
    seg, _epoch, proc = worker()
    seg.control.send(STOP)
    proc.join(10)
    assert proc.exitcode == 0 and seg.worker_state == WorkerState.STOPPED


def test_the_segments_stop_flag_is_a_report_not_a_command(worker):
    # A planner can write stop_requested: the worker must not leave for it.
    seg, _epoch, proc = worker()
    seg.request_stop()
    proc.join(0.3)
    assert proc.is_alive() and seg.worker_state == WorkerState.READY
    seg.control.send(STOP)  # the daemon's channel does stop it
    proc.join(10)
    assert proc.exitcode == 0


def test_a_fatal_runtime_error_exits_70(worker):
    seg, _epoch, proc = worker(fatal_after=0)
    prompt = seg.prompt_ring.write([1, 2])
    PlanBuilder(1, prefill_token_budget=8).admit(4, prompt).prefill(4, 0, 2).decode(4, 1).encode_into(
        seg.plan_queue.reserve(5))
    seg.plan_queue.publish()
    proc.join(20)
    assert proc.exitcode == 70


def test_completions_that_overflow_a_tick_go_in_the_next_messages(seg_name):
    # In-process: the worker's outbox over a real segment, no worker loop.
    from superfluid.abi.records import OpCompletion, TickEvents
    from superfluid.daemon.segment_rings import SegmentRings
    from superfluid.daemon.worker_loop import Worker
    from superfluid.engine.fake import FakeRuntime
    from superfluid.executor import Executor

    seg = Segment.create(seg_name, 0, WORKER_SEGMENT)
    try:
        ex = Executor(FakeRuntime(vocab_size=64, max_seq_len=128, page=4), SegmentRings(seg), epoch=1)
        w = Worker(seg, ex, epoch=1)
        slot = seg.event_queue.slot_bytes
        comps = tuple(OpCompletion(op_id=i, status=0, op=1, payload=bytes([i % 251]) * 7000) for i in range(20))
        huge = OpCompletion(op_id=99, status=0, op=9, payload=b"z" * (slot + 1))
        w.out.events(TickEvents(plan_seq=4, worker_epoch=1, op_completions=comps + (huge,)), session=3)
        w.out.flush()  # four slots: enough for the events and their overflow
        got, kinds, sessions = [], [], set()
        while (s := seg.event_queue.try_peek()) is not None:
            kind = codec.read_header(s)[0]
            sessions.add(codec.session_of(s))
            msg = codec.decode(s, "TickEvents" if kind == MsgKind.EVENTS else "OpEvents")
            seg.event_queue.release()
            kinds.append(kind)
            got += msg.op_completions
        assert kinds[0] == MsgKind.EVENTS and set(kinds[1:]) == {MsgKind.OP_EVENTS} and len(kinds) >= 3
        assert sessions == {3}
        assert [c.op_id for c in got] == [c.op_id for c in comps] + [99]  # all of them, in order
        assert got[:-1] == list(comps)
        assert got[-1].status == OpStatus.Capacity and b"does not fit" in got[-1].payload  # said, not dropped
    finally:
        seg.close()
        seg.unlink()
