"""contract §3, all or nothing: whatever state random valid plans built (admits
with random prompts, chunked prefills, decodes, HOST lanes with commits,
faults, retires with and without publish, a small pool), a plan that is
rejected changes nothing — not a lane, cache entry, counter, plan_seq,
runtime sequence or runtime call, nor a ring the executor writes — and
Executor.state_digest() and the runtime's mem_counters() agree.

The plans are random valid plans with one thing made wrong (a field set to
a wrong value, a record duplicated or dropped, plan_seq moved back…), or a
random field set to a random value. The property is not vacuous: across
the run many mutated plans are rejected and many accepted, and after a
reject the unmutated plan is accepted (plan_seq did not move) and does
change the lanes, the cache or the runtime's sequences."""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import HealthCheck, given, settings, strategies as st

from superfluid.abi import PlanFlag, Status, codec
from superfluid.client.builder import PlanBuilder
from superfluid.engine.fake import FakeRuntime
from superfluid.testing.executor import HOST, make_executor, put
from superfluid.testing.invariants import assert_unchanged, check_invariants, snapshot
from superfluid.testing.model_planner import Planner

RUNTIMES = [
    dict(vocab_size=32, max_seq_len=40, page=4, eos_rate=0.1),
    dict(vocab_size=32, max_seq_len=32, page=4, cells_total=96, max_seqs=6, prefill_step_tokens=3),
    dict(vocab_size=32, max_seq_len=24, page=8, exact_only=True, engine_sampling=True, engine_draws=True),
]

IC, BUDGET, BOUNDS = Status.RejectIllegalCombination, Status.RejectBudget, Status.RejectBounds
UNKNOWN, HOSTR, NONCE = Status.RejectUnknownLane, Status.RejectHostRules, Status.RejectStaleNonce


def _lists(b: PlanBuilder) -> dict[str, list]:
    return dict(admits=b.admits, prefills=b.prefills, decodes=b.decodes, commits=b.commits, retires=b.retires)


