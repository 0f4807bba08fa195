"""Ops (contract §7): msgpack maps {op, op_id, ...}; a failure is the
completion's status and never affects a tick. DESCRIBE, logit biases (and
that a banned token never appears, whichever path samples the lane),
INJECT_FAULT, CACHE_CLEAR (and its shed entries in the next tick), unknown
ops, malformed payloads, and the ops of later issues (Unsupported)."""

from __future__ import annotations

import dataclasses
import math

import msgpack
import numpy as np
import pytest

from superfluid.abi import (
    ABI_VERSION,
    Fault,
    OpKind,
    OpStatus,
    Sampling,
    ShedKind,
    ShedReason,
    Status,
    TickStatus,
)
from superfluid.client.builder import PlanBuilder, sampling_params
from superfluid.testing.executor import (
    BIG_BUDGET,
    admit_and_prefill,
    emit_of,
    emitted,
    fake,
    make_executor,
    put,
)
from superfluid.testing.invariants import check_invariants, snapshot


def op(ex, **msg):
    msg.setdefault("op_id", 42)
    return ex.op(msg)


def error_of(done) -> str:
    return msgpack.unpackb(done.payload)["error"]


# ---------------------------------------------------------------- DESCRIBE


def test_describe():
    rt = fake(vocab_size=50, max_seq_len=33, max_batch=7, max_seqs=9, page=8, prefill_step_tokens=5,
              eos_ids=[3, 49], engine_sampling=True, engine_draws=True, exact_only=False)
    ex = make_executor(rt, epoch=5, fault_injection=True)
    done = op(ex, op="DESCRIBE", op_id=7)
    assert (done.op_id, done.status, done.op, done.handle, done.value) == (
        7, int(OpStatus.OK), int(OpKind.DESCRIBE), 0, 50)
    body = msgpack.unpackb(done.payload)
    assert body["abi_version"] == ABI_VERSION and body["worker_epoch"] == 5
    assert body["fault_injection"] is True
    d = rt.desc
    assert body["runtime"] == dict(
        runtime_id="fake", vocab_size=50, max_seq_len=33, max_batch=7, max_seqs=9, page=8,
        truncate_partial=d.truncate_partial, copy_shares_cells=d.copy_shares_cells,
        takeover_preferred=d.takeover_preferred, prefill_step_tokens=5, engine_sampling=True,
        engine_draws=d.engine_draws, verify_batches=d.verify_batches, exact_only=False)
    assert body["eos"] == [3, 49]
    assert body["specials"] == dict(rt.vocabulary().specials)
    assert set(body["specials"].values()) >= {3, 49}
    assert body["parallel"] == {"tp": 1, "nnodes": 1}  # one process: the fake's default layout
    assert body["numeric"] == {"class": "fake", "isa": ""}


@pytest.mark.parametrize(("tp", "nnodes"), [(2, 1), (8, 2)])
def test_describe_reports_the_runtimes_parallel_layout(tp, nnodes):
    rt = fake()
    rt.desc = dataclasses.replace(rt.desc, tp=tp, nnodes=nnodes)  # as a tensor-parallel runtime states it
    body = msgpack.unpackb(op(make_executor(rt), op="DESCRIBE").payload)
    assert body["parallel"] == {"tp": tp, "nnodes": nnodes}
    # The layout is not in the record: the rest of the description is the one-rank one's.
    assert body["runtime"] == msgpack.unpackb(op(make_executor(fake()), op="DESCRIBE").payload)["runtime"]


@pytest.mark.parametrize(("tp", "nnodes", "field"), [(0, 1, "tp"), (2, 0, "nnodes"), (1, 2, "nnodes"),
                                                     (True, 1, "tp"), (2.0, 1, "tp")])
def test_a_description_refuses_a_bad_layout(tp, nnodes, field):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(fake().desc, tp=tp, nnodes=nnodes)


