"""Prometheus metrics: a per-worker shared-memory block (the daemon's scrape
endpoint that reads it is daemon/metrics_endpoint.py).

Each worker slot has one WorkerMetrics block (a memfd of uint64 words) that
the daemon creates and hands to every worker it starts there (pass_fds). The
worker is the only writer while it lives; the daemon reads at scrape time and
tolerates a torn read between words (each word is one aligned 8-byte store).
The daemon keeps the block across restarts, so counters never go back;
`restarted()` clears the gauges before the next worker starts.
"""

from __future__ import annotations

import bisect
import mmap
import os
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from superfluid.abi import OpStatus, ShedKind, ShedReason, Status
from superfluid.executor import (
    FAULT_KINDS as _FAULT_KINDS,
    SPEC_MAX_BUCKET as _SPEC_MAX_BUCKET,
    SPEC_SLOTS as _SPEC_SLOTS,
)

PREFIX = "superfluid_worker_"
DAEMON_LABEL = "daemon"  # the daemon's --name
TICK_BUCKETS_S = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10)
_BOUNDS_NS = [round(b * 1e9) for b in TICK_BUCKETS_S]


def _label_names(enum: Any) -> tuple[str, ...]:
    """Label values indexed by enum value; the one past the end is "unknown"."""
    names = {int(m): m.name for m in enum}
    assert sorted(names) == list(range(len(names))), f"{enum.__name__} is not 0..n-1"
    return tuple(names[i] for i in range(len(names))) + ("unknown",)


_STATUS = _label_names(Status)
_OP_STATUS = _label_names(OpStatus)
_SHED_REASON = _label_names(ShedReason)
# The speculation gate's figures: one row per strategy slot, one column per lanes bucket (1, 2, 4, ...).
_SPEC_BUCKETS = _SPEC_MAX_BUCKET.bit_length()
_SPEC_CELLS = _SPEC_SLOTS * _SPEC_BUCKETS
_GATE_STATE = {"explore": 1, "on": 2, "off": 3}  # 0: no figures

# ------------------------------------------------------------------ layout
# Word names in block order; (name, n) for arrays. Private to this module: the
# version word is derived from the table, so any change refuses old blocks.
_LAYOUT: tuple[tuple[str, int], ...] = (
    ("magic", 1), ("version", 1),
    # counters (kept across restarts)
    ("ticks", 1), ("rejects", 1), ("tick_ns", 1), ("prefill_ns", 1), ("decode_ns", 1),
    ("decode_tokens", 1), ("prefill_tokens", 1), ("cache_evictions", 1), ("cache_evicted_bytes", 1),
    ("cache_hit_tokens", 1),
    ("tick_buckets", len(_BOUNDS_NS) + 1), ("rejects_by_status", len(_STATUS)),
    ("sheds_by_reason", len(_SHED_REASON)), ("ops_by_status", len(_OP_STATUS)),
    ("spec_proposed", 1), ("spec_accepted", 1), ("partial_dropped", 1),
    ("faults_injected", len(_FAULT_KINDS)),
    # gauges (cleared by restarted())
    ("live_lanes", 1), ("cache_entries", 1), ("cache_bytes", 1), ("heartbeat_ns", 1),
    ("kv_blocks_used", 1), ("kv_blocks_total", 1), ("blocked_since_ns", 1),
    ("spec_gate_state", _SPEC_CELLS), ("spec_draft_ns_per_token", _SPEC_CELLS),
    ("spec_plain_ns_per_token", _SPEC_CELLS),
)
_AT: dict[str, int] = {}  # name -> first word
_WORDS = 0
for _name, _n in _LAYOUT:
    _AT[_name], _WORDS = _WORDS, _WORDS + _n
_GAUGES = tuple(_LAYOUT[_LAYOUT.index(("live_lanes", 1)):])  # (name, words)
MAGIC = int.from_bytes(b"SFMETRIC", "little")
VERSION = zlib.crc32(repr(_LAYOUT).encode())

