"""contract §10 against a live daemon: what a hostile or buggy planner writes
into a segment never stops the worker or the daemon, and no session sees
another's replies. Each attack here was a way to lock, stall or kill a
worker before sessions, the daemon's channel and the queue guards."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import msgpack
import pytest

from superfluid.abi import PLAN_SEQ_MAX, MsgKind, OpStatus, QueueKind, Status, WorkerState, codec, ffi
from superfluid.client import Client, PlanBuilder
from superfluid.client.planner import Planner
from superfluid.client.session import ClientTimeout
from superfluid.daemon.status import read_status
from superfluid.rings.naming import shm_dir
from superfluid.rings.segment import Segment
from superfluid.testing.daemon import WAIT_S, Serve, start_fake, state_of, wait_for


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Serve:
    s = start_fake(tmp_path_factory, "pb")
    try:
        yield s
    finally:
        s.close()


def connect(d: Serve, **kw) -> Client:
    return Client.connect(d.name, 0, timeout=WAIT_S, **kw)


def hostile(d: Serve) -> Segment:
    """The segment as any process of the daemon's user can map it: no lock, no session."""
    return Segment.open(d.name, 0)


def alive(d: Serve) -> int:
    """The worker answers a plan (a new session each time); its pid."""
    with connect(d) as c:
        ev = c.tick(PlanBuilder(0))
        assert ev.status == Status.OK, ev
        return int(c.seg.header.worker_pid)


def solo(d: Serve, prompt: list[int], n: int) -> list[int]:
    with connect(d) as c:
        p = Planner(c, reconnect_timeout=WAIT_S)
        rid = p.submit(prompt, n, stop_at_eos=False)
        return p.run_until_done(WAIT_S).results[rid].tokens


def test_plan_seq_has_a_range_and_no_value_locks_the_worker(daemon):
    with connect(daemon) as c:
        with pytest.raises(ValueError, match="SF_PLAN_SEQ_MAX"):
            c.submit(PlanBuilder(PLAN_SEQ_MAX + 1))
        # Past the client's check, straight into the queue: a reject naming the field.
        slot = c.seg.plan_queue.reserve(5)
        codec.encode_into(slot, "TickPlan", PlanBuilder((1 << 64) - 1).build(), session=c.session)
        c.seg.plan_queue.publish()
        c._inflight.add((1 << 64) - 1)
        ev = c.wait_events(WAIT_S)
        assert ev.status == Status.RejectBounds and b"plan_seq" in ev.message
        assert c.tick(PlanBuilder(PLAN_SEQ_MAX)).status == Status.OK  # the top of the range is a plan
        c._next_seq = 5
        assert c.tick(PlanBuilder(0)).status == Status.RejectIllegalCombination  # this session is at the top...
    with connect(daemon) as c:  # ...and the next session starts afresh
        assert c.next_plan_seq() == 1 and c.tick(PlanBuilder(0)).status == Status.OK


def test_a_new_session_never_gets_an_earlier_sessions_replies(daemon):
    prompt = [5, 6, 7, 8, 9]
    want = solo(daemon, prompt, 12)
    stale0 = state_of(daemon.name)["stale_messages"]
    # Session A: one plan in flight (a long decode) and more queued behind it; then it dies.
    a = connect(daemon)
    tag = a.new_lane_tag()
    first = a.submit(PlanBuilder(0, prefill_token_budget=64).admit(tag, a.write_prompt(prompt)).prefill(
        tag, 0, len(prompt)).decode(tag, 200))
    wait_for(lambda: len(a.seg.plan_queue) == 0, "the first plan in flight")
    # Held still while A queues and dies and B begins: otherwise a quick first plan lets the
    # worker run A's queue in A's own session, and nothing is stale (a timing race, not a test).
    worker = int(a.seg.header.worker_pid)
    os.kill(worker, signal.SIGSTOP)
    try:
        queued = [a.submit(PlanBuilder(0).admit(a.new_lane_tag(), a.write_prompt(prompt))) for _ in range(5)]
        a.close()
        b = connect(daemon)
    finally:
        os.kill(worker, signal.SIGCONT)
    # Session B picks plan_seq 1 again, as A did: A's reply to plan 1 must not pass for B's.
    with b:
        assert first == 1 and b.next_plan_seq() == 1 and queued
        p = Planner(b, reconnect_timeout=WAIT_S)
        rid = p.submit(prompt, 12, stop_at_eos=False)
        rep = p.run_until_done(WAIT_S)
        assert rep.results[rid].tokens == want  # the same tokens as alone: nothing of A's leaked in
        lanes = b.list_lanes()
        a_lanes = [ln for ln in lanes if ln["session"] == a.session]
        # A's queued plans were answered stale, unrun: only its in-flight plan admitted a lane.
        assert len(a_lanes) == 1 and state_of(daemon.name)["stale_messages"] - stale0 == len(queued)
        assert b.retire_lanes(all=True) == len(lanes)