def test_describe_by_code_and_by_bytes(ex):
    assert op(ex, op=int(OpKind.DESCRIBE)).status == int(OpStatus.OK)
    assert op(ex, op="describe").status == int(OpStatus.OK)
    done = ex.op(msgpack.packb({"op": "DESCRIBE", "op_id": 3}))
    assert done.status == int(OpStatus.OK) and done.op_id == 3
    assert ex.op({"op": "DESCRIBE"}).op_id == 0  # op_id is optional


def test_queued_completion_arrives_with_the_next_tick(ex):
    ex.op({"op": "DESCRIBE", "op_id": 11}, queue=True)
    ex.op({"op": "NOPE", "op_id": 12}, queue=True)
    r = ex.tick(PlanBuilder(1).build())
    assert r.ok
    assert [(c.op_id, c.status) for c in r.events.op_completions] == [
        (11, int(OpStatus.OK)), (12, int(OpStatus.UnknownOp))]
    assert not ex.tick(PlanBuilder(2).build()).events.op_completions


# ---------------------------------------------------------------- malformed


@pytest.mark.parametrize("payload", [b"\xc1", b"", b"\x92\x01\x02", msgpack.packb("DESCRIBE"), b"\x81"])
def test_malformed_payloads_are_bad_requests(ex, payload):
    before = snapshot(ex)
    done = ex.op(payload)
    assert done.status == int(OpStatus.BadRequest) and done.op == 0
    assert error_of(done)
    assert before == snapshot(ex)


@pytest.mark.parametrize("msg, status", [
    ({"op": 99}, OpStatus.UnknownOp),
    ({"op": 0}, OpStatus.UnknownOp),
    ({"op": "NOPE"}, OpStatus.UnknownOp),
    ({"op": 1.5}, OpStatus.BadRequest),
    ({"op": True}, OpStatus.BadRequest),
    ({}, OpStatus.BadRequest),
    ({"op": "DESCRIBE", "op_id": -1}, OpStatus.BadRequest),
    ({"op": "DESCRIBE", "op_id": 1 << 64}, OpStatus.BadRequest),
    ({"op": "DESCRIBE", "op_id": "7"}, OpStatus.BadRequest),
])
def test_unknown_and_malformed_ops(ex, msg, status):
    done = ex.op(msg)
    assert done.status == int(status), error_of(done)
    assert done.op_id == 0 or done.op_id == msg.get("op_id")


# ---------------------------------------------------------------- logit bias


def test_register_and_release_a_logit_bias(ex):
    a = op(ex, op="REGISTER_LOGIT_BIAS", bias={1: 2.5, 7: -math.inf})
    b = op(ex, op="REGISTER_LOGIT_BIAS", bias=[[3, -1], [4, 0.5]])
    assert a.status == b.status == int(OpStatus.OK)
    assert a.handle > 0 and b.handle > 0 and a.handle != b.handle
    assert (a.value, b.value) == (2, 2)
    assert a.op == int(OpKind.REGISTER_LOGIT_BIAS)
    empty = op(ex, op="REGISTER_LOGIT_BIAS", bias={})
    assert empty.status == int(OpStatus.OK) and empty.value == 0
    done = op(ex, op="RELEASE_LOGIT_BIAS", handle=a.handle)
    assert done.status == int(OpStatus.OK) and done.handle == a.handle
    assert op(ex, op="RELEASE_LOGIT_BIAS", handle=a.handle).status == int(OpStatus.UnknownHandle)
    assert op(ex, op="RELEASE_LOGIT_BIAS", handle=10**6).status == int(OpStatus.UnknownHandle)
    # a released handle cannot be admitted with
    r = ex.tick(PlanBuilder(1).admit(1, put(ex, [1, 2]), logit_bias_handle=a.handle).build())
    assert r.status == Status.RejectIllegalCombination
    assert r.message.startswith("admits[0].logit_bias_handle: ")
    assert ex.tick(PlanBuilder(1).admit(1, put(ex, [1, 2]), logit_bias_handle=b.handle).build()).ok


