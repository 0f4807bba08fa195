"""SPSC slot queues: order, back-pressure, futex wake-ups across processes,
and waits that end when the peer is gone."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from superfluid.abi import WaitResult, WorkerState, ffi, lib
from superfluid.abi.records import PartialEmit, TickPlan
from superfluid.rings.errors import PeerGone, StopRequested
from superfluid.rings.layout import SegmentConfig
from superfluid.rings.queue import QueueTimeout
from superfluid.rings.segment import Segment

FORK = mp.get_context("fork")


def _put(q, value: int) -> None:
    slot = q.try_reserve()
    assert slot is not None
    slot[16:24] = value.to_bytes(8, "little")
    q.publish()


def _get(q) -> int:
    slot = q.try_peek()
    assert slot is not None
    v = int.from_bytes(slot[16:24], "little")
    q.release()
    return v


def test_fifo_full_and_empty(segment):
    q = segment.plan_queue  # 4 slots
    assert q.try_peek() is None and len(q) == 0
    for i in range(4):
        _put(q, i)
    assert q.try_reserve() is None  # full: back-pressure, nothing overwritten
    assert len(q) == 4
    assert [_get(q) for _ in range(4)] == [0, 1, 2, 3]
    assert q.try_peek() is None


def test_order_survives_many_wraps(segment):
    q = segment.plan_queue
    expect = 0
    for i in range(1000):
        _put(q, i)
        if i % 3 == 2:
            while q.try_peek() is not None:
                assert _get(q) == expect
                expect += 1
    while q.try_peek() is not None:
        assert _get(q) == expect
        expect += 1
    assert expect == 1000 and q.head == q.tail == 1000


def test_messages_through_a_queue(segment):
    segment.plan_queue.send("TickPlan", TickPlan(plan_seq=9), timeout=1)
    assert segment.plan_queue.recv("TickPlan", timeout=1).plan_seq == 9
    segment.stream_queue.send("PartialEmit", PartialEmit(plan_seq=1, lane_tag=2, token_id=3, index=0))
    assert segment.stream_queue.recv("PartialEmit", timeout=1) == PartialEmit(1, 2, 3, 0)


def test_a_message_that_does_not_decode_is_released_and_reported(segment):
    from superfluid.abi import codec

    segment.plan_queue.send_bytes(3, b"junk")
    with pytest.raises(codec.CodecError):
        segment.plan_queue.recv("TickPlan", timeout=1)
    assert len(segment.plan_queue) == 0


def test_wait_times_out(segment):
    t0 = time.monotonic()
    with pytest.raises(QueueTimeout):
        segment.event_queue.wait_readable(0.05)
    assert time.monotonic() - t0 >= 0.05


def test_wait_on_a_full_queue_times_out(segment):
    q = segment.plan_queue
    for i in range(4):
        _put(q, i)
    with pytest.raises(QueueTimeout):
        q.wait_writable(0.02)


def test_an_epoch_change_ends_the_wait(segment):
    epoch = segment.bump_epoch(WorkerState.READY)
    timer = threading.Timer(0.1, segment.bump_epoch)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(PeerGone) as e:
        segment.event_queue.wait_readable(None, epoch=epoch)  # no timeout: only the peer check ends it
    timer.join()  # it may still be marking the state: the fixture closes the segment next
    assert e.value.epoch == epoch + 1 and time.monotonic() - t0 < 5


@pytest.mark.parametrize("state", [WorkerState.DEAD, WorkerState.STOPPED, WorkerState.GAVE_UP])
def test_a_dead_worker_ends_the_wait(segment, state):
    epoch = segment.bump_epoch(WorkerState.READY)
    timer = threading.Timer(0.05, segment.set_worker_state, args=(state,))
    timer.start()
    with pytest.raises(PeerGone) as e:
        segment.event_queue.wait_readable(None, epoch=epoch)
    timer.join()
    assert e.value.state == state


def test_a_killed_worker_ends_the_wait_even_unmarked(segment):
    # No daemon marks it: the waiter sees the worker's pid is gone.
    epoch = segment.bump_epoch(WorkerState.READY)
    proc = FORK.Process(target=time.sleep, args=(60,))
    proc.start()
    segment.header.worker_pid = proc.pid
    threading.Timer(0.1, os.kill, args=(proc.pid, signal.SIGKILL)).start()
    threading.Timer(0.2, proc.join).start()  # reap, so the pid is really gone
    with pytest.raises(PeerGone):
        segment.event_queue.wait_readable(30, epoch=epoch)
    proc.join()


def test_stop_request_ends_a_watching_wait(segment):
    epoch = segment.bump_epoch(WorkerState.READY)
    threading.Timer(0.05, segment.request_stop).start()
    with pytest.raises(StopRequested):
        segment.plan_queue.wait_readable(None, epoch=epoch, watch_stop=True)


def test_waits_already_gone_return_at_once(segment):
    epoch = segment.bump_epoch(WorkerState.READY)
    segment.bump_epoch()
    with pytest.raises(PeerGone):
        segment.event_queue.wait_readable(10, epoch=epoch)


# ------------------------------------------------------------ two processes

N_MESSAGES = 1_000_000


def _producer(name: str, n: int, out) -> None:
    seg = Segment.open(name, 0)
    q = seg.plan_queue
    full = 0
    for i in range(n):
        slot = q.try_reserve()
        if slot is None:
            full += 1
            q.wait_writable(30)
            slot = q.try_reserve()
        slot[16:32] = i.to_bytes(8, "little") + (i ^ 0x5A5A5A5A5A5A5A5A).to_bytes(8, "little")
        q.publish()
    out.put(full)
    seg.close()


def test_a_million_messages_between_two_processes(seg_name):
    """No loss, duplicate or reorder across ≥1M messages, with the queue
    wrapping ~125,000 times and the producer meeting a full queue."""
    seg = Segment.create(seg_name, 0, SegmentConfig(plan_slots=8, plan_slot_bytes=64, event_slot_bytes=64,
                                                    op_slot_bytes=64, stream_slots=2, prompt_tokens=16,
                                                    emit_tokens=16, logits_floats=16))
    out = FORK.SimpleQueue()
    proc = FORK.Process(target=_producer, args=(seg_name, N_MESSAGES, out))
    proc.start()
    q = seg.plan_queue
    try:
        for expect in range(N_MESSAGES):
            slot = q.try_peek()
            if slot is None:
                q.wait_readable(30)
                slot = q.try_peek()
            got = slot[16:32].tobytes()
            q.release()
            if got != expect.to_bytes(8, "little") + (expect ^ 0x5A5A5A5A5A5A5A5A).to_bytes(8, "little"):
                pytest.fail(f"message {expect}: got {got.hex()}")
        assert q.try_peek() is None  # nothing extra
        assert q.head == q.tail == N_MESSAGES
        full = out.get()
    finally:
        proc.join(60)
        seg.close()
        seg.unlink()
    assert proc.exitcode == 0
    assert full > 0, "the producer never met a full queue: back-pressure untested"


def _futex_waiter(name: str, out) -> None:
    seg = Segment.open(name, 0)
    word = ffi.cast("uint32_t *", ffi.addressof(seg.header, "latency_wanted"))
    t0 = time.monotonic()
    r = lib.sf_futex_wait(word, 0, int(20e9))
    out.put((r, time.monotonic() - t0, seg.latency_wanted))
    seg.close()


def test_futex_wake_across_processes(segment, seg_name):
    out = FORK.SimpleQueue()
    proc = FORK.Process(target=_futex_waiter, args=(seg_name, out))
    proc.start()
    # Until the child really sleeps in the futex (else it would see the store and
    # never sleep, and no wake would be tested).
    deadline = time.monotonic() + 10
    while "futex" not in _wchan(proc.pid):
        assert time.monotonic() < deadline, f"the child never slept on the futex ({_wchan(proc.pid)!r})"
        time.sleep(0.01)
    segment.latency_wanted = True
    woken = lib.sf_futex_wake(ffi.cast("uint32_t *", ffi.addressof(segment.header, "latency_wanted")), 1)
    r, waited, seen = out.get()
    proc.join(10)
    assert r == 0 and seen and waited < 10  # woken, not timed out (20 s)
    assert woken == 1


def _wchan(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return f.read()
    except OSError:
        return ""


def _ponger(name: str, rounds: int) -> None:
    seg = Segment.open(name, 0)
    for _ in range(rounds):
        # spin 0: every wait sleeps on the futex; no peer checks, so a lost
        # wake-up would be a 10 s timeout here, not a hidden slice.
        seg.plan_queue.wait_readable(10, spin_ns=0)
        v = _get(seg.plan_queue)
        seg.event_queue.wait_writable(10, spin_ns=0)
        _put(seg.event_queue, v + 1)
    seg.close()


def test_no_lost_wakeups_in_ping_pong(segment, seg_name):
    rounds = 3000
    proc = FORK.Process(target=_ponger, args=(seg_name, rounds))
    proc.start()
    try:
        for i in range(rounds):
            _put(segment.plan_queue, i)
            segment.event_queue.wait_readable(10, spin_ns=0)
            assert _get(segment.event_queue) == i + 1
    finally:
        proc.join(30)
    assert proc.exitcode == 0


def _sleeping_consumer(name: str, out) -> None:
    seg = Segment.open(name, 0)
    t0 = time.monotonic()
    r = lib.sf_queue_wait_readable(seg.event_queue._view, ffi.NULL, 0, 0, int(20e9), 0)
    out.put((r, time.monotonic() - t0))
    seg.close()


def test_publish_wakes_a_consumer_asleep_in_another_process(segment, seg_name):
    out = FORK.SimpleQueue()
    proc = FORK.Process(target=_sleeping_consumer, args=(seg_name, out))
    proc.start()
    deadline = time.monotonic() + 10
    while not segment.event_queue._view.q.consumer_sleeping and time.monotonic() < deadline:
        time.sleep(0.01)
    assert segment.event_queue._view.q.consumer_sleeping == 1
    _put(segment.event_queue, 1)
    r, waited = out.get()
    proc.join(10)
    assert r == WaitResult.READY and waited < 10


def test_a_stray_publish_or_release_moves_nothing(segment):
    q = segment.op_queue
    with pytest.raises(RuntimeError, match="nothing was peeked"):
        q.release()
    assert (q.head, q.tail) == (0, 0)
    for i in range(q.n_slots):
        q.try_reserve()[:1] = bytes([i])
        q.publish()
    with pytest.raises(RuntimeError, match="nothing was reserved"):
        q.publish()  # full: it would overwrite the oldest unread message
    assert len(q) == q.n_slots and bytes(q.try_peek()[:1]) == b"\x00"


def test_timeouts_negative_nan_and_none(segment):
    q = segment.plan_queue
    t0 = time.monotonic()
    with pytest.raises(QueueTimeout, match="nothing"):
        q.peek(-1.0)  # negative: a poll
    assert time.monotonic() - t0 < 1
    with pytest.raises(ValueError, match="NaN"):
        q.peek(float("nan"))
    for _ in range(q.n_slots):
        q.try_reserve()
        q.publish()
    with pytest.raises(QueueTimeout, match="no room"):
        q.reserve(0.01)


def test_a_long_wait_lets_a_signal_handler_run(segment):
    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted

    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        t0 = time.monotonic()
        with pytest.raises(Interrupted):
            segment.plan_queue.peek(None, spin_ns=0)  # no deadline at all
        assert time.monotonic() - t0 < 5
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
