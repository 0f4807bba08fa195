"""decode_plan: step 1 of contract §3. Each rule has the smallest plan that
breaks it, the status it must give and the field it must name."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, strategies as st

from superfluid.abi import MAX_TOP_LOGPROBS, PLAN_SEQ_MAX, ParamFlag, PlanFlag, Status, codec, ffi
from superfluid.abi.plan_codec import (
    PlanReject,
    decode_events,
    decode_plan,
    encode_events_into,
    plan_seq_of,
    reject_events,
)
from superfluid.abi.records import LaneAdmit, LaneRetire, RingRef, SamplingParams, TickEvents
from superfluid.client import PlanBuilder, sampling_params

PROMPT = RingRef(1, 0, 0, 4)


def _reject(builder_or_bytes, status: Status, field: str) -> PlanReject:
    raw = builder_or_bytes if isinstance(builder_or_bytes, (bytes, bytearray)) else builder_or_bytes.encode()
    with pytest.raises(PlanReject) as e:
        decode_plan(raw)
    assert e.value.status == status, e.value
    assert e.value.field == field, e.value
    return e.value


def test_a_full_plan_decodes_unchanged():
    b = (PlanBuilder(42, flags=PlanFlag.PARTIAL_EMITS, prefill_token_budget=100, max_evict_bytes=7)
         .admit(1, PROMPT, sampling=1, params=sampling_params(0.7, top_k=40, top_p=0.9, min_p=0.05,
                                                               repeat_penalty=1.1, ignore_eos=True),
                rng_counter_base=99, decode_replay=1, want_logprobs=MAX_TOP_LOGPROBS)
         .prefill(1, 0, 3).decode(1, 4, 2).commit(7, 12, 555).retire(8, True).retire(9))
    plan = decode_plan(b.encode())
    want = b.build()
    assert plan.plan_seq == 42 and plan.max_decode_lanes == 1
    assert plan.admits[0].lane_tag == 1 and plan.admits[0].params.top_k == 40
    assert math.isclose(plan.admits[0].params.temperature, 0.7, rel_tol=1e-6)
    assert plan.prefills == want.prefills and plan.decodes == want.decodes and plan.commits == want.commits
    assert plan.retires == (LaneRetire(8, 1), LaneRetire(9, 0))


@pytest.mark.parametrize("kind", ["admits", "prefills", "decodes", "commits", "retires"])
def test_duplicate_lane_tags_in_any_list(kind):
    b = PlanBuilder(1, max_decode_lanes=4)
    add = {
        "admits": lambda t: b.admit(t, PROMPT),
        "prefills": lambda t: b.prefill(t, 0, 1),
        "decodes": lambda t: b.decode(t, 1),
        "commits": lambda t: b.commit(t, 1, 1),
        "retires": lambda t: b.retire(t),
    }[kind]
    add(5), add(6), add(5)
    e = _reject(b, Status.RejectIllegalCombination, f"{kind}[2].lane_tag")
    assert "twice" in e.message


def test_the_same_tag_in_different_lists_is_fine():
    decode_plan(PlanBuilder(1).admit(5, PROMPT).prefill(5, 0, 4).decode(5, 1).encode())


@pytest.mark.parametrize("seq", [PLAN_SEQ_MAX + 1, (1 << 64) - 1])
def test_plan_seq_above_its_range(seq):
    # A value nothing can follow would lock the session: refused, not applied.
    _reject(PlanBuilder(seq), Status.RejectBounds, "TickPlan.plan_seq")
    assert decode_plan(PlanBuilder(PLAN_SEQ_MAX).encode()).plan_seq == PLAN_SEQ_MAX


def test_unknown_plan_flags():
    _reject(PlanBuilder(1, flags=8), Status.RejectIllegalCombination, "TickPlan.flags")


def test_unknown_cache_classes():
    _reject(PlanBuilder(1, evictable_cache_classes=6), Status.RejectIllegalCombination,
            "TickPlan.evictable_cache_classes")


def test_sampling_out_of_range():
    _reject(PlanBuilder(1).admit(5, PROMPT, sampling=3), Status.RejectIllegalCombination, "admits[0].sampling")


def test_determinism_class_out_of_range():
    _reject(PlanBuilder(1).admit(5, PROMPT, determinism_class=9), Status.RejectIllegalCombination,
            "admits[0].determinism_class")


def test_too_many_logprobs():
    _reject(PlanBuilder(1).admit(5, PROMPT, want_logprobs=MAX_TOP_LOGPROBS + 1), Status.RejectBounds,
            "admits[0].want_logprobs")


def test_lane_tag_zero_is_reserved():
    _reject(PlanBuilder(1).admit(0, PROMPT), Status.RejectIllegalCombination, "admits[0].lane_tag")


@pytest.mark.parametrize("field,value,status", [
    ("temperature", math.inf, Status.RejectBounds),
    ("temperature", math.nan, Status.RejectBounds),
    ("top_p", -0.5, Status.RejectBounds),
    ("min_p", 1.5, Status.RejectBounds),
    ("min_p", -0.1, Status.RejectBounds),
    ("repeat_penalty", -1.0, Status.RejectBounds),
    ("presence_penalty", -math.inf, Status.RejectBounds),
    ("freq_penalty", math.nan, Status.RejectBounds),
    ("flags", 2, Status.RejectIllegalCombination),
])
def test_sampling_params_ranges(field, value, status):
    params = SamplingParams()._replace(**{field: value})
    _reject(PlanBuilder(1).admit(5, PROMPT, params=params), status, f"admits[0].params.{field}")


def test_params_at_their_edges_are_accepted():
    ok = SamplingParams(temperature=-1.0, top_k=1 << 31, top_p=1.0, min_p=1.0, repeat_penalty=0.0,
                        presence_penalty=-2.0, freq_penalty=2.0, flags=int(ParamFlag.IGNORE_EOS))
    decode_plan(PlanBuilder(1).admit(5, PROMPT, params=ok).encode())


def test_prefill_range_overflowing_u32():
    _reject(PlanBuilder(1).prefill(5, (1 << 32) - 2, 3), Status.RejectBounds, "prefills[0].token_count")


def test_publish_to_cache_is_a_bool():
    b = PlanBuilder(1)
    b.retires.append(LaneRetire(5, 2))
    _reject(b, Status.RejectIllegalCombination, "retires[0].publish_to_cache")


def test_encoding_errors_are_bounds_rejects():
    raw = bytearray(PlanBuilder(1).decode(5).encode())
    raw[codec.MSG_HEADER_BYTES + ffi.offsetof("TickPlan", "decodes")] = 3
    _reject(raw, Status.RejectBounds, "TickPlan.decodes")
    _reject(b"", Status.RejectBounds, "MsgHeader")


def test_partial_emit_pointer_is_cleared_across_processes():
    plan = PlanBuilder(1).build()._replace(on_partial_emit=0xDEAD, partial_emit_user=7)
    raw = codec.encode("TickPlan", plan)
    assert decode_plan(raw).on_partial_emit == 0
    assert decode_plan(raw, in_process=True).on_partial_emit == 0xDEAD


def test_plan_seq_of_a_plan_that_does_not_decode():
    raw = bytearray(PlanBuilder(77).decode(5).decode(5).encode())
    assert plan_seq_of(raw) == 77
    assert plan_seq_of(b"\0" * 3) == 0


def test_reject_events_round_trip():
    e = _reject(PlanBuilder(1, flags=64), Status.RejectIllegalCombination, "TickPlan.flags")
    ev = reject_events(1, e, epoch=3)
    buf = bytearray(4096)
    encode_events_into(buf, ev)
    back = decode_events(buf)
    assert back.status == Status.RejectIllegalCombination and back.worker_epoch == 3
    assert back.message.decode().startswith("TickPlan.flags: unknown bits")


@given(st.lists(st.integers(1, 20), max_size=12))
def test_duplicates_found_exactly_when_present(tags):
    b = PlanBuilder(1, max_decode_lanes=len(tags))
    for t in tags:
        b.decode(t, 1)
    if len(set(tags)) == len(tags):
        assert [d.lane_tag for d in decode_plan(b.encode()).decodes] == tags
    else:
        with pytest.raises(PlanReject) as e:
            decode_plan(b.encode())
        assert e.value.status == Status.RejectIllegalCombination


def test_events_decode_checks_too():
    buf = bytearray(codec.encode("TickEvents", TickEvents(plan_seq=1)))
    buf[codec.MSG_HEADER_BYTES + ffi.offsetof("TickEvents", "emits") + 4] = 9
    with pytest.raises(codec.CodecError):
        decode_events(buf)


def test_builder_admit_defaults():
    a = PlanBuilder(1).admit(3, PROMPT).build().admits[0]
    assert a == LaneAdmit(lane_tag=3, prompt=PROMPT)
