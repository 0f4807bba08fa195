"""What the executor tests check after a tick: a deep snapshot of everything
a tick may change (to prove a reject changed nothing, independently of
Executor.state_digest), the invariants that hold between any two ticks, and
what an accepted tick's events must say."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import numpy as np

from superfluid.abi import AdmitStatus, Finish, ShedKind, ShedReason, Status, TickStatus
from superfluid.engine.fake import FakeRuntime
from superfluid.executor.executor import Executor, TickResult
from superfluid.testing.executor import HOST, emitted


def _lane_state(lane) -> tuple:
    return (lane.tag, lane.seq, lane.sampling, tuple(lane.params), lane.rng_base, lane.rng_counter,
            tuple(lane.prompt), lane.prefill_end, lane.prefilled, tuple(lane.committed), lane.pending_input,
            None if lane.pending_row is None else (lane.pending_row.nonce, tuple(lane.pending_row.ref)),
            lane.finished, lane.logprobs_top, lane.granted_class, lane.bias is None)


def inner_runtime(ex: Executor) -> Any:
    """The executor's runtime, under the fault-injection wrapper where it has one."""
    return ex.fault_rt.inner if ex.fault_rt is not None else ex.runtime


def snapshot(ex: Executor) -> dict[str, Any]:
    """Everything a tick may change, copied: executor fields, lanes, cache
    entries, the runtime's sequences (their tokens, on the fake), its
    counters and call statistics, and the heads of the rings the executor
    writes. A rejected plan must leave every part equal."""
    rt = inner_runtime(ex)
    snap: dict[str, Any] = dict(
        digest=ex.state_digest(),
        last_plan_seq=ex.counters.last_plan_seq, tick_count=ex.counters.tick_count, nonce=ex.counters.nonce,
        faulted=sorted(ex.lanes.faulted), inject=sorted(ex.lanes.injected.items()), biases=sorted(ex.registry.biases),
        next_handle=ex.registry.next_handle, pending_shed=list(ex.pending.shed),
        lanes={t: _lane_state(ln) for t, ln in ex.lanes.items()},
        cache=sorted(dataclasses.astuple(e) for e in ex.cache),
        mem=rt.mem_counters(),
        token_head=ex.rings.tokens.head, logits_head=ex.rings.logits.head,
        tokens_emitted=ex.counters.tokens_emitted, dead=ex.dead,
    )
    if isinstance(rt, FakeRuntime):
        snap["seqs"] = {s: rt.seq_tokens(s) for s in rt.live_seqs()}
        snap["stats"] = dataclasses.replace(rt.stats)
    return snap


def assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    diff = [k for k in before if before[k] != after[k]]
    assert not diff, {k: (before[k], after[k]) for k in diff}


def assert_reject(ex: Executor, plan, status: Status, field: str) -> TickResult:
    """Tick a plan that must be refused with `status`, naming `field`, and
    change nothing."""
    before = snapshot(ex)
    r = ex.tick(plan)
    assert r.status == status, (r.status, r.message)
    assert r.message.startswith(field + ": "), f"expected field {field!r}, got {r.message!r}"
    assert r.events.status == int(status)
    assert r.events.message == r.message.encode()
    assert not r.events.emits and not r.events.admit_results and not r.events.faults
    assert_unchanged(before, snapshot(ex))
    return r


# ---------------------------------------------------------------- invariants


def check_invariants(ex: Executor) -> None:
    """What must hold between any two ticks, whatever ran."""
    rt = inner_runtime(ex)
    mem = rt.mem_counters()
    # Cell conservation: every runtime sequence is a live lane's or a cache entry's.
    assert mem.seqs == len(ex.lanes) + len(ex.cache), (mem, len(ex.lanes), len(ex.cache))
    seqs = [ln.seq for ln in ex.lanes.values()] + [e.seq for e in ex.cache]
    assert len(set(seqs)) == len(seqs), "two owners of one sequence"
    if isinstance(rt, FakeRuntime):
        assert sorted(seqs) == rt.live_seqs()
    assert not (set(ex.lanes) & ex.lanes.faulted), "a lane both live and faulted"
    for tag, ln in ex.lanes.items():
        # Forward-once: the sequence holds the committed tokens less the pending one.
        held = len(ln.committed) - (ln.pending_input is not None)
        assert rt.seq_len(ln.seq) == held, (tag, rt.seq_len(ln.seq), len(ln.committed), ln.pending_input)
        if isinstance(rt, FakeRuntime):
            assert rt.seq_tokens(ln.seq) == tuple(ln.committed[:held]), tag
        if ln.pending_input is not None:
            assert ln.committed[-1] == ln.pending_input
        assert ln.committed[:min(len(ln.committed), len(ln.prompt))] == ln.prompt[:len(ln.committed)]
        assert len(ln.committed) <= ex.desc.max_seq_len
        assert ln.prefilled <= ln.prefill_end
        if ln.pending_row is not None:
            assert ln.sampling == HOST and not ln.finished
    page = max(1, ex.desc.page)
    for e in ex.cache:
        assert rt.seq_len(e.seq) == len(e.tokens)
        if isinstance(rt, FakeRuntime):
            assert rt.seq_tokens(e.seq) == e.tokens
        if not ex.desc.exact_only:
            assert len(e.tokens) % page == 0 and len(e.tokens) > 0
        assert e.bytes == len(e.tokens) * rt.cell_bytes()
    if mem.cells_total:
        assert mem.cells_used <= mem.cells_total
    # Leases pin what they name; exported entries live in host memory only.
    pins = Counter(ls.entry.eid for ls in ex.leases)
    for e in ex.cache.all():
        assert e.pins == pins.get(e.eid, 0), (e.eid, e.pins, pins)
        assert e.resident == (e.blob is None), e.eid
        if e.bare:
            assert e.resident and any(ls.adopt and ls.entry is e for ls in ex.leases)
    for ls in ex.leases:
        assert ex.cache.get(ls.entry.eid) is ls.entry
        # (an expired lease is swept by the next check: contract §3 step 3)
        assert ls.entry.tokens[:len(ls.prefix)] == ls.prefix and ls.expires >= ex.counters.tick_count
    assert ex.cache.host_bytes <= max(ex.cache.host_max_bytes, 0)
    assert ex.cache.unpinned_bytes == sum(e.bytes for e in ex.cache if e.pins == 0)  # (kept, not summed)


