"""The daemon's side of the Prometheus metrics: how its workers ended
(DaemonCounters), and the scrape endpoint that reads every worker's block
(daemon/metrics.py) at each scrape and serves it over HTTP."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import MetricsHandler

from superfluid.daemon.metrics import (
    _OP_STATUS,
    _SHED_REASON,
    _SPEC_BUCKETS,
    _STATUS,
    DAEMON_LABEL,
    PREFIX,
    TICK_BUCKETS_S,
    WorkerMetrics,
)
from superfluid.executor import FAULT_KINDS as _FAULT_KINDS


def exit_reason(status: int) -> str:
    """The worker_exits_total reason of an exit status (-N: killed by signal N)."""
    return f"signal_{-status}" if status < 0 else f"exit_{status}"


class DaemonCounters:
    """What only the daemon sees: how workers ended. Written by the
    supervisor thread, read by scrape threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._exits: dict[tuple[int, str], int] = {}

    def exited(self, index: int, reason: str) -> None:
        with self._lock:
            self._exits[(index, reason)] = self._exits.get((index, reason), 0) + 1

    def exits(self) -> dict[tuple[int, str], int]:
        with self._lock:
            return dict(self._exits)


# (index, block, status.worker_snapshot(seg)) per worker, at scrape time.
WorkerSource = Callable[[], Iterable[tuple[int, WorkerMetrics, Mapping[str, Any]]]]

# From the block: (metric suffix, word, scale, help).
_COUNTERS = (
    ("ticks", "ticks", 1, "Plans applied, over every worker of this slot."),
    ("rejects", "rejects", 1, "Plans rejected (any status != OK), over every worker of this slot."),
    ("tokens_emitted", "decode_tokens", 1, "Tokens emitted (the same count as decode_tokens_total)."),
    ("decode_tokens", "decode_tokens", 1, "Tokens decoded: the sum of emits' n_tokens."),
    ("prefill_tokens", "prefill_tokens", 1, "Prompt tokens prefilled: planned less shed chunks."),
    ("prefill_seconds", "prefill_ns", 1e-9, "Seconds applied ticks spent in prefill."),
    ("decode_seconds", "decode_ns", 1e-9, "Seconds applied ticks spent in decode."),
    ("cache_hit_tokens", "cache_hit_tokens", 1, "Prompt tokens admissions took from the prefix cache."),
    ("cache_evictions", "cache_evictions", 1, "Prefix-cache entries evicted (CACHE_EVICTION sheds)."),
    ("cache_evicted_bytes", "cache_evicted_bytes", 1, "Bytes freed by prefix-cache evictions."),
    ("spec_proposed", "spec_proposed", 1, "Draft tokens verified (LaneEmit.spec.proposed)."),
    ("spec_accepted", "spec_accepted", 1, "Draft tokens the lanes took (LaneEmit.spec.accepted)."),
    ("partial_emits_dropped", "partial_dropped", 1, "Partial emits dropped: the stream queue stayed full (nobody "
     "read it); the ticks' events still carry every token."),
)
_GAUGE_WORDS = (
    ("live_lanes", "live_lanes", "Lanes admitted and not retired."),
    ("cache_entries", "cache_entries", "Prefix-cache entries."),
    ("cache_bytes", "cache_bytes", "Bytes held by prefix-cache entries."),
    ("kv_blocks_used", "kv_blocks_used", "KV pool blocks in use, after the last tick."),
    ("kv_blocks_capacity", "kv_blocks_total", "KV pool blocks in all (a gauge: no _total suffix)."),
)
# Labelled counters: (metric suffix, array word, label, label values, values shown only
# when non-zero, help).
_BY_LABEL = (
    ("plan_rejects", "rejects_by_status", "status", _STATUS, ("OK", "unknown"), "Plans rejected, by Status."),
    ("sheds", "sheds_by_reason", "reason", _SHED_REASON, ("unknown",),
     "Shed entries (prefill chunks and evictions), by ShedReason."),
    ("op_completions", "ops_by_status", "status", _OP_STATUS, ("unknown",), "Op completions, by OpStatus."),
    ("faults_injected", "faults_injected", "kind", _FAULT_KINDS, (), "Faults injected (fault schedules, "
     "INJECT_FAULT), by kind: lane_fault, fatal, capacity, stall, slow, nan."),
)
# From status.worker_snapshot: (metric suffix, key, counter?, help).
_SNAPSHOT = (
    ("restarts", "restarts", True, "Times the daemon restarted this worker."),
    ("epoch", "epoch", False, "Worker epoch (bumped on every start)."),
    ("state", "state_code", False, "SF_WORKER_* state (2 = READY)."),
    ("up", "ready", False, "1 when the worker reads plans."),
    ("last_exit_status", "last_exit_status", False, "Exit code, or -signal, of the last worker that ended."),
    ("heartbeat_age_seconds", "heartbeat_age_s", False, "Seconds since the worker's last loop."),
)


