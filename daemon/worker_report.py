"""What a worker keeps true in its segment's header (worker_loop.py's
Worker, a mixin): its report fields (epoch, state, pid, session), the
header's geometry and identity, queues whose counters a live peer could
have made, WorkerCounters, and the metrics block's heartbeat and gauges.
A planner can write every byte of the header: each is put back from the
worker's own state, within REPORT_S (contract §10)."""

from __future__ import annotations

import struct
import sys
import time
from typing import TYPE_CHECKING, Any

from superfluid.abi import QueueKind, WorkerState, ffi, lib
from superfluid.abi.records import QueueReset
from superfluid.rings.repair import repair_geometry, repair_identity

if TYPE_CHECKING:
    from superfluid.daemon.outbox import Outbox
    from superfluid.executor import Executor

GEOMETRY_CHECK_S = 1.0  # how often the header's layout and geometry are put back
REPORT_S = 0.01  # how often the header's epoch, state and pid, and all four queues, are looked at
QUEUES = (("plan", QueueKind.PLAN), ("op", QueueKind.OP), ("event", QueueKind.EVENT), ("stream", QueueKind.STREAM))
_monotonic = time.monotonic
_now_ns = lib.sf_monotonic_ns


def _counter_struct(first: str, last: str) -> tuple[int, struct.Struct]:
    """(offset, packer) of WorkerCounters' u64 fields first..last: one
    pack_into writes them all (each word one aligned 8-byte store)."""
    at = ffi.offsetof("WorkerCounters", first)
    n = (ffi.offsetof("WorkerCounters", last) + 8 - at) // 8
    return at, struct.Struct(f"<{n}Q")


# The counters a tick moves, in WorkerCounters order (asserted below); the
# last fault is written only when there is one.
_TICK_AT, _TICK_WORDS = _counter_struct("ticks", "tokens_emitted")
_LIFE_AT, _LIFE_WORDS = _counter_struct("heartbeat_ns", "queue_resets")
_FAULT_AT, _FAULT = ffi.offsetof("WorkerCounters", "last_fault_lane"), struct.Struct("<QI")
assert _TICK_WORDS.size == 56 and _LIFE_WORDS.size == 40
assert ffi.offsetof("WorkerCounters", "last_fault_code") == _FAULT_AT + 8


