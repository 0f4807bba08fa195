"""Every status of contract §3 (and the tick statuses of §4), each from the
smallest plan that triggers it: the status, the field the message names,
and (for a reject) that nothing changed — executor state, runtime
sequences and counters, ring heads, and Executor.state_digest()."""

from __future__ import annotations

import pytest

from superfluid.abi import (
    CacheClass,
    Fault,
    Finish,
    PlanFlag,
    Sampling,
    ShedKind,
    ShedReason,
    Status,
    TickStatus,
)
from superfluid.abi.records import RingRef
from superfluid.client.builder import PlanBuilder
from superfluid.executor.tick_rings import LocalRings
from superfluid.testing.executor import BIG_BUDGET, admit_and_prefill, emit_of, fake, make_executor, put
from superfluid.testing.invariants import assert_reject, check_invariants, snapshot

IC = Status.RejectIllegalCombination


def P(seq: int, **kw) -> PlanBuilder:
    kw.setdefault("prefill_token_budget", BIG_BUDGET)
    return PlanBuilder(seq, **kw)


def host_lane_with_row(ex, seq: int, tag: int, tokens=(1, 2, 3)):
    """A HOST lane holding a pending logits row; its emit."""
    r = admit_and_prefill(ex, seq, tag, list(tokens), decode=1, sampling=Sampling.HOST)
    e = emit_of(r, tag)
    assert e.logits_row.ring_id and e.logits_nonce
    return e


# ---------------------------------------------------------- RejectIllegalCombination


def test_stale_plan_seq(ex):
    assert ex.tick(P(5).build()).ok
    assert_reject(ex, P(5).build(), IC, "TickPlan.plan_seq")
    assert_reject(ex, P(4).build(), IC, "TickPlan.plan_seq")
    assert ex.tick(P(6).build()).ok


def test_drain_with_admits(ex):
    ref = put(ex, [1, 2])
    assert_reject(ex, P(1, flags=PlanFlag.DRAIN).admit(1, ref).build(), IC, "TickPlan.admits")
    assert ex.tick(P(1, flags=PlanFlag.DRAIN).build()).ok  # DRAIN alone is fine


def test_admit_of_a_live_tag(ex):
    admit_and_prefill(ex, 1, 7, [1, 2])
    assert_reject(ex, P(2).admit(7, put(ex, [3])).build(), IC, "admits[0].lane_tag")


@pytest.mark.parametrize("field", ["admits", "prefills", "decodes", "commits", "retires"])
def test_duplicate_tags_via_decode_plan(ex, field):
    admit_and_prefill(ex, 1, 7, [1, 2, 3])
    ref = put(ex, [1, 2])
    b = P(2)
    if field == "admits":
        b.admit(8, ref).admit(8, ref)
    elif field == "prefills":
        b.admit(8, ref).prefill(8, 0, 1).prefill(8, 0, 1)
    elif field == "decodes":
        b.decode(7, 1).decode(7, 1)
        b.max_decode_lanes = 2
    elif field == "commits":
        b.commit(7, 1, 1).commit(7, 1, 1)
    else:
        b.retire(7).retire(7)
    assert_reject(ex, b.encode(), IC, f"{field}[1].lane_tag")


def test_undecodable_enum_via_decode_plan(ex):
    ref = put(ex, [1, 2])
    assert_reject(ex, P(1).admit(1, ref, sampling=3).encode(), IC, "admits[0].sampling")
    assert_reject(ex, P(1).admit(0, ref).encode(), IC, "admits[0].lane_tag")


def test_prefill_token_offset_mismatch(ex):
    ref = put(ex, [1, 2, 3])
    assert_reject(ex, P(1).admit(1, ref).prefill(1, 1, 1).build(), IC, "prefills[0].token_offset")
    # and for a live lane, against what it has prefilled so far
    assert ex.tick(P(1).admit(1, ref).prefill(1, 0, 2).build()).ok
    assert_reject(ex, P(2).prefill(1, 0, 1).build(), IC, "prefills[0].token_offset")
    assert_reject(ex, P(2).prefill(1, 3, 0).build(), IC, "prefills[0].token_offset")