def test_stop_requested_written_by_a_planner_stops_nothing(daemon):
    pid = alive(daemon)
    with hostile(daemon) as h:
        h.request_stop()
        time.sleep(0.3)
        assert alive(daemon) == pid  # the worker does not read it
        # And a restart after it: the daemon clears it, the new worker serves.
        os.kill(pid, 9)
        wait_for(lambda: (state_of(daemon.name) or {}).get("pid") not in (None, pid, 0)
                 and state_of(daemon.name)["state"] == "READY", "the restarted worker")
        assert not h.stop_requested
    assert alive(daemon) != pid and daemon.proc.poll() is None
    assert "stop_requested was set" in daemon.log


def test_worker_state_and_epoch_written_by_a_planner_are_put_back(daemon):
    pid = alive(daemon)
    with hostile(daemon) as h:
        epoch = h.epoch
        h.set_worker_state(WorkerState.DEAD)
        h.bump_epoch(WorkerState.DEAD)
        wait_for(lambda: h.epoch == epoch and h.worker_state == WorkerState.READY, "the worker's report back", 5)
    assert alive(daemon) == pid  # the same process: it did not leave


def test_a_corrupted_queue_geometry_is_rebuilt(daemon):
    pid = alive(daemon)
    with hostile(daemon) as h:
        q = h.header.layout.plan_queue
        ffi.cast("Queue *", ffi.cast("char *", h.header) + q).n_slots = 3
    with pytest.raises(Exception, match="plan queue"):
        Segment.open(daemon.name, 0).close()  # a planner refuses it while it is wrong
    wait_for(lambda: _opens(daemon), "the worker to put the geometry back", 5)
    assert alive(daemon) == pid
    # The same scribble, then a worker exit: the daemon repairs before the restart.
    with hostile(daemon) as h:
        ffi.cast("Queue *", ffi.cast("char *", h.header) + h.header.layout.event_queue).slot_bytes = 100
        os.kill(pid, 9)
    wait_for(lambda: _opens(daemon) and (state_of(daemon.name) or {}).get("state") == "READY"
             and state_of(daemon.name)["pid"] != pid, "the restarted worker")
    assert alive(daemon) != pid and "event queue slot_bytes was 100" in daemon.log


def _opens(d: Serve) -> bool:
    try:
        Segment.open(d.name, 0).close()
        return True
    except Exception:
        return False


def test_a_tail_moved_past_its_head_is_reset_and_reported(daemon):
    pid = alive(daemon)
    with connect(daemon) as c:
        rejects = state_of(daemon.name)["rejects"]
        with hostile(daemon) as h:
            tail = ffi.addressof(ffi.cast("Queue *", ffi.cast("char *", h.header) + h.header.layout.plan_queue),
                                 "tail")
            tail[0] = h.plan_queue.head + 5  # tail past head: ~2^64 "messages"
        wait_for(lambda: c.seg.plan_queue.sane(), "the worker's reset", 5)
        assert c.tick(PlanBuilder(0)).status == Status.OK  # it serves on
        assert [r.queue for r in c.queue_resets] == [int(QueueKind.PLAN)]
        assert state_of(daemon.name)["rejects"] == rejects  # no garbage run as plans
    assert _opens(daemon) and alive(daemon) == pid


def test_ops_cannot_kill_the_worker_and_their_errors_are_bounded(daemon):
    pid = alive(daemon)
    with connect(daemon) as c:
        ids = []
        for i in range(20):
            ids.append(1000 + i)
            body = msgpack.packb({"op": "X" * 60_000, "op_id": 1000 + i})
            c.seg.op_queue.send_bytes(MsgKind.OP, body, timeout=WAIT_S, session=c.session)
        deadline = time.monotonic() + WAIT_S
        while not all(i in c._completions for i in ids):
            c._pump(max(0.0, deadline - time.monotonic()))
        for i in ids:
            done = c._completions.pop(i)
            assert done.status == OpStatus.UnknownOp and len(done.payload) < 300
        # Not msgpack, not a map, fields of the wrong type: answers, not exits.
        for body in (b"\xc1" * 100, msgpack.packb([1, 2]), msgpack.packb({"op": "LEASE_SEED", "tokens": "x" * 50_000})):
            c.seg.op_queue.send_bytes(MsgKind.OP, body, timeout=WAIT_S, session=c.session)
        time.sleep(0.2)
        assert c.op("DESCRIBE").status == OpStatus.OK
    assert alive(daemon) == pid