# Word indices the hot path uses, looked up once.
_TICKS, _REJECTS, _TICK_NS = _AT["ticks"], _AT["rejects"], _AT["tick_ns"]
_PREFILL_NS, _DECODE_NS = _AT["prefill_ns"], _AT["decode_ns"]
_DECODE_TOK, _PREFILL_TOK = _AT["decode_tokens"], _AT["prefill_tokens"]
_EVICTIONS, _EVICTED_BYTES, _HIT = _AT["cache_evictions"], _AT["cache_evicted_bytes"], _AT["cache_hit_tokens"]
_BUCKET0, _REJ0 = _AT["tick_buckets"], _AT["rejects_by_status"]
_SHED0, _OPS0 = _AT["sheds_by_reason"], _AT["ops_by_status"]
_LANES, _ENTRIES, _CBYTES = _AT["live_lanes"], _AT["cache_entries"], _AT["cache_bytes"]
_KV_USED, _KV_TOTAL, _BLOCKED = _AT["kv_blocks_used"], _AT["kv_blocks_total"], _AT["blocked_since_ns"]
_PREFILL_CHUNK, _CACHE_EVICTION = int(ShedKind.PREFILL_CHUNK), int(ShedKind.CACHE_EVICTION)
_PROPOSED, _ACCEPTED, _PARTIAL_DROPPED = _AT["spec_proposed"], _AT["spec_accepted"], _AT["partial_dropped"]
_GATE0, _DRAFT_NS0, _PLAIN_NS0 = _AT["spec_gate_state"], _AT["spec_draft_ns_per_token"], _AT["spec_plain_ns_per_token"]
_FAULTS0, _HEARTBEAT = _AT["faults_injected"], _AT["heartbeat_ns"]


