"""The lane ops (contract §7, issue 11): LIST_LANES pages the lanes by tag with
their state and session; RETIRE_LANES retires by tags, all, or all of a
session, all or nothing, and (the oracle) leaves exactly the state a plan's
LaneRetire leaves, publishing included. And every completion is bounded:
error messages quote a bounded piece of their input, and pending
completions no longer make a plan RejectBudget."""

from __future__ import annotations

import msgpack
import pytest

from superfluid.abi import ECHO_BYTES, Determinism, Fault, OpKind, OpStatus, ShedKind, Status
from superfluid.client.builder import PlanBuilder
from superfluid.testing.executor import (
    BIG_BUDGET,
    HOST,
    admit_and_prefill,
    emit_of,
    emitted,
    fake,
    make_executor,
    put,
)
from superfluid.testing.invariants import check_invariants, snapshot

P_DONE = list(range(1, 9))  # 8 tokens: the lane that decodes to max_seq_len
P_DEC = list(range(10, 20))  # 10 tokens
P_PRE = list(range(20, 32))  # 12 tokens, 3 prefilled
P_PUB = list(range(40, 52))  # 12 tokens, published before the scene
P_FLT = list(range(52, 58))  # 6 tokens, faulted
P_HOST = list(range(32, 37))  # 5 tokens, a HOST lane holding a row


def op(ex, **msg):
    msg.setdefault("op_id", 9)
    return ex.op(msg)


def body(done) -> dict:
    return msgpack.unpackb(done.payload)


def scene(**ex_kw):
    """Lanes in every state, in two sessions, and one cache entry: built the
    same way on every call. Returns (executor, the next plan_seq)."""
    ex = make_executor(fake(eos_rate=0.0, max_seq_len=16), fault_injection=True, **ex_kw)
    ex.lanes.session = 1
    admit_and_prefill(ex, 1, 5, P_PUB, decode=2)
    assert ex.tick(PlanBuilder(2).retire(5, publish_to_cache=True).build()).ok
    admit_and_prefill(ex, 3, 10, P_DEC, decode=3)  # decoding, its last token held back (forward-once)
    admit_and_prefill(ex, 4, 60, P_DONE, decode=8)  # finished (LENGTH)
    ex.lanes.session = 2
    r = ex.tick(PlanBuilder(5, prefill_token_budget=BIG_BUDGET).admit(30, put(ex, P_PRE)).prefill(30, 0, 3)
                .admit(40, put(ex, P_FLT)).prefill(40, 0, len(P_FLT)).decode(40, 1).build())
    assert r.ok, r.message
    admit_and_prefill(ex, 6, 50, P_HOST, decode=1, sampling=HOST)  # decoding: a row waits for its commit
    assert op(ex, op="INJECT_FAULT", lane_tag=40).status == int(OpStatus.OK)
    r = ex.tick(PlanBuilder(7).decode(40, 1).build())
    assert [f.lane_tag for f in r.events.faults] == [40]
    check_invariants(ex)
    return ex, 8


TAGS = [10, 30, 40, 50, 60]
SPI = int(Determinism.SEED_PATH_INVARIANT)


# ---------------------------------------------------------------- LIST_LANES


def test_list_lanes_shows_each_lane_state_and_session():
    ex, _ = scene()
    done = op(ex, op="LIST_LANES")
    assert (done.status, done.op, done.handle, done.value) == (int(OpStatus.OK), int(OpKind.LIST_LANES), 0, 5)
    got = body(done)
    assert got["more"] is False
    assert got["lanes"] == [
        dict(tag=10, prompt=10, generated=3, state="decoding", session=1),
        dict(tag=30, prompt=12, generated=0, state="prefilling", session=2),
        dict(tag=40, prompt=6, generated=1, state="faulted", session=2),
        dict(tag=50, prompt=5, generated=0, state="decoding", session=2),
        dict(tag=60, prompt=8, generated=8, state="finished", session=1),
    ]


def test_list_lanes_pages_by_tag():
    ex, _ = scene()
    seen, after, pages = [], 0, 0
    while True:
        done = op(ex, op="LIST_LANES", after=after, limit=2)
        assert done.status == int(OpStatus.OK) and done.value == 5
        got = body(done)
        tags = [ln["tag"] for ln in got["lanes"]]
        assert tags == sorted(tags) and len(tags) <= 2 and all(t > after for t in tags)
        seen += tags
        pages += 1
        if not got["more"]:
            break
        after = tags[-1]
    assert seen == TAGS and pages == 3
    assert body(op(ex, op="LIST_LANES", after=35))["lanes"][0]["tag"] == 40
    assert body(op(ex, op="LIST_LANES", after=60)) == {"lanes": [], "more": False}
    assert body(op(ex, op="LIST_LANES", limit=5))["more"] is False
    assert body(op(ex, op="LIST_LANES", limit=4))["more"] is True