@pytest.mark.parametrize("bias", [
    {-1: 1.0}, {64: 1.0}, {10**9: 1.0}, [["a", 1.0]], [[True, 1.0]], [[1.5, 1.0]],
    {1: math.nan}, {1: math.inf}, {1: "x"}, {1: True}, {1: None},
    [[1, 1.0], [1, 2.0]],  # a token twice
    [[1, 2, 3]], [1], "not a map", 5, None,
])
def test_bad_logit_biases_are_bad_requests(ex, bias):
    before = snapshot(ex)
    done = op(ex, op="REGISTER_LOGIT_BIAS", bias=bias)
    assert done.status == int(OpStatus.BadRequest), bias
    assert done.handle == 0 and error_of(done)
    assert before == snapshot(ex)


def test_a_bias_field_is_required(ex):
    assert op(ex, op="REGISTER_LOGIT_BIAS").status == int(OpStatus.BadRequest)


@pytest.mark.parametrize("handle", [0, -3, "1", 1.0, True, None])
def test_release_with_a_bad_handle_is_a_bad_request(ex, handle):
    assert op(ex, op="RELEASE_LOGIT_BIAS", handle=handle).status == int(OpStatus.BadRequest)


def run_lane(ex, seq, tag, prompt, n, **admit_kw):
    r = admit_and_prefill(ex, seq, tag, prompt, decode=n, **admit_kw)
    return emitted(ex, emit_of(r, tag))


@pytest.mark.parametrize("engine", [False, True])
@pytest.mark.parametrize("sampling, temperature", [(Sampling.GPU_GREEDY, 0.0), (Sampling.GPU_SAMPLE, 1.0),
                                                   (Sampling.GPU_SAMPLE, 2.0)])
def test_a_banned_token_never_appears(engine, sampling, temperature):
    """-inf bans a token. A biased lane is sampled on the host even where the
    engine samples (engine=True): its tokens are never the banned ones, and
    the ban is not vacuous (the same lane unbiased does pick them)."""
    ex = make_executor(fake(max_seq_len=256, engine_sampling=engine, engine_draws=engine))
    params = sampling_params(temperature=temperature, ignore_eos=True)
    prompt = [5, 9, 2, 11]
    free = run_lane(ex, 1, 1, prompt, 60, sampling=sampling, params=params, rng_counter_base=77)
    banned = sorted(set(free[:6]))  # tokens the unbiased lane does emit, its first among them
    h = op(ex, op="REGISTER_LOGIT_BIAS", bias={t: -math.inf for t in banned}).handle
    got = run_lane(ex, 2, 2, prompt, 60, sampling=sampling, params=params, rng_counter_base=77,
                   logit_bias_handle=h)
    assert len(got) == 60
    assert not set(got) & set(banned), (banned, got)
    assert free[0] in banned and got != free
    # releasing the handle does not change a lane admitted with it
    assert op(ex, op="RELEASE_LOGIT_BIAS", handle=h).status == int(OpStatus.OK)
    r = ex.tick(PlanBuilder(3).decode(2, 40).build())
    assert r.ok and not set(emitted(ex, emit_of(r, 2))) & set(banned)
    check_invariants(ex)


def test_a_positive_bias_forces_a_token_on_every_path():
    for engine in (False, True):
        ex = make_executor(fake(max_seq_len=128, engine_sampling=engine, engine_draws=engine))
        h = op(ex, op="REGISTER_LOGIT_BIAS", bias={13: 1e30}).handle
        for seq, (sampling, t) in enumerate([(Sampling.GPU_GREEDY, 0.0), (Sampling.GPU_SAMPLE, 1.0)], 1):
            got = run_lane(ex, seq, seq, [1, 2, 3], 20, sampling=sampling, logit_bias_handle=h,
                           params=sampling_params(temperature=t, ignore_eos=True))
            assert got == [13] * 20


