"""WorkerMetrics blocks recorded as a worker would, scraped over real HTTP."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from superfluid.abi import OpStatus, ShedKind, ShedReason, Status, WorkerState
from superfluid.abi.records import (
    LaneEmit,
    LanePrefill,
    OpCompletion,
    ShedEntry,
    ShedReport,
    SpecStats,
    TickEvents,
    TickMemCounters,
    TickPlan,
    TickTimings,
)
from superfluid.daemon.metrics import WorkerMetrics
from superfluid.daemon.metrics_endpoint import DaemonCounters, MetricsServer, exit_reason, make_registry
from superfluid.daemon.status import worker_snapshot
from superfluid.testing.launch import python

NAME = "tm"
READY = {"state_code": int(WorkerState.READY), "ready": 1, "epoch": 1, "restarts": 0, "last_exit_status": 0,
         "heartbeat_age_s": 0.25}


def events(*, status: int = 0, wall_s: float = 0.0, prefill_s: float = 0.0, decode_s: float = 0.0,
           emits: tuple[int, ...] = (), shed: tuple[Any, ...] = (), ops: tuple[int, ...] = (),
           blocks: tuple[int, int] = (0, 0)) -> Any:
    return TickEvents(status=int(status),
                      timings=TickTimings(wall_ns=round(wall_s * 1e9), prefill_ns=round(prefill_s * 1e9),
                                          decode_ns=round(decode_s * 1e9)),
                      emits=tuple(LaneEmit(lane_tag=i, n_tokens=n) for i, n in enumerate(emits)),
                      shed=ShedReport(entries=shed),
                      op_completions=tuple(OpCompletion(status=int(s)) for s in ops),
                      mem=TickMemCounters(pool_blocks_used=blocks[0], pool_blocks_total=blocks[1]))


def plan(*prefill_tokens: int) -> Any:
    return TickPlan(prefills=tuple(LanePrefill(lane_tag=i, token_count=n)
                                   for i, n in enumerate(prefill_tokens)))


class Scraper:
    """A served registry over `workers` [(index, block, snapshot)]."""

    def __init__(self, workers: list[tuple[int, WorkerMetrics, dict[str, Any]]], counters: DaemonCounters):
        self.workers = workers
        self.server = MetricsServer(make_registry(NAME, lambda: self.workers, counters), port=0)

    def families(self) -> dict[str, Any]:
        host, port = self.server.address
        body = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
        return {f.name: f for f in text_string_to_metric_families(body)}

    def samples(self, sample_name: str, **labels: str) -> dict[tuple, float]:
        """{label values other than daemon/worker/given: value} of one sample name."""
        out = {}
        for s in (s for f in self.families().values() for s in f.samples):
            if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
                assert s.labels["daemon"] == NAME
                out[tuple(v for k, v in sorted(s.labels.items()) if k not in ("daemon", *labels))] = s.value
        return out

    def value(self, sample_name: str, worker: str = "0", **labels: str) -> float:
        (v,) = self.samples(sample_name, worker=worker, **labels).values()
        return v


@pytest.fixture
def block() -> Iterator[WorkerMetrics]:
    with WorkerMetrics.create("test") as m:
        yield m


@pytest.fixture
def scraper(block: WorkerMetrics) -> Iterator[Scraper]:
    s = Scraper([(0, block, dict(READY))], DaemonCounters())
    yield s
    s.server.close()


def test_applied_ticks_fill_histogram_tokens_and_sheds(block: WorkerMetrics, scraper: Scraper) -> None:
    w = WorkerMetrics.from_fd(block.fd)  # the worker's own mapping
    chunk = ShedEntry(kind=int(ShedKind.PREFILL_CHUNK), reason=int(ShedReason.BUDGET), tokens=30)
    evict = ShedEntry(kind=int(ShedKind.CACHE_EVICTION), reason=int(ShedReason.MEMORY), bytes=4096)
    w.tick(plan(100, 28), events(wall_s=0.0003, prefill_s=0.0002, emits=(1, 1, 2), blocks=(7, 64)))
    w.tick(plan(50), events(wall_s=0.003, prefill_s=0.001, decode_s=0.002, shed=(chunk, evict, evict)))
    w.tick(None, events(wall_s=20.0, decode_s=0.5, emits=(5,), blocks=(9, 64)))  # past the last bound
    w.close()

    assert scraper.value("superfluid_worker_ticks_total") == 3
    assert scraper.value("superfluid_worker_rejects_total") == 0
    assert scraper.value("superfluid_worker_tick_seconds_count") == 3
    assert scraper.value("superfluid_worker_tick_seconds_sum") == pytest.approx(20.0033)
    buckets = scraper.samples("superfluid_worker_tick_seconds_bucket", worker="0")
    assert buckets[("0.0005",)] == 1 and buckets[("0.001",)] == 1 and buckets[("0.0025",)] == 1
    assert buckets[("0.005",)] == 2 and buckets[("10.0",)] == 2 and buckets[("+Inf",)] == 3
    assert scraper.value("superfluid_worker_prefill_seconds_total") == pytest.approx(0.0012)
    assert scraper.value("superfluid_worker_decode_seconds_total") == pytest.approx(0.502)
    assert scraper.value("superfluid_worker_decode_tokens_total") == 9
    assert scraper.value("superfluid_worker_tokens_emitted_total") == 9
    assert scraper.value("superfluid_worker_prefill_tokens_total") == 100 + 28 + 50 - 30
    sheds = scraper.samples("superfluid_worker_sheds_total", worker="0")
    assert sheds[("BUDGET",)] == 1 and sheds[("MEMORY",)] == 2 and sheds[("NONE",)] == 0
    assert ("unknown",) not in sheds  # only shown once something unknown came
    assert scraper.value("superfluid_worker_cache_evictions_total") == 2
    assert scraper.value("superfluid_worker_cache_evicted_bytes_total") == 8192
    assert scraper.value("superfluid_worker_kv_blocks_used") == 9  # the last tick's
    assert scraper.value("superfluid_worker_kv_blocks_capacity") == 64


def test_rejects_by_status_and_ops_in_and_out_of_ticks(block: WorkerMetrics, scraper: Scraper) -> None:
    w = WorkerMetrics.from_fd(block.fd)
    w.tick(plan(10), events(status=Status.RejectBudget, ops=(OpStatus.OK,), wall_s=1.0))
    w.tick(None, events(status=Status.StaleSession))
    w.tick(None, events(status=Status.RejectBudget, blocks=(3, 8)))
    w.tick(plan(), events(ops=(OpStatus.OK, OpStatus.Refused)))
    w.ops([OpCompletion(status=int(OpStatus.NoMatch)), OpCompletion(status=int(OpStatus.OK))])
    w.ops([OpCompletion(status=200)])  # a status this build does not know

    assert scraper.value("superfluid_worker_rejects_total") == 3
    assert scraper.value("superfluid_worker_ticks_total") == 1
    rejects = scraper.samples("superfluid_worker_plan_rejects_total", worker="0")
    assert rejects[("RejectBudget",)] == 2 and rejects[("StaleSession",)] == 1 and ("OK",) not in rejects
    assert sum(rejects.values()) == 3
    # A rejected plan's wall time and prefills are not the applied ticks'.
    assert scraper.value("superfluid_worker_tick_seconds_count") == 1
    assert scraper.value("superfluid_worker_tick_seconds_sum") == 0
    assert scraper.value("superfluid_worker_prefill_tokens_total") == 0
    ops = scraper.samples("superfluid_worker_op_completions_total", worker="0")
    assert ops[("OK",)] == 3 and ops[("Refused",)] == 1 and ops[("NoMatch",)] == 1 and ops[("unknown",)] == 1
    assert scraper.value("superfluid_worker_kv_blocks_used") == 0  # the last events' mem


def test_gauges_blocked_and_snapshot_series(block: WorkerMetrics, scraper: Scraper) -> None:
    w = WorkerMetrics.from_fd(block.fd)
    w.gauges(lanes_live=3, cache_entries=5, cache_bytes=1 << 20, cache_hit_tokens=40)
    w.gauges(lanes_live=2, cache_entries=5, cache_bytes=1 << 20, cache_hit_tokens=64)
    assert scraper.value("superfluid_worker_live_lanes") == 2
    assert scraper.value("superfluid_worker_cache_entries") == 5
    assert scraper.value("superfluid_worker_cache_bytes") == 1 << 20
    assert scraper.value("superfluid_worker_cache_hit_tokens_total") == 64
    assert scraper.value("superfluid_worker_blocked_on_planner_seconds") == 0

    w.blocked(time.monotonic_ns() - 5_000_000_000)  # waiting for 5 s already
    assert scraper.value("superfluid_worker_blocked_on_planner_seconds") >= 5
    scraper.workers[0][2]["ready"] = 0  # a worker that is not READY is not waiting on anyone
    assert scraper.value("superfluid_worker_blocked_on_planner_seconds") == 0
    scraper.workers[0][2]["ready"] = 1
    w.blocked(0)
    assert scraper.value("superfluid_worker_blocked_on_planner_seconds") == 0

    assert scraper.value("superfluid_worker_up") == 1
    assert scraper.value("superfluid_worker_state") == int(WorkerState.READY)
    assert scraper.value("superfluid_worker_epoch") == 1
    assert scraper.value("superfluid_worker_restarts_total") == 0
    assert scraper.value("superfluid_worker_heartbeat_age_seconds") == 0.25
    scraper.workers[0][2]["heartbeat_age_s"] = None  # no heartbeat yet: no sample
    assert scraper.samples("superfluid_worker_heartbeat_age_seconds") == {}


def test_counters_carry_over_a_restart_and_gauges_do_not(block: WorkerMetrics, scraper: Scraper) -> None:
    first = WorkerMetrics.from_fd(block.fd)
    first.tick(plan(10), events(wall_s=0.002, emits=(4,), blocks=(5, 10)))
    first.tick(None, events(status=Status.RejectBounds))
    first.gauges(lanes_live=4, cache_entries=2, cache_bytes=100, cache_hit_tokens=100)
    first.blocked(time.monotonic_ns())
    first.close()  # the worker died

    block.restarted()  # the daemon, before it starts the next worker on this block
    assert scraper.value("superfluid_worker_live_lanes") == 0
    assert scraper.value("superfluid_worker_kv_blocks_used") == 0
    assert scraper.value("superfluid_worker_blocked_on_planner_seconds") == 0
    assert scraper.value("superfluid_worker_cache_hit_tokens_total") == 100

    second = WorkerMetrics.from_fd(block.fd)  # the new worker's total starts again from 0
    second.gauges(lanes_live=1, cache_entries=0, cache_bytes=0, cache_hit_tokens=30)
    second.tick(plan(6), events(wall_s=0.002, emits=(1,)))
    assert scraper.value("superfluid_worker_cache_hit_tokens_total") == 130
    assert scraper.value("superfluid_worker_ticks_total") == 2
    assert scraper.value("superfluid_worker_rejects_total") == 1
    assert scraper.value("superfluid_worker_decode_tokens_total") == 5
    assert scraper.value("superfluid_worker_prefill_tokens_total") == 16
    assert scraper.value("superfluid_worker_tick_seconds_count") == 2
    assert scraper.value("superfluid_worker_live_lanes") == 1
    second.close()


def test_speculation_counters_and_the_gate_by_slot_and_lanes(block: WorkerMetrics, scraper: Scraper) -> None:
    from superfluid.executor.speculation import StrategyTable
    from superfluid.executor.speculation_gate import MIN_SAMPLES, SpecGate

    w = WorkerMetrics.from_fd(block.fd)
    spec = (SpecStats(proposed=8, accepted=5, cert_id_in_effect=1), SpecStats(), SpecStats(3, 0, 2))
    ev = events(wall_s=0.001, emits=(6, 1, 1))._replace(
        emits=tuple(LaneEmit(lane_tag=i, n_tokens=n, spec=s) for i, (n, s) in enumerate(zip((6, 1, 1), spec))))
    w.tick(plan(), ev)
    w.tick(plan(), events(emits=(2,)))  # no drafts
    assert scraper.value("superfluid_worker_spec_proposed_total") == 11
    assert scraper.value("superfluid_worker_spec_accepted_total") == 5
    assert scraper.samples("superfluid_worker_spec_gate_state") == {}  # no figures yet: no series

    # A gate as the executor keeps it (executor.registry.spec_gate): slot 2 drafting at 1 lane,
    # stopped at 8 (3-8 lanes share the bucket); the worker writes its snapshot.
    table = StrategyTable()
    table.install(1, "prompt_lookup", 4, 1, 2)
    st = table.install(2, "prompt_lookup", 4, 1, 2)
    gate = SpecGate(table)
    for _ in range(2 * MIN_SAMPLES):
        on = gate.decide(st, 1)
        gate.record(st, 1, on, 0.001 if on else 0.002, 1)
        on = gate.decide(st, 5)
        gate.record(st, 5, on, 0.004 if on else 0.002, 1)
    w.spec_gate(gate.snapshot())
    state = scraper.samples("superfluid_worker_spec_gate_state", worker="0")
    assert state == {("1", "2"): 2, ("8", "2"): 3}  # (lanes, slot): 2 drafting, 3 stopped
    draft = scraper.samples("superfluid_worker_spec_draft_seconds_per_token", worker="0")
    plain = scraper.samples("superfluid_worker_spec_plain_seconds_per_token", worker="0")
    assert draft == {("1", "2"): pytest.approx(0.001), ("8", "2"): pytest.approx(0.004)}
    assert plain == {("1", "2"): pytest.approx(0.002), ("8", "2"): pytest.approx(0.002)}

    w.close()
    block.restarted()  # gauges go with the worker, counters stay
    assert scraper.samples("superfluid_worker_spec_gate_state") == {}
    assert scraper.value("superfluid_worker_spec_proposed_total") == 11


def test_a_second_worker_keeps_to_its_own_series(block: WorkerMetrics, scraper: Scraper) -> None:
    with WorkerMetrics.create("other") as other:
        scraper.workers.append((1, other, dict(READY, epoch=4)))
        w = WorkerMetrics.from_fd(block.fd)
        w.tick(plan(8), events(wall_s=0.01, emits=(2,), shed=(ShedEntry(kind=1, reason=2, bytes=9),)))
        w.ops([OpCompletion(status=0)])
        w.gauges(lanes_live=2, cache_entries=1, cache_bytes=9, cache_hit_tokens=7)
        for name, want in (("ticks_total", 1), ("decode_tokens_total", 2), ("cache_hit_tokens_total", 7),
                           ("live_lanes", 2), ("tick_seconds_count", 1), ("tick_seconds_sum", 0.01)):
            assert scraper.value("superfluid_worker_" + name, "0") == want, name
            assert scraper.value("superfluid_worker_" + name, "1") == 0, name
        assert set(scraper.samples("superfluid_worker_sheds_total", worker="1").values()) == {0}
        assert set(scraper.samples("superfluid_worker_op_completions_total", worker="1").values()) == {0}
        assert scraper.value("superfluid_worker_epoch", "1") == 4
        scraper.workers.pop()


def test_a_child_process_records_through_the_fd(block: WorkerMetrics, scraper: Scraper) -> None:
    code = ("import sys\n"
            "from superfluid.abi.records import LaneEmit, TickEvents, TickTimings\n"
            "from superfluid.daemon.metrics import WorkerMetrics\n"
            "m = WorkerMetrics.from_fd(int(sys.argv[1]))\n"
            "for _ in range(3):\n"
            "    ev = TickEvents(timings=TickTimings(wall_ns=2_000_000), emits=(LaneEmit(n_tokens=4),))\n"
            "    m.tick(None, ev)\n"
            "m.gauges(lanes_live=1, cache_entries=2, cache_bytes=3, cache_hit_tokens=11)\n")
    subprocess.run([*python(), "-c", code, str(block.fd)], pass_fds=(block.fd,), check=True, timeout=60)
    assert scraper.value("superfluid_worker_ticks_total") == 3
    assert scraper.value("superfluid_worker_decode_tokens_total") == 12
    assert scraper.value("superfluid_worker_tick_seconds_sum") == pytest.approx(0.006)
    assert scraper.value("superfluid_worker_cache_hit_tokens_total") == 11
    assert block.read()["ticks"] == 3


def test_exits_by_reason(block: WorkerMetrics, scraper: Scraper) -> None:
    counters = DaemonCounters()
    server = MetricsServer(make_registry(NAME, lambda: scraper.workers, counters), "127.0.0.1", 0)
    try:
        assert exit_reason(-9) == "signal_9" and exit_reason(70) == "exit_70" and exit_reason(0) == "exit_0"
        counters.exited(0, exit_reason(-9))
        counters.exited(0, exit_reason(-9))
        counters.exited(0, "spawn_failed")
        counters.exited(1, exit_reason(70))
        scraper.server, old = server, scraper.server
        exits = scraper.samples("superfluid_worker_exits_total")
        assert exits == {("signal_9", "0"): 2, ("spawn_failed", "0"): 1, ("exit_70", "1"): 1}
    finally:
        server.close()
        scraper.server = old


def test_every_metric_has_help_and_the_old_names_stay(scraper: Scraper) -> None:
    fams = scraper.families()
    assert all(f.documentation for f in fams.values())
    assert all(name.startswith("superfluid_worker_") for name in fams)
    for old in ("ticks", "rejects", "tokens_emitted", "restarts", "live_lanes", "cache_entries",
                "cache_bytes", "epoch", "state", "up", "last_exit_status", "heartbeat_age_seconds"):
        assert f"superfluid_worker_{old}" in fams, old
    assert fams["superfluid_worker_tick_seconds"].type == "histogram"
    assert fams["superfluid_worker_ticks"].type == "counter"
    assert fams["superfluid_worker_up"].type == "gauge"


def test_snapshot_of_a_real_segment(segment: Any, block: WorkerMetrics) -> None:
    segment.set_worker_state(WorkerState.READY)
    s = Scraper([(0, block, worker_snapshot(segment))], DaemonCounters())
    try:
        assert s.value("superfluid_worker_up") == 1
        assert s.value("superfluid_worker_state") == int(WorkerState.READY)
        assert s.value("superfluid_worker_epoch") == segment.epoch
        assert s.value("superfluid_worker_last_exit_status") == 0
    finally:
        s.server.close()


def test_partial_emits_dropped_on_a_full_stream_are_counted(segment: Any, block: WorkerMetrics, scraper: Scraper,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from superfluid.daemon import outbox

    monkeypatch.setattr(outbox, "PARTIAL_WAIT_S", 0.01)
    out = outbox.Outbox(segment, 1, WorkerMetrics.from_fd(block.fd), lambda: None)
    room = segment.stream_queue.n_slots
    for i in range(room + 3):  # nobody reads the stream: the last three find no room
        out.partial(0, 1, 5, 7, i)
    assert len(segment.stream_queue) == room and out.partial_dropped == 3
    assert scraper.value("superfluid_worker_partial_emits_dropped_total") == 3


def test_open_refuses_a_foreign_or_short_block(block: WorkerMetrics) -> None:
    fd = os.memfd_create("not-metrics")
    try:
        os.ftruncate(fd, 4096)
        with pytest.raises(ValueError, match="magic"):
            WorkerMetrics.from_fd(fd)
        os.ftruncate(fd, 8)
        with pytest.raises(ValueError, match="bytes"):
            WorkerMetrics.from_fd(fd)
    finally:
        os.close(fd)
    with WorkerMetrics.from_fd(block.fd) as m:  # the real one opens, and closing it leaves the block
        m.tick(None, events())
    assert block.read()["ticks"] == 1 and not block.closed
    block.close()
    block.close()  # twice is fine
    assert block.closed