def test_list_lanes_fits_half_the_event_slot():
    ex = make_executor(fake(eos_rate=0.0))
    b = PlanBuilder(1, prefill_token_budget=BIG_BUDGET)
    for tag in range(1, 101):
        b.admit(tag << 40, put(ex, [1, 2]))
    assert ex.tick(b.build()).ok
    ex.event_capacity = 2048
    done = op(ex, op="LIST_LANES", limit=1024)
    assert done.value == 100 and len(done.payload) <= 1024
    got = body(done)
    assert got["more"] is True and 0 < len(got["lanes"]) < 100


def test_an_empty_executor_lists_nothing(ex):
    done = op(ex, op="LIST_LANES")
    assert done.value == 0 and body(done) == {"lanes": [], "more": False}


def test_a_lane_records_the_session_of_its_admit(ex):
    ex.lanes.session = 77
    admit_and_prefill(ex, 1, 3, [1, 2, 3])
    ex.lanes.session = 78  # a later session does not move it
    assert ex.lanes[3].session == 77
    assert body(op(ex, op="LIST_LANES"))["lanes"][0]["session"] == 77


# ---------------------------------------------------------------- RETIRE_LANES


def test_retire_lanes_by_tags():
    ex, seq = scene()
    seqs = ex.runtime.mem_counters().seqs
    done = op(ex, op="RETIRE_LANES", tags=[60, 40, 10])
    assert (done.status, done.op, done.value) == (int(OpStatus.OK), int(OpKind.RETIRE_LANES), 3)
    assert body(done) == {"retired": [60, 40, 10]}
    assert set(ex.lanes) == {30, 50} and not ex.lanes.faulted
    assert ex.runtime.mem_counters().seqs == seqs - 2  # the faulted lane held none
    check_invariants(ex)
    assert [ln["tag"] for ln in body(op(ex, op="LIST_LANES"))["lanes"]] == [30, 50]
    # the tags are free again; the lanes left go on
    r = ex.tick(PlanBuilder(seq, prefill_token_budget=BIG_BUDGET).admit(10, put(ex, [1, 2])).prefill(10, 0, 2)
                .prefill(30, 3, 9).decode(30, 2).build())
    assert r.ok, r.message
    assert emit_of(r, 30).n_tokens == 2
    check_invariants(ex)


def test_retire_all_lanes():
    ex, seq = scene()
    entries = len(ex.cache)
    done = op(ex, op="RETIRE_LANES", all=True)
    assert done.status == int(OpStatus.OK) and done.value == 5 and body(done) == {"retired": TAGS}
    assert not ex.lanes and not ex.lanes.faulted and len(ex.cache) == entries
    assert ex.runtime.mem_counters().seqs == entries
    check_invariants(ex)
    done = op(ex, op="RETIRE_LANES", all=True)
    assert done.status == int(OpStatus.OK) and done.value == 0 and body(done) == {"retired": []}
    assert ex.tick(PlanBuilder(seq).build()).ok


@pytest.mark.parametrize("session, left", [(1, [30, 40, 50]), (2, [10, 60]), (3, TAGS)])
def test_retire_all_of_a_session(session, left):
    ex, _ = scene()
    done = op(ex, op="RETIRE_LANES", all=True, session=session)
    assert done.status == int(OpStatus.OK)
    gone = [t for t in TAGS if t not in left]
    assert done.value == len(gone) and body(done) == {"retired": gone}
    assert sorted(set(ex.lanes) | ex.lanes.faulted) == left
    check_invariants(ex)


def test_retire_with_publish_keeps_the_prefix_for_a_later_admit():
    ex, seq = scene()
    assert op(ex, op="LEASE_SEED", tokens=P_DEC, ttl_ticks=4).status == int(OpStatus.NoMatch)
    done = op(ex, op="RETIRE_LANES", tags=[10], publish=True)
    assert done.status == int(OpStatus.OK) and done.value == 1
    lease = op(ex, op="LEASE_SEED", tokens=P_DEC, ttl_ticks=4)
    assert lease.status == int(OpStatus.OK) and lease.value == 8  # 2 whole pages of the prompt
    r = ex.tick(PlanBuilder(seq, prefill_token_budget=BIG_BUDGET)
                .admit(11, put(ex, P_DEC), seed_handle=lease.handle, determinism_class=SPI)
                .prefill(11, 8, 2).decode(11, 3).build())
    assert r.ok, r.message
    seeded = emitted(ex, emit_of(r, 11))
    check_invariants(ex)
    plain = make_executor(fake(eos_rate=0.0, max_seq_len=16))
    assert emitted(plain, emit_of(admit_and_prefill(plain, 1, 1, P_DEC, decode=3), 1)) == seeded