def test_a_planner_that_stops_reading_blocks_only_itself(daemon):
    pid = alive(daemon)
    with connect(daemon) as c:
        sent = []
        while True:  # until the plan queue is full too: the worker waits on us
            try:
                sent.append(c.submit(PlanBuilder(0), timeout=0.5))
            except ClientTimeout:
                break
        assert len(sent) >= c.seg.event_queue.n_slots + c.seg.plan_queue.n_slots
        wait_for(lambda: (state_of(daemon.name) or {}).get("blocked_on_planner_s") is not None,
                 "status to show the worker blocked", 10)
        time.sleep(0.5)
        w = state_of(daemon.name)
        assert w["state"] == "READY" and w["heartbeat_age_s"] < 0.5 and w["blocked_on_planner_s"] > 0.3
        st = read_status(daemon.name)
        assert st is not None
        from superfluid.daemon.status import format_status

        assert "blocked on its planner" in format_status(st)
        # Reading again: every plan's events, in order, nothing lost or overwritten.
        got = [c.wait_events(WAIT_S) for _ in sent]
        assert [ev.plan_seq for ev in got] == sent and all(ev.status == Status.OK for ev in got)
        wait_for(lambda: state_of(daemon.name)["blocked_on_planner_s"] is None, "the block to clear", 5)
        assert c.op("DESCRIBE").status == OpStatus.OK
    assert alive(daemon) == pid


def test_lanes_a_dead_planner_left_are_listed_and_retired(daemon):
    with connect(daemon) as a:
        tags = [a.new_lane_tag() for _ in range(3)]
        b = PlanBuilder(0, prefill_token_budget=64)
        for t in tags:
            b.admit(t, a.write_prompt([1, 2, 3])).prefill(t, 0, 3)
        assert a.tick(b).status == Status.OK
        a_session = a.session
    with connect(daemon, lanes="keep") as c:
        left = {ln["tag"]: ln for ln in c.list_lanes()}
        assert set(tags) <= set(left) and all(left[t]["session"] == a_session for t in tags)
        assert all(left[t]["state"] == "decoding" and left[t]["prompt"] == 3 for t in tags)
        again = c.tick(PlanBuilder(0).admit(tags[0], c.write_prompt([1])))
        assert again.status != Status.OK and b"live" in again.message  # still A's lane
        assert c.retire_lanes(tags[:1]) == 1
        assert c.tick(PlanBuilder(0).admit(tags[0], c.write_prompt([1]))).status == Status.OK
    with connect(daemon, lanes="retire") as c:
        assert c.list_lanes() == []
        assert state_of(daemon.name)["live_lanes"] == 0


def test_stale_segments_of_another_owner_are_named_and_left(tmp_path: Path):
    if os.geteuid() != 0:
        pytest.skip("needs root to make a file of another owner")
    name = f"so{os.getpid()}"
    theirs = os.path.join(shm_dir(), f"superfluid.{name}.3")
    with open(theirs, "wb") as f:
        f.write(b"not ours")
    os.chown(theirs, 4242, 4242)
    s = Serve(tmp_path, name, "--fake")
    try:
        s.wait_log("worker 0 ready (epoch 1")
        assert os.path.exists(theirs) and f"stale segment {theirs} belongs to uid 4242" in s.log
    finally:
        s.close()
        if os.path.exists(theirs):
            os.unlink(theirs)


def test_header_values_no_daemon_or_worker_writes_are_survived(daemon):
    # An unknown state, counters at their maximum, the epoch about to wrap: read,
    # counted and restarted past without an exception in the worker or the daemon.
    pid = alive(daemon)
    with hostile(daemon) as h:
        h.header.worker_state = 99
        h.header.restarts = (1 << 32) - 1
        h.header.counters.stale_messages = (1 << 64) - 1
        h.header.counters.queue_resets = (1 << 64) - 1
        h.set_epoch((1 << 64) - 1)
        wait_for(lambda: h.worker_state == WorkerState.READY, "the worker's report back", 5)
        assert read_status(daemon.name)["workers"][0]["state"] == "READY"
        with connect(daemon) as c:  # a stale op and plan: counted by the worker, not by += on the header
            body = msgpack.packb({"op": "DESCRIBE", "op_id": 1})
            c.seg.op_queue.send_bytes(MsgKind.OP, body, timeout=WAIT_S, session=c.session + 1)
            assert c.tick(PlanBuilder(0)).status == Status.OK
            assert int(c.seg.header.worker_pid) == pid  # the same worker all along
        h.set_epoch((1 << 64) - 1)
        os.kill(pid, 9)
        wait_for(lambda: (state_of(daemon.name) or {}).get("state") == "READY"
                 and state_of(daemon.name)["pid"] != pid, "the restarted worker")
        assert h.epoch < (1 << 63)  # the daemon's own count, not the scribble plus one
    assert alive(daemon) != pid and daemon.proc.poll() is None


def test_a_scribbled_runtime_description_is_put_back(daemon):
    pid = alive(daemon)
    with hostile(daemon) as h:
        want = h.runtime
        h.header.runtime.vocab_size = 7
        h.header.runtime.flags = 0xFFFF
        wait_for(lambda: h.runtime == want, "the worker to put its description back", 5)
    assert alive(daemon) == pid