def mutate(p: Planner, b: PlanBuilder) -> tuple[str, Any, Status | None]:
    """Make one thing of a valid plan wrong: (name, plan or encoded plan,
    the status it must get, or None when it may be accepted)."""
    ex = p.ex
    vocab = ex.desc.vocab_size
    live = [m for m in p.live()]
    decoded = {d.lane_tag for d in b.decodes}
    host_decoded_committed = [c for c in b.commits if c.lane_tag in decoded]
    kinds = ["random_field", "harmless", "duplicate", "stale_seq", "unknown_decode", "unknown_retire",
             "mdl_over_batch", "bad_ring", "bias_handle", "seed_handle", "grammar_handle", "oov_prompt"]
    if b.admits:
        kinds += ["replay_too_big", "drain", "future_ref", "empty_prompt", "long_prompt"]
        if live:
            kinds.append("admit_live")
    if b.prefills:
        kinds += ["prefill_offset", "prefill_overrun"]
    if b.decodes:
        kinds += ["too_many_decodes", "retire_decoded"]
    if b.commits:
        kinds += ["commit_nonce", "commit_token", "drop_commit_or_not"]
    if host_decoded_committed:
        kinds.append("drop_commit")
    if [d for d in b.decodes if ex.lanes.get(d.lane_tag) and ex.lanes[d.lane_tag].sampling == HOST]:
        kinds.append("host_grant")
    if [m for m in live if m.sampling != HOST and m.tag not in {r.lane_tag for r in b.retires}]:
        kinds.append("commit_non_host")
    if [m for m in live if m.finished]:
        kinds.append("decode_finished")
    if [m for m in live if m.prefilled < m.prefill_end and m.tag not in {x.lane_tag for x in b.prefills}]:
        kinds.append("decode_incomplete")
    kind = p.pick(kinds)
    seq = b.plan_seq

    if kind == "harmless":  # a field this plan does not use: still valid
        if b.decodes and p.coin(0.5):
            i = p.i(0, len(b.decodes) - 1)
            b.decodes[i] = b.decodes[i]._replace(overshoot=p.i(0, 50))  # no strategy: no drafts
            return kind, b.build(), None
        if not b.evictable_cache_classes:
            b.max_evict_bytes, b.protected_quota_bytes = p.i(0, 1 << 40), p.i(0, 1 << 40)
        return kind, b.build(), None
    if kind == "stale_seq":
        b.plan_seq = p.i(0, ex.counters.last_plan_seq) if ex.counters.last_plan_seq is not None else seq
        return kind, b.build(), IC if ex.counters.last_plan_seq is not None else None
    if kind == "unknown_decode":
        b.decodes.append(b.decodes[0]._replace(lane_tag=10**9) if b.decodes else
                         PlanBuilder(0).decode(10**9).decodes[0])
        b.max_decode_lanes = None
        return kind, b.build(), UNKNOWN if len(b.decodes) <= ex.desc.max_batch else BUDGET
    if kind == "unknown_retire":
        b.retire(10**9)
        return kind, b.build(), UNKNOWN
    if kind == "mdl_over_batch":
        b.max_decode_lanes = ex.desc.max_batch + p.i(1, 100)
        return kind, b.build(), BUDGET
    if kind == "too_many_decodes":
        b.max_decode_lanes = len(b.decodes) - 1
        return kind, b.build(), BUDGET
    if kind == "drain":
        b.flags |= int(PlanFlag.DRAIN)
        return kind, b.build(), IC
    if kind == "admit_live":
        i = p.i(0, len(b.admits) - 1)
        old = b.admits[i].lane_tag
        new = p.pick(live).tag
        b.admits[i] = b.admits[i]._replace(lane_tag=new)
        for name in ("prefills", "decodes"):
            lst = _lists(b)[name]
            for j, x in enumerate(lst):
                if x.lane_tag == old:
                    lst[j] = x._replace(lane_tag=new)
        return kind, b.build(), IC
    if kind in ("replay_too_big", "future_ref", "empty_prompt", "bad_ring", "long_prompt", "oov_prompt",
                "bias_handle", "seed_handle", "grammar_handle"):
        if not b.admits:
            m, ref = p.new_lane()
            b.admit(m.tag, ref)
            b.flags &= ~int(PlanFlag.DRAIN)  # one mistake at a time
        i = p.i(0, len(b.admits) - 1)
        a = b.admits[i]
        if kind == "replay_too_big":
            b.admits[i] = a._replace(decode_replay=a.prompt.len + p.i(0, 3))
            return kind, b.build(), BOUNDS
        if kind == "future_ref":
            b.admits[i] = a._replace(prompt=a.prompt._replace(generation=a.prompt.generation + p.i(1, 3)))
            return kind, b.build(), Status.RejectBadRefGeneration
        if kind == "empty_prompt":
            b.admits[i] = a._replace(prompt=a.prompt._replace(len=0))
            return kind, b.build(), BOUNDS
        if kind == "bad_ring":
            b.admits[i] = a._replace(prompt=a.prompt._replace(ring_id=p.pick([0, 2, 3, 4, 77])))
            return kind, b.build(), BOUNDS
        if kind == "long_prompt":
            # (unseeded: the seed's tokens are not this prompt's, a second mistake checked first)
            b.admits[i] = a._replace(prompt=put(ex, [1] * (ex.desc.max_seq_len + p.i(1, 5))), seed_handle=0)
            return kind, b.build(), BUDGET
        if kind == "oov_prompt":
            b.admits[i] = a._replace(prompt=put(ex, [1, vocab + p.i(0, 100), 2]), decode_replay=0)
            return kind, b.build(), BOUNDS
        if kind == "bias_handle":
            b.admits[i] = a._replace(logit_bias_handle=p.i(1000, 2000))
            return kind, b.build(), IC
        if kind == "seed_handle":
            b.admits[i] = a._replace(seed_handle=p.i(1, 2000))
            return kind, b.build(), Status.RejectStaleSeed
        b.admits[i] = a._replace(grammar_handle=p.i(1, 2000))
        return kind, b.build(), IC
    if kind == "prefill_offset":
        i = p.i(0, len(b.prefills) - 1)
        x = b.prefills[i]
        off = x.token_offset + p.pick([1, -1, 2, 7]) if x.token_offset else x.token_offset + p.pick([1, 3])
        b.prefills[i] = x._replace(token_offset=max(0, off))
        return kind, b.build(), IC if max(0, off) != x.token_offset else None
    if kind == "prefill_overrun":
        i = p.i(0, len(b.prefills) - 1)
        x = b.prefills[i]
        m = p.lanes.get(x.lane_tag)
        if m is not None:
            end = m.prefill_end
        else:  # a lane admitted in this plan
            a = next(a for a in b.admits if a.lane_tag == x.lane_tag)
            end = a.prompt.len - a.decode_replay
        b.prefills[i] = x._replace(token_count=end - x.token_offset + p.i(1, 5))
        return kind, b.build(), BOUNDS
    if kind == "retire_decoded":
        tag = p.pick(b.decodes).lane_tag
        already = tag in {r.lane_tag for r in b.retires}
        b.retire(tag)
        if already or tag in ex.lanes:  # a duplicate retire, or a live lane decoded and retired
            return kind, b.build(), IC
        # a lane admitted in this plan: retires run first, so its tag is unknown then,
        # unless it names a faulted lane (retiring that one and re-admitting its tag is valid)
        return kind, b.build(), None if tag in ex.lanes.faulted else UNKNOWN
    if kind == "commit_nonce":
        i = p.i(0, len(b.commits) - 1)
        b.commits[i] = b.commits[i]._replace(logits_nonce=b.commits[i].logits_nonce ^ (1 << p.i(0, 63)))
        return kind, b.build(), NONCE
    if kind == "commit_token":
        i = p.i(0, len(b.commits) - 1)
        b.commits[i] = b.commits[i]._replace(token_id=vocab + p.i(0, 1000))
        return kind, b.build(), BOUNDS
    if kind == "drop_commit":
        c = p.pick(host_decoded_committed)
        b.commits.remove(c)
        return kind, b.build(), HOSTR
    if kind == "drop_commit_or_not":
        b.commits.pop(p.i(0, len(b.commits) - 1))
        return kind, b.build(), None
    if kind == "host_grant":
        i = p.pick([j for j, d in enumerate(b.decodes)
                    if ex.lanes.get(d.lane_tag) and ex.lanes[d.lane_tag].sampling == HOST])
        b.decodes[i] = b.decodes[i]._replace(max_new_tokens=p.pick([0, 2, 3, 100]))
        return kind, b.build(), HOSTR
    if kind == "commit_non_host":
        m = p.pick([m for m in live if m.sampling != HOST and m.tag not in {r.lane_tag for r in b.retires}])
        b.commits = [c for c in b.commits if c.lane_tag != m.tag]
        b.commit(m.tag, 1, p.i(0, 1 << 20))
        return kind, b.build(), IC
    if kind == "decode_finished":
        m = p.pick([m for m in live if m.finished])
        b.retires = [r for r in b.retires if r.lane_tag != m.tag]
        b.decodes = [d for d in b.decodes if d.lane_tag != m.tag]
        b.decode(m.tag, p.i(0, 3))
        b.max_decode_lanes = None
        return kind, b.build(), IC if len(b.decodes) <= ex.desc.max_batch else BUDGET
    if kind == "decode_incomplete":
        prefilling = {x.lane_tag for x in b.prefills}
        m = p.pick([m for m in live if m.prefilled < m.prefill_end and m.tag not in prefilling])
        b.retires = [r for r in b.retires if r.lane_tag != m.tag]
        b.decodes = [d for d in b.decodes if d.lane_tag != m.tag]
        b.decode(m.tag, 1)
        b.max_decode_lanes = None
        return kind, b.build(), IC if len(b.decodes) <= ex.desc.max_batch else BUDGET
    if kind == "duplicate":
        names = [n for n, lst in _lists(b).items() if lst]
        if not names:
            b.retire(10**9).retire(10**9)
            return kind, b.encode(), IC
        name = p.pick(names)
        lst = _lists(b)[name]
        lst.insert(p.i(0, len(lst)), p.pick(lst))
        if name == "decodes":
            b.max_decode_lanes = None
        return kind, b.encode(), IC  # duplicates are step 1 of the check: decode_plan
    # random_field: any field of any record (or of the plan) set to a random value of its width
    plan = b.build()
    targets: list[tuple[str, int]] = [("plan", -1)]
    for name, lst in _lists(b).items():
        targets += [(name, j) for j in range(len(lst))]
    name, j = p.pick(targets)
    if name == "plan":
        field = p.pick(["flags", "max_decode_lanes", "prefill_token_budget", "evictable_cache_classes",
                        "max_evict_bytes", "protected_quota_bytes"])
        value = p.pick([0, 1, 2, 3, p.i(0, 1 << 16), (1 << 32) - 1])
        return f"{kind}:plan.{field}", plan._replace(**{field: value}), None
    rec = _lists(b)[name][j]
    fields = [f for f in rec._fields if f not in ("params", "prompt")]
    field = p.pick(fields)
    width = 16 if field in ("max_new_tokens", "overshoot") else 8 if field == "publish_to_cache" else 32 \
        if field not in ("lane_tag", "logits_nonce", "rng_counter_base", "grammar_handle",
                         "logit_bias_handle", "seed_handle") else 64
    value = p.pick([0, 1, 2, p.i(0, 64), (1 << width) - 1, p.i(0, (1 << width) - 1)])
    lst = list(getattr(plan, name))
    lst[j] = rec._replace(**{field: value})
    return f"{kind}:{name}.{field}", plan._replace(**{name: tuple(lst)}), None