class _Collector:
    def __init__(self, name: str, workers: WorkerSource, counters: DaemonCounters | None):
        self.name = name
        self.workers = workers
        self.counters = counters

    def collect(self) -> Iterator[Metric]:
        now = time.monotonic_ns()  # CLOCK_MONOTONIC, as the worker's stamps
        rows = [(str(i), m.read(), snap) for i, m, snap in self.workers() if not m.closed]
        labels = [DAEMON_LABEL, "worker"]
        for suffix, word, scale, help_ in _COUNTERS:
            f = CounterMetricFamily(PREFIX + suffix, help_, labels=labels)
            for w, b, _ in rows:
                f.add_metric([self.name, w], b[word] * scale)
            yield f
        for suffix, word, help_ in _GAUGE_WORDS:
            f = GaugeMetricFamily(PREFIX + suffix, help_, labels=labels)
            for w, b, _ in rows:
                f.add_metric([self.name, w], b[word])
            yield f
        for suffix, word, label, values, if_any, help_ in _BY_LABEL:
            f = CounterMetricFamily(PREFIX + suffix, help_, labels=[*labels, label])
            for w, b, _ in rows:
                for v, n in zip(values, b[word]):
                    if n or v not in if_any:
                        f.add_metric([self.name, w, v], n)
            yield f
        h = HistogramMetricFamily(PREFIX + "tick_seconds", "Wall time of applied ticks.", labels=labels)
        for w, b, _ in rows:
            cum = np.cumsum(b["tick_buckets"]).tolist()  # the block keeps per-bucket counts
            buckets = [(repr(float(le)), c) for le, c in zip(TICK_BUCKETS_S, cum)] + [("+Inf", cum[-1])]
            h.add_metric([self.name, w], buckets, b["tick_ns"] * 1e-9)
        yield h
        yield from self._spec_gate(rows, labels)
        g = GaugeMetricFamily(PREFIX + "blocked_on_planner_seconds",
                              "Seconds the worker has waited for the planner to read events; 0 when not.",
                              labels=labels)
        for w, b, snap in rows:
            since = b["blocked_since_ns"]
            g.add_metric([self.name, w], max(0, now - since) * 1e-9 if since and snap.get("ready") else 0.0)
        yield g
        for suffix, key, counter, help_ in _SNAPSHOT:
            kind = CounterMetricFamily if counter else GaugeMetricFamily
            f = kind(PREFIX + suffix, help_, labels=labels)
            for w, _, snap in rows:
                if snap.get(key) is not None:
                    f.add_metric([self.name, w], snap[key])
            yield f
        f = CounterMetricFamily(PREFIX + "exits", "Worker processes that ended, by reason (exit_N, signal_N, "
                                "spawn_failed).", labels=[*labels, "reason"])
        for (index, reason), n in sorted((self.counters.exits() if self.counters else {}).items()):
            f.add_metric([self.name, str(index), reason], n)
        yield f


    def _spec_gate(self, rows: list, labels: list[str]) -> Iterator[Metric]:
        """The gate's cells that have figures, labelled by strategy slot and lanes bucket."""
        names = [*labels, "slot", "lanes"]
        state = GaugeMetricFamily(PREFIX + "spec_gate_state", "Speculation gate per strategy slot and "
                                  "decoding-lanes bucket: 1 exploring, 2 drafting, 3 stopped (drafting "
                                  "did not pay; probed again later).", labels=names)
        draft = GaugeMetricFamily(PREFIX + "spec_draft_seconds_per_token", "Decode seconds per emitted "
                                  "token over the gate's window of drafting ticks.", labels=names)
        plain = GaugeMetricFamily(PREFIX + "spec_plain_seconds_per_token", "Decode seconds per emitted "
                                  "token over the gate's window of ticks without drafts.", labels=names)
        for w, b, _ in rows:
            for at, code in enumerate(b["spec_gate_state"]):
                if not code:
                    continue
                cell = [self.name, w, str(at // _SPEC_BUCKETS + 1), str(1 << at % _SPEC_BUCKETS)]
                state.add_metric(cell, code)
                draft.add_metric(cell, b["spec_draft_ns_per_token"][at] * 1e-9)
                plain.add_metric(cell, b["spec_plain_ns_per_token"][at] * 1e-9)
        yield from (state, draft, plain)


def make_registry(name: str, workers: WorkerSource,
                  counters: DaemonCounters | None = None) -> CollectorRegistry:
    """A registry of daemon `name`'s metrics, read from `workers()` at each scrape."""
    reg = CollectorRegistry()
    reg.register(_Collector(name, workers, counters))
    return reg


class MetricsServer:
    """Serves a registry over HTTP (any path) from a thread; `.address` is
    the (host, port) bound (port 0 picks a free one)."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0):
        self._srv = http.server.ThreadingHTTPServer((host, port), MetricsHandler.factory(registry))
        self._srv.daemon_threads = True
        h, p = self._srv.server_address[:2]
        self.address = (str(h), int(p))
        # A short poll interval: close() waits for it.
        self._thread = threading.Thread(target=self._srv.serve_forever, args=(0.1,),
                                        name="superfluid-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving; call before the blocks the registry reads are closed."""
        if self._thread.is_alive():
            self._srv.shutdown()
            self._thread.join()
        self._srv.server_close()