def test_decode_of_a_lane_whose_prefill_is_incomplete(ex):
    ref = put(ex, [1, 2, 3, 4])
    assert_reject(ex, P(1).admit(1, ref).decode(1).build(), IC, "decodes[0].lane_tag")
    assert_reject(ex, P(1).admit(1, ref).prefill(1, 0, 3).decode(1).build(), IC, "decodes[0].lane_tag")
    # The budget decides: a chunk cut by prefill_token_budget leaves the prefill incomplete.
    plan = P(1, prefill_token_budget=3).admit(1, ref).prefill(1, 0, 4).decode(1).build()
    assert_reject(ex, plan, IC, "decodes[0].lane_tag")


def test_decode_of_a_finished_lane():
    ex = make_executor(fake(max_seq_len=8))
    r = admit_and_prefill(ex, 1, 1, [1, 2, 3, 4, 5, 6, 7, 8], decode=1)
    assert emit_of(r, 1).finish == int(Finish.LENGTH)
    assert_reject(ex, P(2).decode(1).build(), IC, "decodes[0].lane_tag")


@pytest.mark.parametrize("kw, field", [
    (dict(grammar_handle=1), "admits[0].grammar_handle"),
    (dict(strategy_slot=1), "admits[0].strategy_slot"),
    (dict(grammar_replay=1), "admits[0].grammar_replay"),
    (dict(logit_bias_handle=5), "admits[0].logit_bias_handle"),
])
def test_unregistered_grammar_strategy_bias(ex, kw, field):
    assert_reject(ex, P(1).admit(1, put(ex, [1, 2]), **kw).build(), IC, field)


def test_commit_to_a_non_host_lane(ex):
    admit_and_prefill(ex, 1, 1, [1, 2], decode=1)
    assert_reject(ex, P(2).commit(1, 3, 1).build(), IC, "commits[0].lane_tag")


def test_commit_to_a_finished_host_lane():
    ex = make_executor(fake(max_seq_len=4))
    r = admit_and_prefill(ex, 1, 1, [1, 2, 3, 4], decode=1, sampling=Sampling.HOST)
    assert emit_of(r, 1).finish == int(Finish.LENGTH)
    assert_reject(ex, P(2).commit(1, 3, 0).build(), IC, "commits[0].lane_tag")


def test_lane_both_retired_and_decoded_prefilled_or_committed(ex):
    admit_and_prefill(ex, 1, 1, [1, 2], decode=1)
    assert_reject(ex, P(2).decode(1).retire(1).build(), IC, "decodes[0].lane_tag")
    assert ex.tick(P(2).admit(2, put(ex, [1, 2, 3])).prefill(2, 0, 1).build()).ok
    assert_reject(ex, P(3).prefill(2, 1, 1).retire(2).build(), IC, "prefills[0].lane_tag")
    e = host_lane_with_row(ex, 3, 3)
    assert_reject(ex, P(4).commit(3, 1, e.logits_nonce).retire(3).build(), IC, "commits[0].lane_tag")


# ---------------------------------------------------------- RejectBudget


def test_max_decode_lanes_above_max_batch():
    ex = make_executor(fake(max_batch=4))
    assert_reject(ex, P(1, max_decode_lanes=5).build(), Status.RejectBudget, "TickPlan.max_decode_lanes")
    assert ex.tick(P(1, max_decode_lanes=4).build()).ok


def test_more_decodes_than_max_decode_lanes(ex):
    admit_and_prefill(ex, 1, 1, [1, 2])
    admit_and_prefill(ex, 2, 2, [1, 2])
    plan = P(3, max_decode_lanes=1).decode(1).decode(2).build()
    assert_reject(ex, plan, Status.RejectBudget, "TickPlan.decodes")


def test_prompt_longer_than_max_seq_len():
    ex = make_executor(fake(max_seq_len=8))
    assert_reject(ex, P(1).admit(1, put(ex, range(9))).build(), Status.RejectBudget, "admits[0].prompt")
    assert ex.tick(P(1).admit(1, put(ex, range(8))).build()).ok  # max_seq_len itself fits


# ---------------------------------------------------------- RejectBounds

B = Status.RejectBounds


def test_empty_prompt(ex):
    ref = put(ex, [])
    assert ref.len == 0
    assert_reject(ex, P(1).admit(1, ref).build(), B, "admits[0].prompt")


def test_prompt_token_outside_the_vocabulary(ex):
    assert_reject(ex, P(1).admit(1, put(ex, [1, 64])).build(), B, "admits[0].prompt")
    assert ex.tick(P(1).admit(1, put(ex, [1, 63])).build()).ok


