"""The worker loop: plans and ops in from the segment, events and partial
emits out, counters kept current for `superfluid status`.

One thread: ops are drained before each plan (their completions ride in
that tick's events); when no plan comes, pending completions go out at once
as an OpEvents message. Every wait watches the segment's epoch and stop
flag, so a worker the daemon replaced or stopped leaves on its own.
"""

from __future__ import annotations

import os
import time

from superfluid.abi import WorkerState, codec, lib
from superfluid.abi.records import OpEvents, PartialEmit
from superfluid.engine.plan import PlanReject, decode_plan, encode_events_into, plan_seq_of
from superfluid.executor.executor import Executor
from superfluid.executor.rings import SegmentRings
from superfluid.rings.errors import PeerGone, StopRequested
from superfluid.rings.queue import DEFAULT_SPIN_NS, QueueTimeout

# An idle worker sleeps on the plan queue; ops arrive on another queue, so it
# looks at them this often (an op's completion waits at most this long).
IDLE_SLICE_S = 0.005
PARTIAL_WAIT_S = 1.0  # a partial emit waits this long for room, then is dropped (counted)


class Worker:
    def __init__(self, segment, executor: Executor, *, epoch: int):
        self.seg = segment
        self.ex = executor
        self.epoch = epoch
        self.partial_dropped = 0
        self._stalled_plan: int | None = None  # the tick whose partial emits found no room
        executor.partial_sink = self._partial
        executor.event_capacity = segment.event_queue.slot_bytes

    def _partial(self, plan_seq: int, lane_tag: int, token: int, index: int) -> None:
        # A planner not reading its stream must not stall the tick: wait for room
        # once a tick, then drop (counted) without waiting.
        wait = 0.0 if plan_seq == self._stalled_plan else PARTIAL_WAIT_S
        try:
            self.seg.stream_queue.send("PartialEmit", PartialEmit(plan_seq, lane_tag, token, index), timeout=wait)
        except QueueTimeout:
            self.partial_dropped += 1
            self._stalled_plan = plan_seq

    def _send(self, name: str, record) -> None:
        slot = self.seg.event_queue.reserve(None, epoch=self.epoch, watch_stop=True)
        codec.encode_into(slot, name, record)
        self.seg.event_queue.publish()

    def _flush_ops(self) -> None:
        self._send("OpEvents", OpEvents(worker_epoch=self.epoch, op_completions=tuple(self.ex._take_completions())))

    def _counters(self) -> None:
        c = self.seg.counters
        ex = self.ex
        c.ticks = ex.tick_count
        c.rejects = ex.rejects
        c.last_plan_seq = ex.last_plan_seq or 0
        c.live_lanes = len(ex.lanes)
        c.cache_entries = len(ex.cache)
        c.cache_bytes = ex.cache.resident_bytes
        c.tokens_emitted = ex.tokens_emitted
        if ex.last_fault is not None:
            c.last_fault_lane, c.last_fault_code = ex.last_fault
        c.heartbeat_ns = lib.sf_monotonic_ns()

    def _drain_ops(self) -> None:
        q = self.seg.op_queue
        while (slot := q.try_peek()) is not None:
            try:
                payload = codec.raw_payload(slot)
            except codec.CodecError as e:
                payload = repr(e).encode()  # not msgpack: the op answers BadRequest
            finally:
                q.release()
            self.ex.op(payload, queue=True)

    def _tick(self, slot) -> None:
        try:
            plan = decode_plan(slot)
        except PlanReject as r:
            seq = plan_seq_of(slot)
            self.seg.plan_queue.release()
            self.ex.rejects += 1
            res = self.ex._refused(seq, r.status, r.field, r.message)
        else:
            self.seg.plan_queue.release()  # decoded: the planner may queue the next plan now
            res = self.ex.tick(plan)
        self._counters()  # before the events go out: a planner that sees them sees the counters too
        slot = self.seg.event_queue.reserve(None, epoch=self.epoch, watch_stop=True)
        encode_events_into(slot, res.events)
        self.seg.event_queue.publish()

    def run(self) -> int:
        """Serve until stopped (0) or replaced (0); a fatal runtime error exits
        the process with 70 from inside the executor."""
        seg = self.seg
        seg.header.worker_pid = os.getpid()
        seg.runtime = self.ex.desc.to_record()
        seg.set_worker_state(WorkerState.READY)
        plans = seg.plan_queue
        spin = DEFAULT_SPIN_NS  # right after a tick the next plan often follows: spin for it first
        try:
            while True:
                if seg.stop_requested:  # a wait sees it only when the queue runs dry
                    raise StopRequested("the daemon asked the worker to stop")
                self._drain_ops()
                if self.ex.completions and plans.try_peek() is None:
                    self._flush_ops()  # no tick to carry them: answer the ops at once
                try:
                    slot = plans.peek(IDLE_SLICE_S, epoch=self.epoch, watch_stop=True, spin_ns=spin)
                except QueueTimeout:
                    spin = 0  # idle: sleep, do not burn a core
                    self._counters()
                    continue
                spin = DEFAULT_SPIN_NS
                self._drain_ops()
                self._tick(slot)
        except StopRequested:
            self._counters()
            seg.set_worker_state(WorkerState.STOPPED)
            return 0
        except PeerGone:
            return 0  # the daemon moved on to another epoch: this worker is stale


def wait_ready(segment, epoch: int, timeout: float) -> None:
    """Block until the segment's worker of `epoch` is READY."""
    deadline = time.monotonic() + timeout
    while segment.worker_state != WorkerState.READY or segment.epoch != epoch:
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {segment.index} not ready after {timeout}s")
        time.sleep(0.01)