def check_events(ex: Executor, plan, r: TickResult) -> None:
    """What an accepted tick's events must say (contract §2, §4)."""
    ev = r.events
    assert r.status == Status.OK and ev.status == int(Status.OK)
    assert ev.plan_seq == plan.plan_seq
    shed = ev.shed
    chunks = [s for s in shed.entries if s.kind == int(ShedKind.PREFILL_CHUNK)]
    evictions = [s for s in shed.entries if s.kind == int(ShedKind.CACHE_EVICTION)]
    assert len(chunks) + len(evictions) == len(shed.entries)
    assert shed.prefill_chunks_dropped == len(chunks)
    assert shed.evictions_performed == len(evictions)
    assert shed.bytes_evicted == sum(s.bytes for s in evictions)
    admitted = {a.lane_tag for a in plan.admits}
    for s in evictions:  # a takeover or a lost import names the lane it seeded
        named = s.reason in (int(ShedReason.TAKEOVER), int(ShedReason.LOST))
        assert (s.lane_tag in admitted) if named else s.lane_tag == 0, s
    assert all(s.tokens > 0 for s in chunks)
    want = (TickStatus.LANE_ERRORS if ev.faults else
            TickStatus.SHED if shed.prefill_chunks_dropped or shed.evictions_performed else TickStatus.OK)
    assert ev.tick_status == int(want)
    assert [a.lane_tag for a in ev.admit_results] == [a.lane_tag for a in plan.admits]
    assert all(a.status == int(AdmitStatus.ADMITTED) for a in ev.admit_results)
    decoded = [d.lane_tag for d in plan.decodes]
    faulted = {f.lane_tag for f in ev.faults}
    assert len(faulted) == len(ev.faults), "a lane faulted twice in one tick"
    emits = [e.lane_tag for e in ev.emits]
    assert len(set(emits)) == len(emits), "two emits for one lane"
    # Every emit is a decoded lane's; every decoded lane that did not fault has one.
    assert set(emits) <= set(decoded)
    assert set(emits) == set(decoded) - faulted
    grants = {d.lane_tag: d.max_new_tokens for d in plan.decodes}
    for e in ev.emits:
        lane = ex.lanes[e.lane_tag]
        assert e.n_tokens <= grants[e.lane_tag]
        if lane.sampling == HOST:
            assert e.n_tokens == 0
            if e.logits_row.ring_id:
                assert lane.pending_row is not None and lane.pending_row.nonce == e.logits_nonce
                row = ex.rings.logits.read(e.logits_row)
                assert row.shape == (ex.desc.vocab_size,) and row.dtype == np.float32
        else:
            toks = emitted(ex, e)
            assert len(toks) == e.n_tokens
            assert all(0 <= t < ex.desc.vocab_size for t in toks)
            if toks:
                assert lane.committed[-len(toks):] == toks
        if e.finish == int(Finish.EOS):
            assert ex.runtime.is_eos(lane.committed[-1]) and lane.finished
        elif e.finish == int(Finish.LENGTH):
            assert len(lane.committed) >= ex.desc.max_seq_len and lane.finished
        else:
            assert e.finish == int(Finish.NONE)
    m = ev.mem
    mc = ex.runtime.mem_counters()
    assert m.pool_blocks_used == mc.cells_used // max(1, ex.desc.page)
    assert m.allocated_bytes == mc.allocated_bytes


# ---------------------------------------------------------------- the planner model