def test_decode_replay_not_below_the_prompt_length(ex):
    ref = put(ex, [1, 2, 3])
    assert_reject(ex, P(1).admit(1, ref, decode_replay=3).build(), B, "admits[0].decode_replay")
    assert ex.tick(P(1).admit(1, ref, decode_replay=2).build()).ok


def test_prefill_past_prefill_end(ex):
    ref = put(ex, [1, 2, 3, 4, 5])
    assert_reject(ex, P(1).admit(1, ref).prefill(1, 0, 6).build(), B, "prefills[0].token_count")
    # decode_replay moves prefill_end back
    plan = P(1).admit(1, ref, decode_replay=2).prefill(1, 0, 4).build()
    assert_reject(ex, plan, B, "prefills[0].token_count")
    assert ex.tick(P(1).admit(1, ref, decode_replay=2).prefill(1, 0, 3).build()).ok
    assert_reject(ex, P(2).prefill(1, 3, 1).build(), B, "prefills[0].token_count")


def test_commit_token_outside_the_vocabulary(ex):
    e = host_lane_with_row(ex, 1, 1)
    assert_reject(ex, P(2).commit(1, 64, e.logits_nonce).build(), B, "commits[0].token_id")


@pytest.mark.parametrize("bad", [
    RingRef(1, 0, 1 << 20, 1),  # past the ring's capacity (1 << 20 tokens)
    RingRef(1, 0, 0, (1 << 20) + 1),  # longer than the ring
    RingRef(1, 0, (1 << 64) - 1, 2),  # offset + len overflows
])
def test_prompt_ref_outside_the_ring(ex, bad):
    put(ex, [1, 2, 3])
    assert_reject(ex, P(1).admit(1, bad).build(), B, "admits[0].prompt")


@pytest.mark.parametrize("ring_id", [0, 2, 3, 9])
def test_prompt_ref_of_another_ring(ex, ring_id):
    ref = put(ex, [1, 2, 3])
    assert_reject(ex, P(1).admit(1, ref._replace(ring_id=ring_id)).build(), B, "admits[0].prompt.ring_id")


# ---------------------------------------------------------- RejectUnknownLane

U = Status.RejectUnknownLane


def test_unknown_lanes(ex):
    admit_and_prefill(ex, 1, 1, [1, 2])
    assert_reject(ex, P(2).prefill(9, 0, 1).build(), U, "prefills[0].lane_tag")
    assert_reject(ex, P(2).decode(9).build(), U, "decodes[0].lane_tag")
    assert_reject(ex, P(2).commit(9, 1, 1).build(), U, "commits[0].lane_tag")
    assert_reject(ex, P(2).retire(9).build(), U, "retires[0].lane_tag")
    assert ex.tick(P(2).retire(1).build()).ok
    assert_reject(ex, P(3).retire(1).build(), U, "retires[0].lane_tag")  # a retired lane is gone
    assert_reject(ex, P(3).decode(1).build(), U, "decodes[0].lane_tag")


def test_a_faulted_lane_is_unknown_but_for_its_retire(ex):
    admit_and_prefill(ex, 1, 1, [1, 2])
    ex.runtime.inject_fault(ex.lanes[1].seq)
    r = ex.tick(P(2).decode(1).build())
    assert [f.lane_tag for f in r.events.faults] == [1]
    assert_reject(ex, P(3).decode(1).build(), U, "decodes[0].lane_tag")
    assert_reject(ex, P(3).prefill(1, 2, 0).build(), U, "prefills[0].lane_tag")
    assert ex.tick(P(3).retire(1).build()).ok
    assert_reject(ex, P(4).retire(1).build(), U, "retires[0].lane_tag")


# ---------------------------------------------------------- RejectHostRules

H = Status.RejectHostRules


def test_host_decode_of_more_than_one_token(ex):
    admit_and_prefill(ex, 1, 1, [1, 2], sampling=Sampling.HOST)
    assert_reject(ex, P(2).decode(1, 2).build(), H, "decodes[0].max_new_tokens")
    assert_reject(ex, P(2).decode(1, 0).build(), H, "decodes[0].max_new_tokens")


def test_host_pending_row_not_committed(ex):
    host_lane_with_row(ex, 1, 1)
    assert_reject(ex, P(2).decode(1).build(), H, "decodes[0].lane_tag")