def test_a_bias_beyond_float32_is_refused():
    ex = make_executor(fake(max_seq_len=128))
    done = op(ex, op="REGISTER_LOGIT_BIAS", bias={13: 1e39})
    if done.status == int(OpStatus.OK):
        got = run_lane(ex, 1, 1, [1, 2, 3], 20, sampling=Sampling.GPU_SAMPLE, logit_bias_handle=done.handle,
                       params=sampling_params(temperature=1.0, ignore_eos=True))
        assert got == [13] * 20, f"a +1e39 bias banned the token it should force: {got}"
    assert done.status == int(OpStatus.BadRequest)


# ---------------------------------------------------------------- INJECT_FAULT


def test_inject_fault_refused_without_fault_injection():
    ex = make_executor(fake(), fault_injection=False)
    admit_and_prefill(ex, 1, 1, [1, 2])
    before = snapshot(ex)
    done = op(ex, op="INJECT_FAULT", lane_tag=1)
    assert done.status == int(OpStatus.Refused) and done.op == int(OpKind.INJECT_FAULT)
    assert before == snapshot(ex)
    r = ex.tick(PlanBuilder(2).decode(1, 2).build())
    assert r.ok and not r.events.faults


def test_inject_fault(ex):
    admit_and_prefill(ex, 1, 1, [1, 2, 3])
    admit_and_prefill(ex, 2, 2, [4, 5, 6])
    assert op(ex, op="INJECT_FAULT", lane_tag=9).status == int(OpStatus.NoMatch)
    assert op(ex, op="INJECT_FAULT", lane_tag=1, code=999).status == int(OpStatus.BadRequest)
    assert op(ex, op="INJECT_FAULT", lane_tag="1").status == int(OpStatus.BadRequest)
    assert op(ex, op="INJECT_FAULT").status == int(OpStatus.BadRequest)
    done = op(ex, op="INJECT_FAULT", lane_tag=1, code=int(Fault.INJECTED))
    assert done.status == int(OpStatus.OK) and done.value == 1
    # a tick that does not decode the lane leaves it be
    assert not ex.tick(PlanBuilder(3).decode(2, 2).build()).events.faults
    r = ex.tick(PlanBuilder(4, max_decode_lanes=2).decode(1, 3).decode(2, 3).build())
    assert r.ok and r.events.tick_status == int(TickStatus.LANE_ERRORS)
    assert [(f.lane_tag, f.code) for f in r.events.faults] == [(1, int(Fault.INJECTED))]
    assert [e.lane_tag for e in r.events.emits] == [2] and emit_of(r, 2).n_tokens == 3
    assert 1 in ex.lanes.faulted and 1 not in ex.lanes
    check_invariants(ex)
    r = ex.tick(PlanBuilder(5).decode(1).build())
    assert r.status == Status.RejectUnknownLane
    assert ex.tick(PlanBuilder(5).retire(1).build()).ok
    assert not ex.lanes.faulted
    # the default code is INJECTED; a retire drops a pending injection
    assert op(ex, op="INJECT_FAULT", lane_tag=2).status == int(OpStatus.OK)
    assert ex.lanes.injected == {2: int(Fault.INJECTED)}
    assert ex.tick(PlanBuilder(6).retire(2).build()).ok
    assert not ex.lanes.injected


# ---------------------------------------------------------------- CACHE_CLEAR