# ---------------------------------------------------------------- the oracle


RETIRED = [10, 30, 40, 50, 60]


def _by_plan(ex, seq: int, publish: bool):
    b = PlanBuilder(seq)
    for t in RETIRED:
        b.retire(t, publish_to_cache=publish)
    return ex.tick(b.build())


def _by_op(ex, seq: int, publish: bool):
    done = op(ex, op="RETIRE_LANES", tags=RETIRED, publish=publish)
    assert done.status == int(OpStatus.OK) and done.value == len(RETIRED)
    return ex.tick(PlanBuilder(seq).build())  # the next tick reports what the op evicted


def _shed(r) -> list[tuple]:
    return [(s.lane_tag, s.kind, s.reason, s.bytes, s.tokens) for s in r.events.shed.entries]


@pytest.mark.parametrize("cap", [None, 3000], ids=["uncapped", "cache-capped"])
@pytest.mark.parametrize("host", [0, 1 << 20], ids=["no-host-tier", "host-tier"])
def test_an_op_retire_leaves_the_state_a_plan_retire_leaves(cap, host):
    (a, seq), (b, _), (c, _) = (scene(cache_max_bytes=cap, host_cache_bytes=host) for _ in range(3))
    assert a.state_digest() == b.state_digest() == c.state_digest()
    ra, rb = _by_op(a, seq, True), _by_plan(b, seq, True)
    assert ra.ok and rb.ok, (ra.message, rb.message)
    assert a.state_digest() == b.state_digest()
    assert _shed(ra) == _shed(rb) and ra.events.tick_status == rb.events.tick_status
    assert ra.events.shed.evictions_performed == rb.events.shed.evictions_performed
    if cap is not None:  # the cap evicted: the op's evictions come in the next tick's report
        assert any(s[1] == int(ShedKind.CACHE_EVICTION) for s in _shed(ra))
    sa, sb = snapshot(a), snapshot(b)
    assert {k: v for k, v in sa.items() if k != "stats"} == {k: v for k, v in sb.items() if k != "stats"}
    check_invariants(a)
    # The negative control: without publish the state differs.
    assert _by_op(c, seq, False).ok
    assert c.state_digest() != a.state_digest()
    assert len(c.cache) < len(a.cache)


def test_an_op_retire_without_publish_equals_a_plan_retire_without_it():
    (a, seq), (b, _) = scene(), scene()
    assert _by_op(a, seq, False).ok and _by_plan(b, seq, False).ok
    assert a.state_digest() == b.state_digest()


# ---------------------------------------------------------------- refusals


def test_an_unknown_tag_retires_nothing():
    ex, _ = scene()
    before = snapshot(ex)
    done = op(ex, op="RETIRE_LANES", tags=[10, 999, 30])
    assert done.status == int(OpStatus.NoMatch)
    assert "999" in body(done)["error"]
    assert snapshot(ex) == before


@pytest.mark.parametrize("msg, field", [
    (dict(op="RETIRE_LANES"), "tags"),
    (dict(op="RETIRE_LANES", tags="10"), "tags"),
    (dict(op="RETIRE_LANES", tags=[10, -1]), "tags"),
    (dict(op="RETIRE_LANES", tags=[10, 1 << 64]), "tags"),
    (dict(op="RETIRE_LANES", tags=[10, True]), "tags"),
    (dict(op="RETIRE_LANES", tags=[10, 30, 10]), "tags"),
    (dict(op="RETIRE_LANES", tags=[10], all=True), "tags"),
    (dict(op="RETIRE_LANES", tags=[10], session=1), "session"),
    (dict(op="RETIRE_LANES", all=1), "all"),
    (dict(op="RETIRE_LANES", all=False), "tags"),
    (dict(op="RETIRE_LANES", all=True, session=-1), "session"),
    (dict(op="RETIRE_LANES", all=True, session="1"), "session"),
    (dict(op="RETIRE_LANES", tags=[10], publish="yes"), "publish"),
    (dict(op="LIST_LANES", after=-1), "after"),
    (dict(op="LIST_LANES", after=1.5), "after"),
    (dict(op="LIST_LANES", limit=0), "limit"),
    (dict(op="LIST_LANES", limit=1025), "limit"),
    (dict(op="LIST_LANES", limit="2"), "limit"),
])
def test_bad_fields_are_bad_requests_naming_the_field(msg, field):
    ex, _ = scene()
    before = snapshot(ex)
    done = op(ex, **msg)
    assert done.status == int(OpStatus.BadRequest), body(done)
    assert f"'{field}'" in body(done)["error"]
    assert snapshot(ex) == before