class WorkerReport:
    """The Worker's header-keeping methods (the Worker owns the state below)."""

    seg: Any
    ex: Executor
    epoch: int
    pid: int
    session: int
    stale_messages: int
    queue_resets: int
    metrics: Any
    out: Outbox
    _outbox: Any
    _reported_at: float
    _geometry_at: float
    _gauges: tuple | None
    _gate_seen: int
    _epoch_p: Any
    _state_p: Any
    _session_p: Any
    _counters_mv: memoryview
    _identity: tuple | None
    _desc: Any

    # ----------------------------------------------------------- guarding

    def _guard(self, every: bool = True) -> None:
        """Reset a queue whose counters no live peer could have made. Each
        loop looks at the plan queue (a tail past its head would feed it
        garbage: run() asks sf_queue_sane itself and calls this only when
        it says no); the others (bounded drains, full-queue waits) every
        REPORT_S, from run()'s periodic look."""
        for name, kind in (QUEUES if every else QUEUES[:1]):
            q = self.seg.queues[name]
            if lib.sf_queue_sane(q._view):
                continue
            head, tail = q.head, q.tail
            to = q.reset()
            self.queue_resets += 1
            print(f"superfluid worker: the {name} queue had head {head} and tail {tail} (impossible: "
                  f"{q.n_slots} slots); reset both to {to}", file=sys.stderr)
            self._outbox.appendleft(("QueueReset", QueueReset(worker_epoch=self.epoch, queue=int(kind), head=head,
                                                              tail=tail, reset_to=to), 0))
            self._life_counters()  # queue_resets, before the QueueReset goes out

    def _report(self, due: bool = False) -> None:
        """The header's worker fields are this worker's report: put back
        what someone else wrote there (every REPORT_S: a forged state lives
        that long, and a tick pays nothing for it). `due`: the caller keeps
        the time."""
        now = _monotonic()
        if not due and now - self._reported_at < REPORT_S:
            return
        self._reported_at = now
        seg, h = self.seg, self.seg.header
        if lib.sf_load_acquire_u64(self._epoch_p) != self.epoch:
            seg.set_epoch(self.epoch)
        if lib.sf_load_acquire_u32(self._state_p) != WorkerState.READY:
            seg.set_worker_state(WorkerState.READY)
        if h.worker_pid != self.pid:
            h.worker_pid = self.pid
        if lib.sf_load_acquire_u64(self._session_p) < self.session:
            # Wound back: the next sf_session_begin would hand out a used id.
            lib.sf_store_release_u64(self._session_p, self.session)
        if now - self._geometry_at >= GEOMETRY_CHECK_S:
            self._geometry_at = now
            fixes = repair_geometry(seg)
            if self._identity is not None:
                fixes += repair_identity(seg, *self._identity)
            if seg.runtime != self._desc:
                seg.runtime = self._desc
                fixes.append("the runtime description was not this worker's")
            for fix in fixes:
                print(f"superfluid worker: segment header repaired: {fix}", file=sys.stderr)

    def _counters(self) -> None:
        """WorkerCounters and the metrics gauges, current (the header's
        report fields: _report, from the loop's periodic look)."""
        self._tick_counters()
        self._life_counters()
        self._gate_gauges()

    def _gate_gauges(self) -> None:
        """The speculation gate's states and figures, when they moved: from
        the periodic look and at idle, not every plan (a snapshot is a walk)."""
        gate = self.ex.registry.spec_gate
        if self.metrics is not None and gate.changes != self._gate_seen:
            self._gate_seen = gate.changes
            self.metrics.spec_gate(gate.snapshot())

    def _life_counters(self, now_ns: int | None = None) -> None:
        """The heartbeat and the loop's own counters: every REPORT_S from
        the loop (and whenever it idles or blocks), not every plan; what
        moves them writes its own word at once too (session, stale)."""
        now = _now_ns() if now_ns is None else now_ns
        _LIFE_WORDS.pack_into(self._counters_mv, _LIFE_AT, now, self.out.blocked_since, self.session,
                              self.stale_messages, self.queue_resets)
        if self.metrics is not None:
            self.metrics.beat(now)

    def _beat(self) -> None:
        """The watchdog's heartbeat (the metrics block, which only the daemon
        and this worker map: a planner cannot forge it) before each op and
        plan, so a stall is one op or tick past --tick-timeout, not a sum."""
        if self.metrics is not None:
            self.metrics.beat(_now_ns())

    def _tick_counters(self) -> None:
        """What a tick moves, and the metrics gauges: every plan, before its
        events go out."""
        ex = self.ex
        mv = self._counters_mv
        lanes, entries, cache_bytes = len(ex.lanes), len(ex.cache), ex.cache.resident_bytes
        n = ex.counters
        _TICK_WORDS.pack_into(mv, _TICK_AT, n.tick_count, n.rejects, n.last_plan_seq or 0, lanes, entries,
                              cache_bytes, n.tokens_emitted)
        if ex.lanes.last_fault is not None:
            _FAULT.pack_into(mv, _FAULT_AT, *ex.lanes.last_fault)
        if self.metrics is not None:
            g = (lanes, entries, cache_bytes, ex.counters.seeded_tokens)
            if g != self._gauges:  # unchanged gauges: nothing to write
                self._gauges = g
                self.metrics.gauges(lanes_live=lanes, cache_entries=entries, cache_bytes=cache_bytes,
                                    cache_hit_tokens=ex.counters.seeded_tokens)