COUNTS: Counter[str] = Counter()


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), rt_cfg=st.sampled_from(range(len(RUNTIMES))))
def _rejects_change_nothing(data, rt_cfg):
    ex = make_executor(FakeRuntime(**RUNTIMES[rt_cfg]), fault_injection=True)
    p = Planner(ex, data.draw)
    # A random state, built by random valid plans (and a few faults).
    for _ in range(p.i(1, 10)):
        if p.live() and p.coin(0.1):
            m = p.pick(p.live())
            ex.runtime.inject_fault(ex.lanes[m.tag].seq)
            p.rt_injected.add(m.tag)
        b, meta = p.random_plan()
        p.tick(b, meta, yield_=p.coin(0.1), as_bytes=p.coin(0.2))
    # One more valid plan, made wrong in one place.
    base, meta = p.random_plan()
    base_plan = base.build()
    kind, bad, want = mutate(p, base)
    if not isinstance(bad, (bytes, bytearray)) and p.coin(0.3):
        try:
            bad = codec.encode("TickPlan", bad)  # the same plan through decode_plan
        except (codec.CodecError, OverflowError, ValueError):
            pass  # a value the record's field cannot hold: the record goes as it is
    before = snapshot(ex)
    mem = ex.runtime.mem_counters()
    r = ex.tick(bad)
    if r.status == Status.OK:
        COUNTS["accepted"] += 1
        COUNTS[f"accepted {kind}"] += 1
        assert want is None, f"{kind}: accepted, wanted {want!r}"
        check_invariants(ex)
        return
    assert r.status != Status.Fatal, r.message
    COUNTS["rejected"] += 1
    COUNTS[f"rejected {kind}"] += 1
    if want is not None:
        assert r.status == want, (kind, r.status, r.message)
    assert r.events.status == int(r.status) and not r.events.emits and not r.events.admit_results
    after = snapshot(ex)
    assert ex.runtime.mem_counters() == mem
    assert before["digest"] == after["digest"]
    assert_unchanged(before, after)
    check_invariants(ex)
    # The plan that was refused was one that moves state: the same plan, unmutated,
    # is accepted now (plan_seq did not move; unless it does not fit) and changes it.
    r = p.tick(builder_of(base_plan), meta)
    if r.status == Status.OK:
        COUNTS["base accepted after reject"] += 1
        assert snapshot(ex)["digest"] != before["digest"]
        now = snapshot(ex)
        if any(now[k] != before[k] for k in ("lanes", "faulted", "cache", "seqs")):
            COUNTS["base changed lanes"] += 1