def test_a_dead_executor_refuses_to_retire():
    ex, _ = scene()
    ex.runtime.inject_fatal(on="step")
    r = ex.tick(PlanBuilder(8).decode(10, 1).build())
    assert r.status == Status.Fatal
    done = op(ex, op="RETIRE_LANES", all=True)
    assert done.status == int(OpStatus.Refused) and 10 in ex.lanes


# ---------------------------------------------------------------- bounded completions

BIG = "x" * 65536


@pytest.mark.parametrize("msg", [
    {"op": BIG},
    {"op": "é" * 40000},
    {"op": "RETIRE_LANES", "tags": BIG},
    {"op": "RETIRE_LANES", "tags": [BIG]},
    {"op": "RETIRE_LANES", "tags": list(range(1_000_000)) + [BIG]},
    {"op": "RETIRE_LANES", "all": BIG},
    {"op": "LIST_LANES", "limit": BIG},
    {"op": "INJECT_FAULT", "lane_tag": 10, "code": BIG},
    {"op": "INJECT_FAULT", "lane_tag": 1 << 63},
    {"op": "REGISTER_LOGIT_BIAS", "bias": {BIG: 1.0}},
    {"op": "REGISTER_LOGIT_BIAS", "bias": [[1, BIG]]},
    {"op": "LEASE_SEED", "tokens": [1] * 999_999 + [BIG], "ttl_ticks": 1},
    {"op": "LEASE_SEED", "tokens": [1.5] * 1_000_000, "ttl_ticks": 1},
    {"op": "LEASE_SEED", "tokens": [[1] * 1_000_000], "ttl_ticks": 1},
    {"op": "LEASE_SEED", "tokens": [1, 2, 3, 4], "ttl_ticks": BIG},
    {"op": "EXPORT_ENTRY", "handle": BIG},
    {"op": "IMPORT_STATE", "tokens": [1, 2, 3, 4], "ttl_ticks": 1, "path": "/nonexistent/" + BIG},
    {"op": "IMPORT_STATE", "tokens": [1, 2, 3, 4], "ttl_ticks": 1, "blob": BIG.encode()},
], ids=lambda m: f"{m['op'][:12]}-{sorted(m)[-1]}")
def test_an_error_completion_is_small_whatever_the_input(msg):
    ex, _ = scene()
    for done in (ex.op(dict(msg, op_id=3)), ex.op(msgpack.packb(dict(msg, op_id=3)))):
        assert done.status != int(OpStatus.OK) and done.op_id == 3
        assert len(done.payload) < 300, len(done.payload)
        assert body(done)["error"]


def test_an_echo_is_at_most_echo_bytes():
    ex = make_executor()
    err = body(op(ex, op="RETIRE_LANES", tags=[BIG]))["error"]
    quoted = err.split("= ", 1)[1].split(" is not", 1)[0]
    assert 0 < len(quoted.encode()) <= ECHO_BYTES


def test_pending_completions_never_make_a_plan_reject_budget():
    ex = make_executor(fake(eos_rate=0.0))
    admit_and_prefill(ex, 1, 1, [1, 2, 3])
    ex.event_capacity = 16 << 10
    for i in range(300):
        ex.op({"op": "DESCRIBE", "op_id": i}, queue=True)
    assert sum(len(c.payload) for c in ex.pending.completions) > 4 * ex.event_capacity
    r = ex.tick(PlanBuilder(2).decode(1, 2).build())
    assert r.ok, r.message
    assert len(r.events.op_completions) == 300 and emit_of(r, 1).n_tokens == 2
    # The rest of the bound holds: a plan whose own events could overflow the slot is refused.
    ex.event_capacity = 4096
    r = ex.tick(PlanBuilder(3, prefill_token_budget=BIG_BUDGET).admit(2, put(ex, [1, 2]), want_logprobs=4)
                .prefill(2, 0, 2).decode(2, 60).build())
    assert r.status == Status.RejectBudget, r.message


def test_inject_fault_then_list_then_retire_the_faulted_lane(ex):
    admit_and_prefill(ex, 1, 7, [1, 2, 3], decode=1)
    assert op(ex, op="INJECT_FAULT", lane_tag=7, code=int(Fault.INJECTED)).status == int(OpStatus.OK)
    assert ex.tick(PlanBuilder(2).decode(7, 1).build()).events.faults
    assert body(op(ex, op="LIST_LANES"))["lanes"] == [
        dict(tag=7, prompt=3, generated=1, state="faulted", session=0)]
    assert op(ex, op="RETIRE_LANES", tags=[7], publish=True).value == 1  # a faulted lane publishes nothing
    assert not ex.lanes.faulted and not ex.cache and ex.runtime.mem_counters().seqs == 0