def test_commit_with_no_pending_row(ex):
    admit_and_prefill(ex, 1, 1, [1, 2], sampling=Sampling.HOST)
    assert_reject(ex, P(2).commit(1, 1, 0).build(), H, "commits[0].lane_tag")


# ---------------------------------------------------------- RejectStaleNonce


def test_stale_nonce(ex):
    e = host_lane_with_row(ex, 1, 1)
    assert_reject(ex, P(2).commit(1, 5, e.logits_nonce + 1).build(), Status.RejectStaleNonce,
                  "commits[0].logits_nonce")
    r = ex.tick(P(2).commit(1, 5, e.logits_nonce).decode(1).build())
    assert r.ok
    e2 = emit_of(r, 1)
    assert e2.logits_nonce != e.logits_nonce
    # the first row's nonce is stale now
    assert_reject(ex, P(3).commit(1, 5, e.logits_nonce).build(), Status.RejectStaleNonce,
                  "commits[0].logits_nonce")


# ---------------------------------------------------------- RejectStaleSeed


def test_unknown_seed_handle(ex):
    plan = P(1).admit(1, put(ex, [1, 2]), seed_handle=3).build()
    assert_reject(ex, plan, Status.RejectStaleSeed, "admits[0].seed_handle")


# ---------------------------------------------------------- RejectBadRefGeneration


def test_prompt_ref_wrapped_over():
    ex = make_executor(rings=LocalRings(prompt_tokens=16))
    old = put(ex, range(8))
    put(ex, range(10))  # does not fit after it: the ring wraps over `old`
    assert_reject(ex, P(1).admit(1, old).build(), Status.RejectBadRefGeneration, "admits[0].prompt")


def test_prompt_ref_from_the_future(ex):
    ref = put(ex, [1, 2, 3])
    plan = P(1).admit(1, ref._replace(generation=ref.generation + 1)).build()
    assert_reject(ex, plan, Status.RejectBadRefGeneration, "admits[0].prompt")
    plan = P(1).admit(1, ref._replace(offset=ref.offset + 3)).build()  # not written yet
    assert_reject(ex, plan, Status.RejectBadRefGeneration, "admits[0].prompt")


# ---------------------------------------------------------- NeedsReplan

R = Status.NeedsReplan
EVICT = int(CacheClass.RESIDENT_PREFIX_CLASS)


def test_needs_replan_when_cells_do_not_fit():
    ex = make_executor(fake(cells_total=8, page=4))
    plan = P(1).admit(1, put(ex, range(12))).prefill(1, 0, 12).build()
    assert_reject(ex, plan, R, "TickPlan.evictable_cache_classes")
    # allowing eviction does not help with an empty cache
    plan = P(1, evictable_cache_classes=EVICT, max_evict_bytes=1 << 40).admit(1, put(ex, range(12)))
    assert_reject(ex, plan.prefill(1, 0, 12).build(), R, "TickPlan.max_evict_bytes")
    assert ex.tick(P(1).admit(1, put(ex, range(8))).prefill(1, 0, 8).build()).ok


def test_needs_replan_when_sequence_slots_do_not_fit():
    ex = make_executor(fake(max_seqs=1))
    admit_and_prefill(ex, 1, 1, [1, 2])
    assert_reject(ex, P(2).admit(2, put(ex, [1])).build(), R, "TickPlan.evictable_cache_classes")
    assert ex.tick(P(2).admit(2, put(ex, [1])).retire(1).build()).ok  # a retire frees its slot


def cached_executor():
    """A pool of 16 cells: one 8-cell cache entry (1024 bytes), 8 free cells."""
    ex = make_executor(fake(cells_total=16, page=4))
    admit_and_prefill(ex, 1, 1, range(8), decode=1)
    assert ex.tick(P(2).retire(1, publish_to_cache=True).build()).ok
    assert len(ex.cache) == 1 and ex.cache.resident_bytes == 8 * 128
    assert ex.runtime.mem_counters().cells_used == 8
    return ex


def test_needs_replan_when_the_eviction_cap_is_too_small():
    ex = cached_executor()
    big = P(3, evictable_cache_classes=EVICT, max_evict_bytes=1023).admit(2, put(ex, range(12)))
    assert_reject(ex, big.prefill(2, 0, 12).build(), R, "TickPlan.max_evict_bytes")
    no_class = P(3, max_evict_bytes=1 << 40).admit(2, put(ex, range(12)))
    assert_reject(ex, no_class.prefill(2, 0, 12).build(), R, "TickPlan.evictable_cache_classes")


