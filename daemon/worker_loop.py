"""The worker loop: plans and ops in from the segment, events and partial
emits out, counters kept current for `superfluid status`.

One thread: ops are drained before each plan (their completions ride in
that tick's events); when no plan comes, pending completions go out at once
as an OpEvents message.

Nothing a planner writes into the segment stops this loop (contract §10):
- the daemon's commands come over `Control`, not the header; the header's
  epoch, state and pid are this worker's report, rewritten when wrong;
- messages are served only for the header's session (`session_id`); an
  earlier session's plans and ops are answered StaleSession, unrun;
- impossible queue counters are reset and reported (QueueReset);
- everything going out waits in an outbox (outbox.py): a planner that stops reading
  blocks nothing but its own replies (the heartbeat goes on, ops are served
  as room allows, `blocked_since_ns` says since when).

With a flight recorder (recorder.py, serve --record), each session begun,
op, plan and op flush is recorded before the executor gets it, and the
outcome after.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING

import msgpack

from superfluid.abi import ECHO_BYTES, OpStatus, Status, WorkerState, codec, ffi, lib
from superfluid.abi.plan_codec import PlanReject, decode_plan, empty_plan, plan_seq_of
from superfluid.abi.records import OpCompletion, TickEvents, TickMemCounters
from superfluid.daemon.control import ASKED, Control
from superfluid.daemon.outbox import Outbox, completion_bytes
from superfluid.daemon.record_format import PATH_EMPTY, PATH_TICK, PATH_UNDECODED, message_bytes
from superfluid.executor import Executor
from superfluid.rings.naming import parse_segment_path
from superfluid.rings.queue import SpinBudget

from .worker_report import REPORT_S, WorkerReport

if TYPE_CHECKING:
    from superfluid.daemon.recorder import Recorder

# An idle worker sleeps on the plan queue; ops arrive on another queue, so it
# looks at them this often (an op's completion waits at most this long).
IDLE_SLICE_S = 0.005
# How long the worker spins for its next plan before it sleeps, while its
# planner's turnarounds typically end within twice that (SpinBudget): the
# reference planner reads a tick's events and sends the next plan in 0.5-1 ms
# with ~60 lanes, and a futex wake costs this worker 40-80 us on a VM and the
# planner's publish a syscall. (A planner slower than 4 ms finds it asleep.)
PLAN_SPIN_NS = 2_000_000
_IDLE_SLICE_NS = int(IDLE_SLICE_S * 1e9)
_monotonic = time.monotonic
_sane = lib.sf_queue_sane
_peek_at = lib.sf_queue_peek_at
_wait_peek = lib.sf_queue_wait_peek
_release = lib.sf_queue_release
_now_ns = lib.sf_monotonic_ns
_heads_up = lib.sf_queue_heads_up
_REPORT_NS = int(REPORT_S * 1e9)
_session_of = codec.session_of


def run_empty(ex: Executor, head: tuple[int, int]) -> tuple[TickMemCounters, int] | None:
    """An empty plan through tick_empty: (its memory record, the wall
    nanoseconds), or None where the general path must take it. A replay
    (replay.py) calls this too: it reads the clock where the worker does."""
    t0 = ex.clock()
    mem = ex.tick_empty(*head)
    if mem is None:
        return None
    return mem, ex.clock() - t0


class Stopped(Exception):
    """The daemon asked this worker to stop."""


def _op_id(payload: bytes) -> int:
    """The op_id of an op that will not run, best effort (0 when unreadable)."""
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        op_id = msg.get("op_id", 0) if isinstance(msg, dict) else 0
    except Exception:  # garbage: the planner learns nothing from it anyway
        return 0
    return op_id if isinstance(op_id, int) and not isinstance(op_id, bool) and 0 <= op_id < 1 << 64 else 0


class Worker(WorkerReport):
    def __init__(self, segment, executor: Executor, *, epoch: int, control: Control | None = None,
                 metrics=None, recorder: Recorder | None = None):
        self.seg = segment
        segment.plan_queue.spin = SpinBudget(PLAN_SPIN_NS)
        self.ex = executor
        self.epoch = epoch
        self.control = control or Control()
        self.metrics = metrics
        self.pid = os.getpid()
        self.session = 0  # the session being served (its messages' MsgHeader.session)
        self.stale_messages = 0  # plans and ops of earlier sessions answered stale
        self.queue_resets = 0
        self._comp_session = 0  # whose ops the pending completions answer
        self._geometry_at = self._reported_at = 0.0
        self._due_ns = 0  # when the loop next looks at the daemon's channel, every queue and the header
        self._gauges: tuple | None = None  # what metrics.gauges was last told
        self._gate_seen = 0  # the spec gate's `changes` when metrics.spec_gate was last told
        h = segment.header
        self._epoch_p = ffi.addressof(h, "worker_epoch")
        self._state_p = ffi.addressof(h, "worker_state")
        self._session_p = ffi.addressof(h, "session_id")
        self._counters_mv = memoryview(ffi.buffer(ffi.addressof(h, "counters"), ffi.sizeof("WorkerCounters")))
        self._plan_view = segment.plan_queue._view
        self._op_view = segment.op_queue._view
        # Started by the daemon (it told us the geometry): the name and index are in
        # the path it gave, the daemon is our parent. What to put back on line 0.
        named = parse_segment_path(segment.path)
        self._identity = None if segment.config is None or named is None else (*named, os.getppid())
        self._desc = executor.desc.to_record()  # what the header's runtime description must say
        self.out = Outbox(segment, epoch, metrics, self._while_blocked)
        self._outbox = self.out.pending  # (the loop asks it "anything waiting?" many times a tick)
        self.slot_bytes = self.out.slot_bytes
        executor.partial_sink = self._partial
        executor.steps_done = self._steps_done
        executor.event_capacity = self.slot_bytes
        self._events_view = segment.event_queue._view
        # The flight recorder (recorder.py): told what the executor is handed, and its answers.
        self.rec = recorder
        if recorder is not None:
            recorder.attach(executor)

    # ------------------------------------------------------------- output

    def _steps_done(self) -> None:
        # The events are ~0.1-1 ms away: a planner asleep for the tick wakes now,
        # while they are built (a wake-up from sleep took it 90 us typically,
        # 2.4 ms at p99, on a 2-core VM), onto the core the runtime's threads
        # leave it.
        self.ex.runtime.idle()
        _heads_up(self._events_view)

    def _partial(self, plan_seq: int, lane_tag: int, token: int, index: int) -> None:
        self.out.partial(self.session, plan_seq, lane_tag, token, index)

    def _flush_ops(self) -> None:
        if self.ex.pending.completions:
            if self.rec is not None:
                self.rec.flush()
            self.out.completions(self.ex.pending.take_completions(), self._comp_session)

    def _while_blocked(self) -> None:
        """The outbox waits for event room: what cannot wait goes on."""
        if self.control.stop_requested():
            raise Stopped()
        self._guard()
        if len(self._outbox) <= 1:  # past that, what ops answer would pile up here unbounded
            self._drain_ops(room=self.slot_bytes)
        self._counters()
        self._report()

    # ------------------------------------------------------------ sessions

    def _current(self, session: int) -> bool:
        """Whether a message of `session` is to be served; a first message of
        the header's new session starts it."""
        if session != lib.sf_load_acquire_u64(self._session_p) or session < self.session:
            return False  # another's, or an id reused after someone wound the header back
        if session != self.session:
            self._flush_ops()  # the last session's completions are its own
            self.session = session
            if self.rec is not None:
                self.rec.session(session)
            self.ex.begin_session(session)
            self.seg.counters.last_plan_seq = 0  # first: the header says it is session_id's (0 before a plan)
            self.seg.counters.session_id = session  # at once: sf_session_begin counts past it
        return True

    def _stale(self, what: str, session: int) -> str:
        self.stale_messages += 1
        self.seg.counters.stale_messages = self.stale_messages  # ours to count: never a += on shared memory
        return (f"{what} of session {session}: session {self.seg.session_id} holds this worker now "
                f"(an earlier planner's message, not run)")

    # ----------------------------------------------------------------- ops

    def _drain_ops(self, room: int | None = None) -> None:
        """Run the queued ops. `room`: stop once the pending completions
        would fill that many bytes (they cannot go out yet)."""
        q = self.seg.op_queue
        stale: dict[int, list] = {}
        pending = sum(map(completion_bytes, self.ex.pending.completions)) if room is not None else 0
        # At most a queue's worth: counters a planner scribbled on could claim 2^64.
        for _ in range(q.n_slots):
            if room is not None and pending >= room:
                break
            if (slot := q.try_peek()) is None:
                break
            self._beat()
            session = codec.session_of(slot)
            try:
                payload = codec.raw_payload(slot)
            except codec.CodecError as e:
                payload = repr(e)[:ECHO_BYTES].encode()  # not msgpack: the op answers BadRequest
            finally:
                q.try_release()  # (False: the planner took it back; it is answered all the same)
            if not self._current(session):
                done = OpCompletion(op_id=_op_id(payload), status=int(OpStatus.StaleSession),
                                    payload=msgpack.packb({"error": self._stale("op", session)}))
                stale.setdefault(session, []).append(done)
            else:
                self._comp_session = session
                rec = self.rec
                if rec is not None:
                    rec.op(payload)
                done = self.ex.op(payload, queue=True)
                if rec is not None:
                    rec.op_done(done)
            pending += completion_bytes(done)
        for session, comps in stale.items():
            self.out.completions(comps, session)

    # --------------------------------------------------------------- plans

    def _plan(self, slot) -> None:
        # The plan queue's view is this loop's alone (one thread; the segment
        # closes only after run() returns): its C calls go straight in.
        self._beat()
        session = _session_of(slot)
        plan = None
        if not self._current(session):
            seq = plan_seq_of(slot)
            _release(self._plan_view)
            ev = TickEvents(plan_seq=seq, status=int(Status.StaleSession), worker_epoch=self.epoch,
                            message=self._stale("plan", session).encode())
        else:
            rec = self.rec  # (None once this plan's PLAN record is written)
            if not self._outbox and not self.ex.pending.completions:
                head = empty_plan(slot)
                if head is not None:
                    if rec is not None:
                        rec.plan(message_bytes(slot), True, [])
                        rec = None
                    if self._empty(head, session):
                        return
            try:
                plan = decode_plan(slot)
            except PlanReject as r:
                seq = plan_seq_of(slot)
                if rec is not None:
                    rec.plan(message_bytes(slot), False, [])  # the replay's decode_plan refuses it alike
                _release(self._plan_view)
                ev = self.ex.reject(seq, r).events
                path = PATH_UNDECODED
            else:
                msg = message_bytes(slot) if rec is not None else b""
                _release(self._plan_view)  # decoded: the planner may queue the next plan now
                if rec is not None:
                    rec.plan_decoded(msg, plan)
                ev = self.ex.tick(plan, decoded=True).events
                path = PATH_TICK
            if self.rec is not None:
                self.rec.done(path, ev)
        self._tick_counters()  # before the events go out: a planner that sees them sees the counters too
        self.out.events(ev, session)
        if plan is not None:
            # The planner's turn: the runtime's threads sleep rather than spin
            # against it for a core (on 2 cores its turnaround took ~15% longer).
            # (Again after steps_done: building the events may have run them.)
            self.ex.runtime.idle()
        if self.rec is not None:
            self.rec.flush_done()  # the tick's outcome, while the planner reads its events
        if self.metrics is not None:
            # After the events, while the planner reads them: a scrape sees the tick ~50 us later.
            self.metrics.tick(plan, ev)
        if self._outbox:
            self.out.flush()

    def _empty(self, head: tuple[int, int], session: int) -> bool:
        """A plan with no lists, answered without decoding a record or
        building events (a planner that keeps time sends many): the same
        state, counters, metrics and event bytes as the general path gives
        it. False, having changed nothing, where the executor needs that path."""
        ex = self.ex
        got = run_empty(ex, head)
        if got is None:
            return False
        _release(self._plan_view)
        mem, wall = got
        if self.rec is not None:
            self.rec.done(PATH_EMPTY, mem)
        self._tick_counters()
        self.out.bare_events(head[0], wall, mem, ex.epoch, session)
        if self.rec is not None:
            self.rec.flush_done()
        if self.metrics is not None:
            self.metrics.tick_empty(wall, mem)
        return True

    def run(self) -> int:
        """Serve until the daemon says stop (0); a fatal runtime error exits
        the process with 70 from inside the executor."""
        seg = self.seg
        seg.header.worker_pid = self.pid
        seg.runtime = self._desc
        self._report()
        plans, ex = seg.plan_queue, self.ex
        plan_view, op_view = self._plan_view, self._op_view
        slots, spin = plans._slots, plans.spin
        # Busy (plans came): spin for the next one as the plan queue's SpinBudget
        # says (the planner's recent turnarounds, so a planner that answers at
        # once finds the worker spinning, not asleep on the futex); idle (a
        # slice passed with no plan): spin 0 and sleep, do not burn a core.
        busy = True
        now = _now_ns()  # the loop's clock: read after each wait and each plan, nowhere else
        try:
            while True:
                # What needs no answer within a tick (the daemon's stop, the
                # other queues' counters, the header's report, the heartbeat)
                # is looked at every REPORT_S, not every plan: a plan pays
                # two C calls here.
                if now >= self._due_ns:
                    self._due_ns = now + _REPORT_NS
                    if self.control.stop_requested():
                        raise Stopped()
                    self._guard()
                    self._report(due=True)
                    self._life_counters(now)
                    self._gate_gauges()
                    start = 0  # (the clock is read again below)
                elif not _sane(plan_view):
                    self._guard(every=False)
                    start = 0
                else:
                    start = now  # a few checks ago: near enough for the budget's running mean
                if _peek_at(op_view) >= 0:
                    self._drain_ops()
                    start = 0
                if ex.pending.completions and _peek_at(plan_view) < 0:
                    self._flush_ops()  # no tick to carry them: answer the ops at once
                if self._outbox:
                    self.out.flush()  # (may wait for event room: the budget counts only the wait below)
                    start = 0
                if busy:
                    if not start:
                        start = _now_ns()
                    i = _wait_peek(plan_view, ffi.NULL, 0, 0, _IDLE_SLICE_NS, spin.spin_ns())
                    now = _now_ns()
                    spin.waited(now - start)
                else:
                    i = _wait_peek(plan_view, ffi.NULL, 0, 0, _IDLE_SLICE_NS, 0)
                    now = _now_ns()
                if i < 0:
                    busy = False
                    self._counters()
                    continue
                busy = True
                if _peek_at(op_view) >= 0:
                    self._drain_ops()
                self._plan(slots[i])
                now = _now_ns()
        except Stopped:
            seg.set_worker_state(WorkerState.STOPPING)
            self._counters_final()
            seg.set_worker_state(WorkerState.STOPPED)
            if self.control.why != ASKED:  # the daemon logs that itself
                print(f"superfluid worker: stopping ({self.control.why or 'asked'})", file=sys.stderr)
            return 0

    def _counters_final(self) -> None:
        c = self.seg.counters
        n = self.ex.counters
        c.ticks, c.rejects, c.tokens_emitted = n.tick_count, n.rejects, n.tokens_emitted
        c.heartbeat_ns = lib.sf_monotonic_ns()


def wait_ready(segment, epoch: int, timeout: float) -> None:
    """Block until the segment's worker of `epoch` is READY."""
    deadline = time.monotonic() + timeout
    while segment.worker_state != WorkerState.READY or segment.epoch != epoch:
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {segment.index} not ready after {timeout}s")
        time.sleep(0.01)
