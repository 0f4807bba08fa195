"""The planner's connection to one worker: plans out, events in, ops, rings.

`Client` wraps a worker's segment (contract §1) with the waits a planner needs:
every wait has a timeout, watches the worker's epoch, and a worker that died
or was replaced surfaces as one exception, `WorkerRestarted`, from whichever
wait noticed it. After `reconnect()` the client talks to the new worker; the
planner then re-admits its lanes (contract §9).

One client per segment: the queues are single-producer single-consumer, and
the client is the plan/op producer and the event/stream consumer. Connecting
follows the header's protocol (abi/superfluid.h, "sessions"): the exclusive
lock, a futex wait for READY, and a new session, so no reply to an earlier
planner's plan or op is ever taken for this one's.

    with Client.connect("mydaemon") as c:
        prompt = c.write_prompt([1, 15, 27, 4])
        ev = c.tick(PlanBuilder(0, prefill_token_budget=64).admit(7, prompt).prefill(7, 0, 4).decode(7, 8))
        print(c.tokens(ev.emits[0]))
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import time
from typing import Any

import msgpack
import numpy as np

from superfluid.abi import PLAN_SEQ_MAX, MsgKind, OpStatus, WorkerState, codec
from superfluid.abi.records import (
    LaneCommit,
    LaneEmit,
    OpCompletion,
    OpEvents,
    PartialEmit,
    RingRef,
    TickEvents,
    TickPlan,
    WorkerNotice,
)
from superfluid.client.builder import PlanBuilder
from superfluid.client.describe import Parallel, parallel_of
from superfluid.client.session import (
    ClientError,
    ClientTimeout,
    PidWatch,
    WorkerRestarted,
    lock_planner,
    wait_ready,
)
from superfluid.rings.errors import PeerGone, SegmentError
from superfluid.rings.queue import QueueTimeout, SlotQueue
from superfluid.rings.segment import Segment

DEFAULT_TIMEOUT = 30.0
log = logging.getLogger("superfluid.client")
_POLL_S = 0.005  # how often connect looks for a segment that is not there yet
_LIVENESS_SLICE_S = 0.5  # a long wait looks at the worker's pid this often
_GONE_STATES = frozenset((WorkerState.STOPPED, WorkerState.DEAD, WorkerState.GAVE_UP))
_NOTICES = frozenset((MsgKind.WORKER, MsgKind.RESET))
_decode_events = codec.fast_decoder("TickEvents")
_session_of = codec.session_of


class Client:
    """A planner's view of one worker. Use `Client.connect`."""

    def __init__(self, seg: Segment, epoch: int, *, timeout: float = DEFAULT_TIMEOUT, session: int = 0):
        self.seg = seg
        self.epoch = epoch
        self.session = session  # stamped on every plan and op; replies of other sessions are dropped
        self.where = seg.path  # for log lines (the header's name and index are anyone's to scribble on)
        self._lock: int | None = None  # the fd whose flock says this worker has its planner
        self.timeout = timeout  # the default for every wait
        self.desc = seg.runtime
        self._next_seq = 1  # plan_seq starts afresh in every session
        self._op_ids = itertools.count(1)
        # Apart from every earlier session's (their lanes may still be live
        # there: LIST_LANES), by the session id; without one, by the pid.
        self._lane_tags = itertools.count((((session or os.getpid()) & 0xFFFFFFFF) << 32) + 1)
        self._ready: collections.deque[TickEvents] = collections.deque()  # read while waiting for others
        self._completions: dict[int, OpCompletion] = {}  # op_id -> completion, until op() takes it
        self._inflight: set[int] = set()  # plan_seqs sent to this epoch and not yet answered
        self._stale: set[int] = set()  # plan_seqs sent to an earlier epoch (a new worker may still run them)
        self._orphans: set[int] = set()  # lanes a stale plan admitted on the new worker
        self._early: list[TickEvents | OpEvents] = []  # messages of a newer epoch, read before reconnect
        self.queue_resets: collections.deque = collections.deque(maxlen=64)  # the worker found a queue corrupted
        self._describe: dict[str, Any] | None = None
        self._pid_watch = PidWatch(0)  # the header's worker_pid, watched (reopened when it changes)
        self._drain_stale()

    # ------------------------------------------------------------ lifecycle

    @classmethod
    def connect(cls, name: str, index: int = 0, timeout: float = DEFAULT_TIMEOUT, *,
                lanes: str = "keep") -> Client:
        """Open worker `index` of daemon `name`, take it, wait until it is
        READY (the segment may not exist yet: a planner may start first) and
        begin a session. `lanes`: what to do with lanes earlier sessions left
        live: "keep" them (LIST_LANES shows them) or "retire" them."""
        if lanes not in ("keep", "retire"):
            raise ValueError(f"lanes = {lanes!r}: 'keep' or 'retire'")
        deadline = time.monotonic() + timeout
        said = False
        while True:
            try:
                seg = Segment.open(name, index)
                break
            except SegmentError as e:
                if time.monotonic() > deadline:
                    raise
                if not said:
                    log.info("waiting up to %.0f s for worker %d of daemon %r (%s)", timeout, index, name, e)
                    said = True
                time.sleep(_POLL_S)
        lock = None
        try:
            lock = lock_planner(seg, name, index)
            epoch = wait_ready(seg, after=None, deadline=deadline)
            client = cls(seg, epoch, timeout=timeout, session=seg.begin_session())
            client._lock = lock
            if lanes == "retire":
                client.retire_lanes(all=True)
            return client
        except BaseException:
            if lock is not None:
                os.close(lock)
            seg.close()
            raise

    def reconnect(self, timeout: float | None = None) -> int:
        """After WorkerRestarted: wait for the next worker to be READY and
        talk to it. Returns its epoch. What the old worker had (lanes, host
        rows, leases, handles) is gone; plan_seq keeps increasing."""
        deadline = time.monotonic() + self._t(timeout)
        epoch = wait_ready(self.seg, after=self.epoch, deadline=deadline)
        self.epoch = epoch
        self.desc = self.seg.runtime
        self._describe = None
        # Plans still in the plan queue reach the new worker (it accepts any
        # first plan_seq); their events must not pass for answers to new plans.
        self._stale |= self._inflight
        self._inflight.clear()
        self._ready.clear()
        self._orphans.clear()  # they were the old worker's
        early, self._early = self._early, []
        for msg in early:
            self._file(msg)
        self._drain_stale()
        return epoch

    def close(self) -> None:
        self._pid_watch.close()
        self.seg.close()
        if self._lock is not None:
            os.close(self._lock)  # another planner may connect now
            self._lock = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _t(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    # --------------------------------------------------------- worker checks

    def _gone(self, *, epoch: int | None = None, notice: WorkerNotice | None = None) -> WorkerRestarted:
        seg = self.seg
        now = seg.epoch if epoch is None else max(epoch, seg.epoch)
        if notice is not None:
            return WorkerRestarted(max(now, notice.worker_epoch), self.epoch, notice.worker_state,
                                   exit_status=notice.exit_status, restarts=notice.restarts)
        return WorkerRestarted(now, self.epoch, seg.worker_state)

    def check_worker(self) -> None:
        """Raise WorkerRestarted if the worker of this client's epoch is no
        longer serving (a cheap look at the header; waits do this too)."""
        seg = self.seg
        epoch = seg.epoch
        state = seg.worker_state
        if epoch != self.epoch or state in _GONE_STATES:
            raise self._gone()
        if state == WorkerState.READY and not self._worker_alive(int(seg.header.worker_pid)):
            raise self._gone()

    def _worker_alive(self, pid: int) -> bool:
        w = self._pid_watch
        if w.pid != pid:  # a new worker (or a pid someone wrote there): watch that one
            w.close()
            w = self._pid_watch = PidWatch(pid)
        return w.alive()

    def _wait_slot(self, q: SlotQueue, timeout: float | None, *, write: bool) -> memoryview:
        t = self._t(timeout)
        deadline = time.monotonic() + t
        wait = q.reserve if write else q.peek
        while True:
            # In slices: a worker that died with its daemon (no one to mark it)
            # is noticed within a slice, not at the end of a long timeout.
            left = deadline - time.monotonic()
            try:
                return wait(max(0.0, min(left, _LIVENESS_SLICE_S)), epoch=self.epoch)
            except PeerGone:
                raise self._gone() from None
            except QueueTimeout:
                self.check_worker()
                if left <= _LIVENESS_SLICE_S:
                    raise ClientTimeout(f"{q.name} queue: {'no room' if write else 'nothing'} within {t}s "
                                        f"(worker epoch {self.epoch})") from None

    # ----------------------------------------------------------------- plans

    def next_plan_seq(self) -> int:
        """The plan_seq the next submitted plan gets (when it has none)."""
        return self._next_seq

    def new_lane_tag(self) -> int:
        """A lane tag this client has never handed out (tags are never
        reused, so a stale plan's lane can't be mistaken for a new one)."""
        return next(self._lane_tags)

    def submit(self, plan: TickPlan | PlanBuilder, timeout: float | None = None) -> int:
        """Queue a plan for the worker, waiting while the plan queue is full.
        A plan with plan_seq 0 gets the client's next one; a plan with its own
        must be above every plan_seq sent before. Returns the plan_seq."""
        self.check_worker()  # don't hand a dead worker's queue a plan the next one would run
        record = plan.build() if isinstance(plan, PlanBuilder) else plan
        seq = record.plan_seq or self._next_seq
        if seq < self._next_seq:
            raise ValueError(f"plan_seq {seq}: plans go in increasing order (next is {self._next_seq})")
        if seq > PLAN_SEQ_MAX:
            raise ValueError(f"plan_seq {seq}: above SF_PLAN_SEQ_MAX ({PLAN_SEQ_MAX}); connect again for a new session")
        if seq != record.plan_seq:
            record = record._replace(plan_seq=seq)
        q = self.seg.plan_queue
        slot = q.try_reserve()  # the worker keeps up: a free slot, no wait (check_worker just looked)
        if slot is None:
            slot = self._wait_slot(q, timeout, write=True)
        codec.encode_into(slot, "TickPlan", record, session=self.session)  # a failure publishes nothing
        self.seg.plan_queue.publish()
        self._next_seq = seq + 1
        self._inflight.add(seq)
        return seq

    def wait_events(self, timeout: float | None = None) -> TickEvents:
        """The next TickEvents. Op completions that arrive meanwhile (OpEvents
        or inside the events) are kept for op(). A rejected plan is events
        too: look at `status`."""
        deadline = time.monotonic() + self._t(timeout)
        while not self._ready:
            self._pump(max(0.0, deadline - time.monotonic()))
        return self._ready.popleft()

    def tick(self, plan: TickPlan | PlanBuilder, timeout: float | None = None) -> TickEvents:
        """Submit a plan and wait for its events (events of other plans that
        arrive first stay for wait_events)."""
        deadline = time.monotonic() + self._t(timeout)
        seq = self.submit(plan, timeout)
        while True:
            for i, ev in enumerate(self._ready):
                if ev.plan_seq == seq:
                    del self._ready[i]
                    return ev
            self._pump(max(0.0, deadline - time.monotonic()))

    def _pump(self, timeout: float) -> None:
        """Read one event-queue message and file it: TickEvents to the ready
        list, op completions to their dict; a WorkerNotice or a dead peer is
        WorkerRestarted."""
        q = self.seg.event_queue
        slot = self._wait_slot(q, timeout, write=False)
        try:
            return self._read(slot)
        finally:
            q.try_release()

    def _read(self, slot) -> None:
        """File one message (the slot is released by the caller)."""
        ev = _decode_events(slot)  # the common message first, in one call (None: anything else)
        if ev is not None and _session_of(slot) == self.session and ev.worker_epoch == self.epoch:
            if ev.op_completions:
                self._file_completions(ev.op_completions)
            self._file_events(ev)
            return
        try:
            kind = codec.read_header(slot)[0]
            session = codec.session_of(slot)
            # A reply carries exactly the session it answers (0 only for a planner that
            # began none); notices (0) are for whoever is connected.
            if session != self.session and not (session == 0 and kind in _NOTICES):
                return  # an earlier planner's reply: not ours, whatever its plan_seq or op_id
            if kind == MsgKind.EVENTS:
                msg = codec.decode(slot, "TickEvents")
            elif kind == MsgKind.OP_EVENTS:
                msg = codec.decode(slot, "OpEvents")
            elif kind == MsgKind.RESET:
                reset = codec.decode(slot, "QueueReset")
                log.warning("%s reset its %s queue (head %d, tail %d were impossible)", self.where,
                            _queue_name(reset.queue), reset.head, reset.tail)
                self.queue_resets.append(reset)
                return
            elif kind == MsgKind.WORKER:
                notice = codec.decode(slot, "WorkerNotice")
                if notice.worker_epoch != self.epoch or notice.worker_state in _GONE_STATES:
                    raise self._gone(notice=notice)
                return
            else:
                return  # no business on this queue: dropped
        except codec.CodecError as e:
            # Not what a worker writes: someone scribbled on the slot. Dropped, said.
            log.warning("%s: an event-queue message that does not decode, dropped: %s", self.where, e)
            return
        if msg.worker_epoch > self.epoch:
            # The next worker already answered (a plan sent before the restart):
            # keep it for after reconnect.
            self._early.append(msg)
            raise self._gone(epoch=msg.worker_epoch)
        self._file(msg)

    def _file(self, msg: TickEvents | OpEvents) -> None:
        if msg.worker_epoch < self.epoch:
            return  # a dead worker's answer: its plan is void
        self._file_completions(msg.op_completions)
        if isinstance(msg, TickEvents):
            self._file_events(msg)

    def _file_events(self, ev: TickEvents) -> None:
        if ev.plan_seq in self._stale:
            # A plan sent to the old worker, run by this one: nobody waits for
            # it, but lanes it admitted exist now and must be retired.
            self._stale.discard(ev.plan_seq)
            self._orphans.update(r.lane_tag for r in ev.admit_results)
            return
        self._inflight.discard(ev.plan_seq)
        self._ready.append(ev)

    def _file_completions(self, completions) -> None:
        for c in completions:
            self._completions[c.op_id] = c

    def _drain_stale(self) -> None:
        """File what is already queued without waiting (at connect: earlier
        clients' leftovers; at reconnect: the old worker's)."""
        q = self.seg.event_queue
        while q.try_peek() is not None:
            try:
                self._pump(0.0)
            except WorkerRestarted:
                pass  # a notice about the restart we are handling
        self._ready.clear()  # nobody asked for these
        self.partial_emits()

    def take_orphans(self) -> set[int]:
        """Lane tags that plans sent before a restart admitted on the new
        worker (the planner did not mean them there): retire them."""
        out, self._orphans = self._orphans, set()
        return out

    # ------------------------------------------------------------------ ops

    def op(self, name: str, timeout: float | None = None, **fields: Any) -> OpCompletion:
        """Run op `name` (contract §7, e.g. "DESCRIBE", "INJECT_FAULT") and wait
        for its completion, whether it comes between ticks (OpEvents) or in a
        tick's events (those events stay for wait_events/tick)."""
        deadline = time.monotonic() + self._t(timeout)
        self.check_worker()
        op_id = next(self._op_ids)
        payload = msgpack.packb({"op": name, "op_id": op_id, **fields})
        try:
            self.seg.op_queue.send_bytes(MsgKind.OP, payload, timeout=self._t(timeout), epoch=self.epoch,
                                         session=self.session)
        except PeerGone:
            raise self._gone() from None
        except QueueTimeout:
            raise ClientTimeout(f"op queue: no room within {self._t(timeout)}s") from None
        while op_id not in self._completions:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ClientTimeout(f"op {name} (op_id {op_id}): no completion within {self._t(timeout)}s")
            self._pump(left)
        return self._completions.pop(op_id)

    def _op_ok(self, name: str, timeout: float | None = None, **fields: Any) -> tuple[OpCompletion, dict]:
        done = self.op(name, timeout, **fields)
        body = msgpack.unpackb(done.payload, raw=False, strict_map_key=False) if done.payload else {}
        if done.status != OpStatus.OK:
            raise ClientError(f"{name} failed: {OpStatus(done.status).name}: {body.get('error', '')}")
        return done, body

    def list_lanes(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """Op LIST_LANES, every page: the live and faulted lanes, with the
        session that admitted each."""
        out: list[dict[str, Any]] = []
        after = 0
        while True:
            _, body = self._op_ok("LIST_LANES", timeout, after=after, limit=1024)
            out += body["lanes"]
            if not body.get("more") or not body["lanes"]:
                return out
            after = body["lanes"][-1]["tag"]

    def retire_lanes(self, tags=None, *, all: bool = False, publish: bool = False,
                     timeout: float | None = None) -> int:
        """Op RETIRE_LANES: end `tags`, or `all` lanes; how many ended."""
        fields: dict[str, Any] = {"publish": publish}
        if all:
            fields["all"] = True
        else:
            fields["tags"] = [int(t) for t in tags or ()]
        done, _ = self._op_ok("RETIRE_LANES", timeout, **fields)
        return int(done.value)

    def describe(self, timeout: float | None = None) -> dict[str, Any]:
        """Op DESCRIBE: the runtime description, EOS ids and special tokens
        (kept until the worker changes)."""
        if self._describe is None:
            done = self.op("DESCRIBE", timeout)
            body = msgpack.unpackb(done.payload, raw=False, strict_map_key=False) if done.payload else {}
            if done.status != OpStatus.OK:
                raise ClientError(f"DESCRIBE failed: {OpStatus(done.status).name}: {body.get('error', '')}")
            parallel_of(body)  # a bad layout fails here, not in whoever reads it
            self._describe = body
        return self._describe

    def eos_ids(self) -> frozenset[int]:
        return frozenset(self.describe()["eos"])

    def parallel(self, timeout: float | None = None) -> Parallel:
        """DESCRIBE's `parallel`: the worker's tp degree and node count."""
        return parallel_of(self.describe(timeout))

    # ----------------------------------------------------------------- rings

    def write_prompt(self, tokens) -> RingRef:
        """Put prompt tokens in the prompt ring; the reference an admit takes.
        Good until the ring wraps over it (write it just before the plan)."""
        return self.seg.prompt_ring.write(np.asarray(tokens, dtype=np.uint32))

    def tokens(self, emit: LaneEmit) -> list[int]:
        """The tokens an emit points at (read them before the ring wraps)."""
        if emit.n_tokens == 0:
            return []
        return self.seg.token_ring.read(emit.token_ref).tolist()

    def logits_row(self, emit: LaneEmit) -> np.ndarray:
        """A HOST lane's logits row (float32, vocab_size long)."""
        return self.seg.logits_ring.read(emit.logits_row)

    @staticmethod
    def commit(emit: LaneEmit, token_id: int) -> LaneCommit:
        """The commit of a host-sampled token for the row `emit` carried, to
        go in the next plan: `builder.commit(*client.commit(emit, tok))`."""
        if not emit.logits_nonce:
            raise ValueError(f"lane {emit.lane_tag}: this emit carries no logits row to commit")
        return LaneCommit(emit.lane_tag, int(token_id), emit.logits_nonce)

    def partial_emits(self) -> list[PartialEmit]:
        """Drain the stream queue: tokens as they were sampled, for plans
        with PARTIAL_EMITS."""
        q = self.seg.stream_queue
        out = []
        while (slot := q.try_peek()) is not None:
            try:
                if codec.read_header(slot)[0] == MsgKind.PARTIAL and codec.session_of(slot) == self.session:
                    out.append(codec.decode(slot, "PartialEmit"))
            except codec.CodecError as e:
                log.warning("%s: a stream message that does not decode, dropped: %s", self.where, e)
            finally:
                q.try_release()
        return out


def _queue_name(kind: int) -> str:
    from superfluid.abi import QueueKind

    try:
        return QueueKind(kind).name.lower()
    except ValueError:
        return str(kind)