def test_needs_replan_when_the_protected_quota_forbids_eviction():
    ex = cached_executor()
    plan = P(3, evictable_cache_classes=EVICT, max_evict_bytes=1 << 40, protected_quota_bytes=1).admit(
        2, put(ex, range(12))).prefill(2, 0, 12).build()
    assert_reject(ex, plan, R, "TickPlan.max_evict_bytes")


def test_eviction_within_the_plan_allowance_is_a_shed_entry():
    ex = cached_executor()
    plan = P(3, evictable_cache_classes=EVICT, max_evict_bytes=1024).admit(
        2, put(ex, range(12))).prefill(2, 0, 12).build()
    r = ex.tick(plan)
    assert r.ok, r.message
    shed = r.events.shed
    assert r.events.tick_status == int(TickStatus.SHED)
    assert shed.evictions_performed == 1 and shed.bytes_evicted == 1024
    (e,) = shed.entries
    assert (e.lane_tag, e.kind, e.reason, e.bytes, e.tokens) == (
        0, int(ShedKind.CACHE_EVICTION), int(ShedReason.MEMORY), 1024, 8)
    assert len(ex.cache) == 0
    check_invariants(ex)


# ---------------------------------------------------------- Fatal


@pytest.mark.parametrize("site", ["step", "create", "free"])
def test_fatal_runtime_error(site):
    ex = make_executor(fake(), fatal_exit=False)
    admit_and_prefill(ex, 1, 1, [1, 2, 3])
    ex.runtime.inject_fatal(on=site)
    plan = {"step": P(2).decode(1), "create": P(2).admit(2, put(ex, [1])), "free": P(2).retire(1)}[site]
    r = ex.tick(plan.build())
    assert r.status == Status.Fatal and r.events.status == int(Status.Fatal)
    assert r.message.startswith("runtime: ")
    assert ex.dead
    # every later tick is refused, whatever it holds, and changes nothing
    for plan in (P(3).build(), P(4).decode(1).build(), P(5).admit(9, put(ex, [1])).build()):
        before = snapshot(ex)
        again = ex.tick(plan)
        assert again.status == Status.Fatal and again.message.startswith("executor: ")
        assert before == snapshot(ex)


# ---------------------------------------------------------- tick statuses


def test_tick_status_ok(ex):
    r = admit_and_prefill(ex, 1, 1, [1, 2, 3], decode=4)
    assert r.events.tick_status == int(TickStatus.OK)
    assert not r.events.shed.entries and not r.events.faults
    assert emit_of(r, 1).n_tokens == 4 or emit_of(r, 1).finish
    assert len(r.events.admit_results) == 1


def test_tick_status_shed_by_the_prefill_budget(ex):
    ref = put(ex, range(10))
    r = ex.tick(PlanBuilder(1, prefill_token_budget=6).admit(1, ref).prefill(1, 0, 10).build())
    assert r.ok and r.events.tick_status == int(TickStatus.SHED)
    (e,) = r.events.shed.entries
    assert (e.lane_tag, e.kind, e.reason, e.tokens) == (
        1, int(ShedKind.PREFILL_CHUNK), int(ShedReason.BUDGET), 4)
    assert r.events.shed.prefill_chunks_dropped == 1
    assert ex.lanes[1].prefilled == 6  # it continues where the check said
    assert ex.tick(PlanBuilder(2, prefill_token_budget=6).prefill(1, 6, 4).decode(1).build()).ok


def test_tick_status_lane_errors_wins_over_shed(ex):
    admit_and_prefill(ex, 1, 1, [1, 2, 3])
    ex.runtime.inject_fault(ex.lanes[1].seq, code=int(Fault.INTERNAL))
    ref = put(ex, range(10))
    r = ex.tick(PlanBuilder(2, prefill_token_budget=4).admit(2, ref).prefill(2, 0, 10).decode(1).build())
    assert r.ok
    assert r.events.tick_status == int(TickStatus.LANE_ERRORS)
    assert [(f.lane_tag, f.code) for f in r.events.faults] == [(1, int(Fault.INTERNAL))]
    assert r.events.shed.prefill_chunks_dropped == 1
    assert 1 not in ex.lanes and 1 in ex.lanes.faulted and 2 in ex.lanes
    check_invariants(ex)