class WorkerMetrics:
    """One worker slot's counters in shared memory. `create` (daemon) or
    `from_fd` (worker); the recording methods are the worker's."""

    def __init__(self, fd: int, mm: mmap.mmap, *, owns_fd: bool):
        self.fd = fd
        self._mm = mm
        self._owns_fd = owns_fd
        self._w = memoryview(mm).cast("Q")  # writes: ~4x cheaper than numpy scalar stores
        self._a = np.frombuffer(mm, dtype=np.uint64)  # reads: one copy per scrape
        self._hit_seen = 0  # this process's last cache_hit_tokens total (see gauges)

    @classmethod
    def create(cls, name: str) -> WorkerMetrics:
        """A zeroed block on a new memfd (close-on-exec: pass it with pass_fds)."""
        fd = os.memfd_create(f"superfluid-metrics.{name}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, _WORDS * 8)
            m = cls(fd, mmap.mmap(fd, _WORDS * 8), owns_fd=True)
        except BaseException:
            os.close(fd)
            raise
        m._w[_AT["version"]] = VERSION
        m._w[_AT["magic"]] = MAGIC
        return m

    @classmethod
    def from_fd(cls, fd: int) -> WorkerMetrics:
        """Map the block the daemon created; the fd stays the caller's (the mapping outlives it)."""
        size = os.fstat(fd).st_size
        if size < _WORDS * 8:
            raise ValueError(f"metrics fd {fd}: {size} bytes, the block needs {_WORDS * 8}")
        m = cls(fd, mmap.mmap(fd, _WORDS * 8), owns_fd=False)
        magic, version = int(m._w[_AT["magic"]]), int(m._w[_AT["version"]])
        if magic != MAGIC or version != VERSION:
            m.close()
            raise ValueError(f"metrics fd {fd}: magic {magic:#x} version {version:#x}, expected "
                             f"{MAGIC:#x} {VERSION:#x} (a different superfluid build made it)")
        return m

    @property
    def closed(self) -> bool:
        return self._mm.closed

    def close(self) -> None:
        if self._mm.closed:
            return
        self._w.release()
        del self._a  # the mmap refuses to close while a view exports it
        self._mm.close()
        if self._owns_fd:
            os.close(self.fd)

    def __enter__(self) -> WorkerMetrics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------- worker

    def tick(self, plan: Any, events: Any) -> None:
        """One plan's outcome: `plan` the decoded TickPlan (None when it did
        not decode), `events` the TickEvents that answer it."""
        w = self._w
        status = events.status
        if status:
            w[_REJECTS] += 1
            w[_REJ0 + (status if 0 <= status < len(_STATUS) - 1 else len(_STATUS) - 1)] += 1
        else:
            t = events.timings
            w[_TICKS] += 1
            w[_BUCKET0 + bisect.bisect_left(_BOUNDS_NS, t.wall_ns)] += 1  # le is inclusive
            w[_TICK_NS] += t.wall_ns
            w[_PREFILL_NS] += t.prefill_ns
            w[_DECODE_NS] += t.decode_ns
            if events.emits:
                # A generator beats map(attrgetter) on namedtuples; numpy would need a copy first.
                w[_DECODE_TOK] += sum(e.n_tokens for e in events.emits)
                proposed = sum(e.spec.proposed for e in events.emits)
                if proposed:
                    w[_PROPOSED] += proposed
                    w[_ACCEPTED] += sum(e.spec.accepted for e in events.emits)
            prefilled = sum(p.token_count for p in plan.prefills) if plan is not None and plan.prefills else 0
            for e in events.shed.entries:  # few: only what this tick shed
                if e.kind == _PREFILL_CHUNK:
                    prefilled -= e.tokens
                elif e.kind == _CACHE_EVICTION:
                    w[_EVICTIONS] += 1
                    w[_EVICTED_BYTES] += e.bytes
                r = e.reason
                w[_SHED0 + (r if 0 <= r < len(_SHED_REASON) - 1 else len(_SHED_REASON) - 1)] += 1
            if prefilled > 0:
                w[_PREFILL_TOK] += prefilled
        if events.op_completions:  # a rejected plan's events carry ops too
            self.ops(events.op_completions)
        mem = events.mem
        w[_KV_USED] = mem.pool_blocks_used
        w[_KV_TOTAL] = mem.pool_blocks_total

    def tick_empty(self, wall_ns: int, mem: Any) -> None:
        """As tick, for an OK tick of a plan with no lists and no op
        completions (Worker._empty): only its count, its time and the pool."""
        w = self._w
        w[_TICKS] += 1
        w[_BUCKET0 + bisect.bisect_left(_BOUNDS_NS, wall_ns)] += 1
        w[_TICK_NS] += wall_ns
        w[_KV_USED] = mem.pool_blocks_used
        w[_KV_TOTAL] = mem.pool_blocks_total

    def ops(self, completions: Iterable[Any]) -> None:
        """Op completions (OpCompletion records) sent outside a tick (OpEvents)."""
        w = self._w
        last = len(_OP_STATUS) - 1
        for c in completions:
            s = c.status
            w[_OPS0 + (s if 0 <= s < last else last)] += 1

    def gauges(self, *, lanes_live: int, cache_entries: int, cache_bytes: int, cache_hit_tokens: int) -> None:
        """The worker's current sizes; `cache_hit_tokens` is this process's
        running total, folded in as a delta so the block's counter carries on
        from the previous workers' totals."""
        w = self._w
        w[_LANES] = lanes_live
        w[_ENTRIES] = cache_entries
        w[_CBYTES] = cache_bytes
        delta = cache_hit_tokens - self._hit_seen
        if delta > 0:
            w[_HIT] += delta
        self._hit_seen = cache_hit_tokens  # a total that went back (should not) restarts the delta

    def spec_gate(self, snapshot: Mapping[str, Any]) -> None:
        """The speculation gate's state and figures, from the executor's
        spec_gate.snapshot(): per installed strategy slot and lanes bucket."""
        w = self._w
        for i in range(_SPEC_CELLS):
            w[_GATE0 + i] = w[_DRAFT_NS0 + i] = w[_PLAIN_NS0 + i] = 0
        for st in snapshot.get("strategies", ()):
            slot = st["slot"]
            if not 1 <= slot <= _SPEC_SLOTS:
                continue
            for b in st["buckets"]:
                at = (slot - 1) * _SPEC_BUCKETS + min(_SPEC_BUCKETS - 1, max(0, b["lanes"] - 1).bit_length())
                w[_GATE0 + at] = _GATE_STATE.get(b["state"], 0)
                for base, key in ((_DRAFT_NS0, "draft_s_per_token"), (_PLAIN_NS0, "plain_s_per_token")):
                    v = b[key]
                    w[base + at] = round(v * 1e9) if v is not None and v > 0 else 0

    def fault_injected(self, kind: str) -> None:
        """A fault schedule's (or INJECT_FAULT's) fault happened (executor/faults.py KINDS)."""
        self._w[_FAULTS0 + _FAULT_KINDS.index(kind)] += 1

    def beat(self, now_ns: int) -> None:
        """The worker's loop moved (CLOCK_MONOTONIC ns): the stall watchdog's heartbeat."""
        self._w[_HEARTBEAT] = now_ns

    def heartbeat(self) -> int:
        """The last beat (0: none since this worker started)."""
        return int(self._w[_HEARTBEAT])

    def partial_dropped(self) -> None:
        """A partial emit dropped: the stream queue stayed full."""
        self._w[_PARTIAL_DROPPED] += 1

    def blocked(self, since_ns: int) -> None:
        """CLOCK_MONOTONIC ns since which the worker waits for the planner to
        make room in the event queue; 0 when it does not wait."""
        self._w[_BLOCKED] = since_ns

    # ------------------------------------------------------------- daemon

    def restarted(self) -> None:
        """Clear the gauges before the next worker starts (no worker writes now)."""
        for g, n in _GAUGES:
            for i in range(_AT[g], _AT[g] + n):
                self._w[i] = 0

    def read(self) -> dict[str, Any]:
        """A copy of the block as plain data: ints, and lists for the arrays."""
        a = self._a.copy()
        return {name: int(a[at]) if n == 1 else a[at:at + n].tolist()
                for (name, n), at in zip(_LAYOUT, _AT.values())}
