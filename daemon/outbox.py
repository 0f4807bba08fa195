"""What a worker sends its planner: tick events, op completions (with the
tick or as OpEvents), partial emits and queue resets.

Everything going out waits here when the event queue has no room: a planner
that stops reading blocks only its own replies. While it waits, the worker's
`serve_blocked` callback keeps the heartbeat, ops and the daemon's channel
going (contract §10), and `blocked_since` (WorkerCounters.blocked_since_ns,
the metrics) says since when.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import msgpack

from superfluid.abi import OpStatus, codec, lib
from superfluid.abi.plan_codec import encode_bare_events_into
from superfluid.abi.records import OpCompletion, OpEvents, PartialEmit, TickEvents, TickTimings
from superfluid.rings.queue import QueueTimeout

BLOCKED_SLICE_S = 0.05  # waiting for event room: heartbeat, ops and the daemon this often
PARTIAL_WAIT_S = 1.0  # a partial emit waits this long for room, then is dropped (counted)
_COMPLETION = codec.CODECS["OpCompletion"].size
_OP_EVENTS = codec.MSG_HEADER_BYTES + codec.align(codec.CODECS["OpEvents"].size)
_reserve_at = lib.sf_queue_reserve_at
_publish = lib.sf_queue_publish


def completion_bytes(c: OpCompletion) -> int:
    return _COMPLETION + codec.align(len(c.payload))


class Outbox:
    def __init__(self, segment, epoch: int, metrics, serve_blocked: Callable[[], None]):
        self.seg = segment
        self.epoch = epoch
        self.metrics = metrics
        self.serve_blocked = serve_blocked  # called while a message waits for room (may raise to stop)
        # (name, record, session) in send order; the worker reads it as "anything waiting?"
        self.pending: collections.deque[tuple[str, object, int]] = collections.deque()
        self.blocked_since = 0
        self.partial_dropped = 0
        self._stalled_plan: int | None = None  # the tick whose partial emits found no room
        q = segment.event_queue
        self.slot_bytes = q.slot_bytes
        self._queue, self._view, self._slots = q, q._view, q._slots  # (the worker loop's alone: one thread)

    def partial(self, session: int, plan_seq: int, lane_tag: int, token: int, index: int) -> None:
        # A planner not reading its stream must not stall the tick: wait for room
        # once a tick, then drop (counted) without waiting.
        wait = 0.0 if plan_seq == self._stalled_plan else PARTIAL_WAIT_S
        try:
            self.seg.stream_queue.send("PartialEmit", PartialEmit(plan_seq, lane_tag, token, index), timeout=wait,
                                       session=session)
        except QueueTimeout:
            self.partial_dropped += 1
            self._stalled_plan = plan_seq
            if self.metrics is not None:
                self.metrics.partial_dropped()

    def events(self, ev: TickEvents, session: int) -> None:
        """The tick's events, with as many of its op completions as fit the
        slot; the rest follow as OpEvents. Queued, not sent, behind anything
        waiting: flush() sends."""
        comps = ev.op_completions
        if not comps:
            if not self.pending:  # the common case: straight into a free slot
                i = _reserve_at(self._view)
                if i >= 0:
                    codec.encode_into(self._slots[i], "TickEvents", ev, session=session)
                    if _publish(self._view) == 0:
                        return
            self.pending.append(("TickEvents", ev, session))
            return
        size = len(codec.encode("TickEvents", ev._replace(op_completions=())))
        room = self.slot_bytes - size
        keep = 0
        for c in comps:
            n = completion_bytes(c)
            if n > room:
                break
            room -= n
            keep += 1
        self.pending.append(("TickEvents", ev._replace(op_completions=comps[:keep]) if keep < len(comps) else ev,
                             session))
        if keep < len(comps):
            self.completions(list(comps[keep:]), session, counted=True)  # metrics.tick counted them

    def bare_events(self, plan_seq: int, wall_ns: int, mem, epoch: int, session: int) -> None:
        """An empty plan's events (encode_bare_events_into's bytes), sent now:
        straight into a free slot, else through the queue and a flush."""
        if not self.pending:
            i = _reserve_at(self._view)
            if i >= 0:
                encode_bare_events_into(self._slots[i], plan_seq, wall_ns, mem, epoch, session)
                if _publish(self._view) == 0:
                    return
        self.pending.append(("TickEvents", TickEvents(plan_seq=plan_seq, timings=TickTimings(wall_ns, 0, 0, 0, 0),
                                                      mem=mem, worker_epoch=epoch), session))
        self.flush()

    def completions(self, comps: list, session: int, counted: bool = False) -> None:
        """OpEvents messages, each filling a slot; a completion too big for
        any slot is answered Capacity instead (nothing is dropped silently)."""
        chunk: list = []
        most = self.slot_bytes - _OP_EVENTS
        room = most
        for c in comps:
            n = completion_bytes(c)
            if n > most:
                c = c._replace(status=int(OpStatus.Capacity), handle=0, value=0, payload=msgpack.packb(
                    {"error": f"a completion of {len(c.payload)} bytes does not fit an events slot"}))
                n = completion_bytes(c)
            if n > room and chunk:
                self.pending.append(("OpEvents", OpEvents(worker_epoch=self.epoch, op_completions=tuple(chunk)),
                                     session))
                chunk, room = [], most
            chunk.append(c)
            room -= n
        if chunk:
            self.pending.append(("OpEvents", OpEvents(worker_epoch=self.epoch, op_completions=tuple(chunk)), session))
        if self.metrics is not None and not counted:
            self.metrics.ops(comps)

    def flush(self) -> None:
        """Send what waits, for as long as it takes to find room."""
        q = self._queue
        while self.pending:
            slot = q.try_reserve()
            if slot is None:
                self._blocked()
                try:
                    q.wait_writable(BLOCKED_SLICE_S, spin_ns=0)
                except QueueTimeout:
                    pass
                continue
            name, record, session = self.pending[0]
            codec.encode_into(slot, name, record, session=session)
            if q.try_publish():
                self.pending.popleft()
            else:  # the planner moved its tail back: full again
                self._blocked()
        if self.blocked_since:
            self.blocked_since = 0
            self.seg.counters.blocked_since_ns = 0
            if self.metrics is not None:
                self.metrics.blocked(0)

    def _blocked(self) -> None:
        if not self.blocked_since:
            self.blocked_since = lib.sf_monotonic_ns()
            self.seg.counters.blocked_since_ns = self.blocked_since
            if self.metrics is not None:
                self.metrics.blocked(self.blocked_since)
        self.serve_blocked()