def test_cache_clear_frees_entries_and_the_next_tick_reports_them(ex):
    for tag in (1, 2):
        admit_and_prefill(ex, tag, tag, list(range(tag, tag + 9)), decode=2)
    assert ex.tick(PlanBuilder(3).retire(1, publish_to_cache=True).retire(2, publish_to_cache=True)
                   .build()).ok
    assert len(ex.cache) == 2
    sizes = sorted((e.bytes, len(e.tokens)) for e in ex.cache)
    assert ex.runtime.mem_counters().seqs == 2
    done = op(ex, op="CACHE_CLEAR", op_id=5)
    assert done.status == int(OpStatus.OK) and done.value == sum(b for b, _ in sizes)
    assert len(ex.cache) == 0
    mem = ex.runtime.mem_counters()
    assert mem.seqs == 0 and mem.cells_used == 0
    r = ex.tick(PlanBuilder(4).build())
    assert r.ok and r.events.tick_status == int(TickStatus.SHED)
    shed = r.events.shed
    assert shed.evictions_performed == 2 and shed.bytes_evicted == done.value
    assert sorted((e.bytes, e.tokens) for e in shed.entries) == sizes
    assert all((e.lane_tag, e.kind, e.reason) == (0, int(ShedKind.CACHE_EVICTION), int(ShedReason.CLEARED))
               for e in shed.entries)
    # reported once
    r = ex.tick(PlanBuilder(5).build())
    assert r.events.tick_status == int(TickStatus.OK) and not r.events.shed.entries
    # an empty cache clears to nothing
    done = op(ex, op="CACHE_CLEAR")
    assert done.status == int(OpStatus.OK) and done.value == 0 and not ex.pending.shed


def test_cache_clear_report_survives_a_rejected_tick(ex):
    admit_and_prefill(ex, 1, 1, list(range(8)))
    assert ex.tick(PlanBuilder(2).retire(1, publish_to_cache=True).build()).ok
    assert op(ex, op="CACHE_CLEAR").status == int(OpStatus.OK)
    assert ex.tick(PlanBuilder(2).build()).status == Status.RejectIllegalCombination  # stale plan_seq
    r = ex.tick(PlanBuilder(3).build())
    assert r.events.shed.evictions_performed == 1


def test_cache_clear_with_a_failing_free_completes(ex):
    admit_and_prefill(ex, 1, 1, list(range(8)))
    assert ex.tick(PlanBuilder(2).retire(1, publish_to_cache=True).build()).ok
    ex.runtime.inject_capacity_fault(on="free")
    done = ex.op({"op": "CACHE_CLEAR", "op_id": 1})
    assert done.op_id == 1 and len(ex.cache) == 0


# ---------------------------------------------------------------- unsupported


def test_grammars_without_a_tokenizer_are_unsupported(ex):
    before = snapshot(ex)
    done = op(ex, op="REGISTER_GRAMMAR", kind="regex", text="a+")
    assert done.status == int(OpStatus.Unsupported) and done.op == int(OpKind.REGISTER_GRAMMAR)
    assert before == snapshot(ex)


@pytest.mark.parametrize("name", ["RELEASE_SEED", "RELEASE_GRAMMAR"])
def test_releasing_unknown_seed_or_grammar_handles(ex, name):
    assert op(ex, op=name, handle=1).status == int(OpStatus.UnknownHandle)
    assert op(ex, op=name, handle=0).status == int(OpStatus.BadRequest)
    assert op(ex, op=name).status == int(OpStatus.BadRequest)


def test_a_failed_op_never_affects_a_tick(ex):
    admit_and_prefill(ex, 1, 1, [1, 2, 3])
    for msg in ({"op": "NOPE"}, {"op": "REGISTER_LOGIT_BIAS", "bias": {999: 1}}, {"op": "LEASE_SEED"}):
        ex.op(msg, queue=True)
    r = ex.tick(PlanBuilder(2, prefill_token_budget=BIG_BUDGET).decode(1, 3).build())
    assert r.ok and r.events.tick_status == int(TickStatus.OK)
    assert emit_of(r, 1).n_tokens == 3
    assert len(r.events.op_completions) == 3
    assert all(c.status != int(OpStatus.OK) for c in r.events.op_completions)
    assert isinstance(np.asarray(emitted(ex, emit_of(r, 1))), np.ndarray)