def builder_of(plan) -> PlanBuilder:
    """A builder holding `plan` (Planner.tick takes builders)."""
    b = PlanBuilder(plan.plan_seq, flags=plan.flags, max_decode_lanes=plan.max_decode_lanes,
                    prefill_token_budget=plan.prefill_token_budget,
                    evictable_cache_classes=plan.evictable_cache_classes,
                    max_evict_bytes=plan.max_evict_bytes,
                    protected_quota_bytes=plan.protected_quota_bytes)
    b.admits, b.prefills, b.decodes = list(plan.admits), list(plan.prefills), list(plan.decodes)
    b.commits, b.retires = list(plan.commits), list(plan.retires)
    return b


def test_a_rejected_plan_changes_nothing():
    COUNTS.clear()
    _rejects_change_nothing()
    # Not vacuous: both outcomes happened, many times, and refused plans would have moved state.
    assert COUNTS["rejected"] >= 50, COUNTS
    assert COUNTS["accepted"] >= 5, COUNTS
    assert COUNTS["base changed lanes"] >= 25, COUNTS
    kinds = {k.split(":")[0] for k in COUNTS if k.startswith("rejected ")}
    assert len(kinds) >= 10, COUNTS  # many different mistakes were refused


# ---------------------------------------------------------------- the digest


def test_digest_is_stable_across_a_reject_with_a_queued_op():
    ex = make_executor()
    ex.op({"op": "DESCRIBE", "op_id": 1}, queue=True)
    before = ex.state_digest()
    r = ex.tick(PlanBuilder(1).decode(99).build())
    assert r.status == Status.RejectUnknownLane
    assert [c.op_id for c in r.events.op_completions] == [1]
    assert ex.state_digest() == before