def test_a_fault_faults_exactly_the_lanes_of_its_step(ex):
    for tag in (1, 2, 3):
        admit_and_prefill(ex, tag, tag, [tag, 2, 3])
    ex.runtime.inject_fault(ex.lanes[2].seq)
    r = ex.tick(P(4, max_decode_lanes=2).decode(1, 3).decode(2, 3).build())
    # one decode step carries lanes 1 and 2: both fault; lane 3, not decoded, goes on
    assert sorted(f.lane_tag for f in r.events.faults) == [1, 2]
    assert set(ex.lanes) == {3} and ex.lanes.faulted == {1, 2}
    assert not r.events.emits
    check_invariants(ex)


# ---------------------------------------------------------- executor bugs


def test_duplicate_admits_in_a_plan_record(ex):
    """The record-level checks (decode_plan's) run on a TickPlan record too:
    two admits of one tag must not create two sequences and leak one."""
    ref = put(ex, [1, 2])
    assert_reject(ex, P(1).admit(8, ref).admit(8, ref).build(), IC, "admits[1].lane_tag")


def test_sampling_out_of_range_in_a_plan_record(ex):
    ref = put(ex, [1, 2])
    assert_reject(ex, P(1).admit(1, ref, sampling=3).prefill(1, 0, 2).decode(1).build(), IC,
                  "admits[0].sampling")


def test_a_runtime_error_freeing_a_retired_lane_does_not_escape(ex):
    """contract §10: a runtime error is a lane fault or Fatal, never an exception
    out of the tick (a non-fatal error from seq_free is taken as nothing
    left to free)."""
    admit_and_prefill(ex, 1, 1, [1, 2, 3])
    ex.runtime.inject_capacity_fault(on="free")
    r = ex.tick(P(2).retire(1).build())
    assert r.status == Status.OK
    assert not ex.lanes and not ex.lanes.faulted


def test_an_emit_that_does_not_fit_the_token_ring_faults_its_lane():
    ex = make_executor(rings=LocalRings(prompt_tokens=64, emit_tokens=4, logits_floats=1 << 12))
    admit_and_prefill(ex, 1, 1, [1, 2, 3])
    r = ex.tick(P(2).decode(1, 6).build())
    assert r.ok and r.events.tick_status == int(TickStatus.LANE_ERRORS)
    assert [(f.lane_tag, f.code) for f in r.events.faults] == [(1, int(Fault.REF_SPAN_OOB))]
    assert not r.events.emits and ex.lanes.faulted == {1}
    check_invariants(ex)


def test_a_row_that_does_not_fit_the_logits_ring_faults_its_lane():
    ex = make_executor(rings=LocalRings(prompt_tokens=64, emit_tokens=64, logits_floats=32))  # vocab 64
    admit_and_prefill(ex, 1, 1, [1, 2, 3], sampling=Sampling.HOST)
    r = ex.tick(P(2).decode(1).build())
    assert r.ok and [(f.lane_tag, f.code) for f in r.events.faults] == [(1, int(Fault.REF_SPAN_OOB))]


def test_a_faulted_tag_can_be_readmitted(ex):
    """A faulted lane's tag may be admitted again: without a retire (the admit
    replaces it), or with one in the same plan (retires run first)."""
    for seq0, tag in ((1, 1), (10, 2)):
        admit_and_prefill(ex, seq0, tag, [1, 2])
        ex.runtime.inject_fault(ex.lanes[tag].seq)
        assert ex.tick(P(seq0 + 1).decode(tag).build()).events.faults
        assert tag in ex.lanes.faulted
    r = ex.tick(P(20).admit(1, put(ex, [5, 6, 7])).prefill(1, 0, 3).decode(1, 2).build())
    assert r.ok and emit_of(r, 1).n_tokens == 2 and 1 not in ex.lanes.faulted
    r = ex.tick(P(21).retire(2).admit(2, put(ex, [5, 6, 7])).build())
    assert r.ok and 2 in ex.lanes and not ex.lanes.faulted
    check_invariants(ex)


def test_retire_a_faulted_lane_and_readmit_its_tag_with_a_prefill(ex):
    admit_and_prefill(ex, 1, 1, [1, 2])
    ex.runtime.inject_fault(ex.lanes[1].seq)
    assert ex.tick(P(2).decode(1).build()).events.faults
    r = ex.tick(P(3).retire(1).admit(1, put(ex, [5, 6, 7])).prefill(1, 0, 3).decode(1).build())
    assert r.ok, r.message
