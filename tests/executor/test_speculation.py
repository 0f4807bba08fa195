"""Prompt-lookup speculation on the fake runtime (contract §4, §7): op
INSTALL_STRATEGY, who drafts, and the property that matters: a drafting
lane's tokens are bitwise the tokens it decodes without drafting, greedy and
sampled, whatever its grants, overshoot, batch and yields. Negative
controls: on a runtime whose continuations copy their context the drafts are
taken (fewer steps than tokens), and a verification that samples a row at the
wrong position, or picks from the wrong rows, gives other tokens. Drafts use
only spare cells: no NeedsReplan, no fault, the pool's promises kept."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from superfluid.abi import Determinism, Finish, OpKind, OpStatus, Status
from superfluid.client.builder import PlanBuilder, sampling_params
from superfluid.engine.fake import FakeRuntime
from superfluid.executor import speculation as spec
from superfluid.executor.speculation_decode import SpecPhase
from superfluid.testing.executor import BIG_BUDGET, GREEDY, HOST, SAMPLE, fake, make_executor, put
from superfluid.testing.invariants import assert_reject, snapshot
from superfluid.testing.speculation import Cycler, Driver, Req, clock, install

SPI = int(Determinism.SEED_PATH_INVARIANT)


def plain_tokens(rt_kw: dict, r: Req, n: int) -> tuple[list[int], int]:
    """The request alone, without a strategy, in one tick of n tokens: (tokens, finish)."""
    ex = make_executor(type_of(rt_kw)(**rt_kw["kw"]))
    d = Driver(ex)
    d.admit({1: dataclasses.replace(r, slot=0)})
    if n == 0:
        return [], 0
    d.decode({1: (n, 0)})
    return d.out[1], d.finish.get(1, 0)


def type_of(rt_kw: dict):
    return Cycler if rt_kw.get("cycler") else FakeRuntime


# ---------------------------------------------------------------- INSTALL_STRATEGY


def op(ex, **msg):
    return ex.op({"op": "INSTALL_STRATEGY", "op_id": 3, **msg})


GOOD = dict(slot=1, kind="prompt_lookup", max_draft=4, ngram_min=1, ngram_max=3)


@pytest.mark.parametrize("change, field", [
    (dict(slot=None), "slot"), (dict(slot=0), "slot"), (dict(slot=spec.MAX_SLOTS + 1), "slot"),
    (dict(slot="1"), "slot"), (dict(kind=None), "kind"), (dict(kind="medusa"), "kind"), (dict(kind=3), "kind"),
    (dict(max_draft=None), "max_draft"), (dict(max_draft=0), "max_draft"),
    (dict(max_draft=spec.MAX_DRAFT + 1), "max_draft"), (dict(max_draft=2.0), "max_draft"),
    (dict(ngram_min=0), "ngram_min"), (dict(ngram_min=None), "ngram_min"),
    (dict(ngram_max=spec.MAX_NGRAM + 1), "ngram_max"), (dict(ngram_min=3, ngram_max=2), "ngram_max"),
    (dict(ngram_max=True), "ngram_max"),
])
def test_install_strategy_refuses_a_bad_field_by_name(change, field):
    ex = make_executor()
    before = snapshot(ex)
    msg = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    done = op(ex, **msg)
    assert done.status == int(OpStatus.BadRequest) and done.op == int(OpKind.INSTALL_STRATEGY)
    assert f"'{field}'" in done.payload.decode("utf-8", "replace"), done.payload
    assert snapshot(ex) == before and not ex.registry.strategies.slots


@pytest.mark.parametrize("rt", [fake(exact_only=True), type("NoRows", (FakeRuntime,), {
    "step_rows": lambda self, feeds: None})(vocab_size=64, max_seq_len=64, page=4)], ids=["exact_only", "no_step_rows"])
def test_install_strategy_is_unsupported_where_drafts_cannot_be_verified(rt):
    ex = make_executor(rt)
    done = op(ex, **GOOD)
    assert done.status == int(OpStatus.Unsupported), done
    assert not ex.registry.strategies.slots


def test_a_reinstalled_slot_has_a_new_cert_and_old_lanes_keep_theirs():
    ex = make_executor(Cycler(vocab_size=16, max_seq_len=64, page=4, eos_rate=0.0))
    ex.registry.spec_gate.force = True
    first = install(ex, 1, max_draft=2)
    assert first == 1 and install(ex, 2) == 2
    d = Driver(ex)
    res = d.admit({1: Req([0, 1, 2, 3, 4, 0, 1], slot=1)}, determinism=SPI)
    (a,) = res.events.admit_results
    assert (a.cert_id, a.granted_class) == (first, SPI)
    again = install(ex, 1, max_draft=6)
    assert again == 3
    res = d.admit({2: Req([0, 1, 2, 3, 4, 0, 1], slot=1)})
    assert res.events.admit_results[0].cert_id == again
    d.decode({1: (6, 0), 2: (6, 0)})
    assert d.spec[1][-1][2] == first and d.spec[2][-1][2] == again
    # The old lane drafts by the old strategy (max_draft 2), the new one by the new (6).
    assert ex.lanes[1].spec.strategy.max_draft == 2 and ex.lanes[2].spec.strategy.max_draft == 6
    assert d.out[1] == d.out[2]


def test_an_admit_naming_an_installed_slot_passes_the_check_and_an_empty_one_does_not(ex):
    install(ex, 2)
    assert_reject(ex, PlanBuilder(1).admit(1, put(ex, [1, 2]), strategy_slot=1).build(),
                  Status.RejectIllegalCombination, "admits[0].strategy_slot")
    assert ex.tick(PlanBuilder(1).admit(1, put(ex, [1, 2]), strategy_slot=2).build()).ok


def test_who_drafts():
    """HOST lanes, logit-bias lanes and logprobs lanes are admitted with the
    slot but get cert 0 and never draft; the others draft."""
    ex = make_executor(Cycler(vocab_size=16, max_seq_len=64, page=4, eos_rate=0.0))
    ex.registry.spec_gate.force = True
    cert = install(ex)
    bias = ex.op({"op": "REGISTER_LOGIT_BIAS", "op_id": 1, "bias": {3: 0.5}}).handle
    prompt = put(ex, [0, 1, 2, 3, 4, 0, 1, 2])
    b = PlanBuilder(1, prefill_token_budget=BIG_BUDGET)
    kinds = {1: {}, 2: dict(sampling=SAMPLE), 3: dict(sampling=HOST), 4: dict(logit_bias_handle=bias),
             5: dict(want_logprobs=2)}
    for tag, kw in kinds.items():
        b.admit(tag, prompt, strategy_slot=1, **kw).prefill(tag, 0, 8)
    res = ex.tick(b.build())
    assert [a.cert_id for a in res.events.admit_results] == [cert, cert, 0, 0, 0]
    res = ex.tick(PlanBuilder(2).decode(1, 6).decode(2, 6).decode(3, 1).decode(4, 6).decode(5, 6).build())
    assert res.ok, res.message
    specs = {e.lane_tag: e.spec for e in res.events.emits}
    assert specs[1].proposed > 0 and specs[1].cert_id_in_effect == cert
    assert specs[2].proposed > 0
    assert all(tuple(specs[t]) == (0, 0, 0) for t in (3, 4, 5))
    assert spec.drafts(GREEDY, 0, None, 0) and not spec.drafts(GREEDY, 9, None, 0)  # a grammar: no drafts


# ---------------------------------------------------------------- the proposer


@settings(max_examples=40, deadline=None)
@given(tokens=st.lists(st.integers(0, 5), min_size=0, max_size=40), k=st.integers(0, 9),
       lo=st.integers(1, 4), width=st.integers(0, 3), cut=st.integers(0, 40))
def test_the_lane_index_drafts_what_the_reference_drafts(tokens, k, lo, width, cut):
    """LaneSpec's incremental index proposes what a scan of the whole history
    would, however the history grew between drafts."""
    strat = spec.Strategy(1, 1, "prompt_lookup", max(1, k), lo, lo + width)
    ls = spec.LaneSpec(strat)
    ls.propose(tokens[:cut], k)  # an earlier draft over a shorter history
    assert ls.propose(tokens, k) == spec.propose(tokens, k, lo, lo + width)


def test_a_short_cycle_drafts_itself_on():
    assert spec.propose([7, 1, 2, 1, 2], 5, 1, 3) == [1, 2, 1, 2, 1]
    assert spec.propose([1, 2, 3, 4], 3, 1, 2) == []  # no earlier occurrence
    assert spec.propose([3, 9, 3, 8, 3], 2, 1, 1) == [8, 3]  # the most recent occurrence wins


# ---------------------------------------------------------------- bitwise identity

PARAMS = st.one_of(
    st.just((GREEDY, sampling_params())),
    st.builds(lambda t, k, p, m, pen: (SAMPLE, sampling_params(temperature=t, top_k=k, top_p=p, min_p=m,
                                                               repeat_penalty=pen[0], presence_penalty=pen[1],
                                                               freq_penalty=pen[2])),
              st.sampled_from([0.0, 0.6, 1.0, 1.7]), st.sampled_from([0, 3, 8]), st.sampled_from([0.0, 0.8, 0.95]),
              st.sampled_from([0.0, 0.05]),
              st.sampled_from([(0.0, 0.0, 0.0), (0.0, 0.0, 0.0), (1.3, 0.5, 0.25), (0.8, 0.0, 0.5)])))


@st.composite
def requests(draw, vocab: int, max_len: int):
    n = draw(st.integers(1, 3))
    out = {}
    for tag in range(1, n + 1):
        pattern = draw(st.lists(st.integers(0, vocab - 2), min_size=1, max_size=5))
        reps = draw(st.integers(2, 6))
        noise = draw(st.lists(st.integers(0, vocab - 2), max_size=4))
        prompt = (pattern * reps + noise)[:max_len - 2]
        sampling, params = draw(PARAMS)
        if draw(st.booleans()):
            params = params._replace(flags=1)  # IGNORE_EOS
        slot = draw(st.sampled_from([1, 1, 2, 0]))
        out[tag] = Req(prompt, sampling, params, draw(st.integers(0, 1 << 40)), slot=slot)
    return out


def test_a_drafting_lane_decodes_the_tokens_it_decodes_without_drafts():
    seen: Counter[str] = Counter()

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data(), cycler=st.sampled_from([True, False]), engine=st.booleans(), verify_batches=st.booleans(),
           max_draft=st.integers(1, 10), ngram=st.tuples(st.integers(1, 3), st.integers(0, 2)))
    def run(data, cycler, engine, verify_batches, max_draft, ngram):
        vocab, max_len = data.draw(st.sampled_from([8, 40])), data.draw(st.sampled_from([40, 64]))
        kw = dict(vocab_size=vocab, max_seq_len=max_len, page=4, eos_rate=0.03, verify_batches=verify_batches,
                  seed=data.draw(st.integers(0, 3)), engine_sampling=engine, engine_draws=engine)
        rt_kw = dict(cycler=cycler, kw=kw)
        ex = make_executor(type_of(rt_kw)(**kw), clock=clock())
        ex.registry.spec_gate.force = data.draw(st.sampled_from([True, True, None]))
        install(ex, 1, max_draft=max_draft, ngram_min=ngram[0], ngram_max=ngram[0] + ngram[1])
        install(ex, 2, max_draft=3, ngram_min=2, ngram_max=2)
        reqs = data.draw(requests(vocab, max_len))
        d = Driver(ex)
        d.admit(reqs)
        for _ in range(data.draw(st.integers(2, 6))):
            live = [t for t in reqs if t not in d.finish]
            if not live:
                break
            grants = {t: (data.draw(st.integers(2, 10)), data.draw(st.sampled_from([0, 3, 12]))) for t in live}
            d.decode(grants, yield_=data.draw(st.sampled_from([False, False, True])), partial=data.draw(st.booleans()))
            for t, (n, _) in grants.items():
                seen["overshoot"] += d.counts[t][-1] > n
        # The reference samples on the other path (engine sampling flipped), alone, in one tick.
        flip = dict(rt_kw, kw=dict(kw, engine_sampling=not engine, engine_draws=not engine))
        for tag, r in reqs.items():
            assert plain_tokens(flip, r, len(d.out[tag])) == (d.out[tag], d.finish.get(tag, 0)), tag
            accepted = sum(s[1] for s in d.spec[tag])
            seen["proposed"] += sum(s[0] for s in d.spec[tag])
            seen["accepted"] += accepted
            seen["sampled_accepted"] += accepted if r.sampling == SAMPLE and r.params.temperature > 0 else 0
            seen["penalized_accepted"] += accepted if r.params.repeat_penalty else 0
            seen["finished"] += tag in d.finish
        seen["serial_verify"] += not verify_batches and sum(1 for t in reqs if any(s[0] for s in d.spec[t])) > 1

    run()
    # What the run is for: drafts taken, sampled and penalized ones too, past the grant, finishing.
    for what in ("proposed", "accepted", "sampled_accepted", "penalized_accepted", "overshoot", "finished",
                 "serial_verify"):
        assert seen[what] > 0, (what, seen)


def run_cycler(force, *, slot=1, n=60, grant=6, over=0, sampling=GREEDY, params=None, **kw):
    ex = make_executor(Cycler(vocab_size=16, max_seq_len=128, page=4, eos_rate=0.0, **kw), clock=clock())
    ex.registry.spec_gate.force = force
    install(ex, 1, max_draft=8, ngram_min=1, ngram_max=3)
    d = Driver(ex)
    d.admit({1: Req([3, 4, 0, 1, 2, 3, 4, 0, 1], sampling, params or sampling_params(ignore_eos=True), 11, slot)})
    while len(d.out[1]) < n:
        d.decode({1: (grant, over)})
    return d, ex


def test_drafts_are_taken_where_the_continuation_copies_its_context():
    d, ex = run_cycler(True, over=4)
    proposed = sum(s[0] for s in d.spec[1])
    accepted = sum(s[1] for s in d.spec[1])
    assert proposed > 0 and accepted / proposed > 0.8
    assert ex.runtime.stats.steps < len(d.out[1]) / 2  # fewer forward passes than tokens
    assert max(d.counts[1]) > 6  # the overshoot taken
    plain, _ = run_cycler(False, slot=0, over=4)
    assert d.out[1][:60] == plain.out[1][:60]
    snap = ex.registry.spec_gate.snapshot()["strategies"][0]
    assert (snap["proposed"], snap["accepted"]) == (proposed, accepted)


def test_overshoot_lets_only_a_verified_draft_past_the_grant():
    d, _ = run_cycler(True, grant=3, over=5)
    assert max(d.counts[1]) == 3 + 5 and min(d.counts[1]) >= 3
    held, _ = run_cycler(False, grant=3, over=5)  # the gate holds drafts off: overshoot does nothing
    assert all(s == (0, 0, 0) for s in held.spec[1]) and set(held.counts[1]) == {3}
    nospec, _ = run_cycler(None, slot=0, grant=3, over=5)  # no strategy: overshoot does nothing
    assert set(nospec.counts[1]) == {3}
    assert d.out[1][:60] == held.out[1][:60] == nospec.out[1][:60]


def test_a_verify_that_samples_at_the_wrong_position_is_caught(monkeypatch):
    params = sampling_params(temperature=3.0, ignore_eos=True)
    want, _ = run_cycler(False, slot=0, sampling=SAMPLE, params=params, boost=2.0)
    same, _ = run_cycler(True, sampling=SAMPLE, params=params, boost=2.0)
    assert same.out[1][:60] == want.out[1][:60]

    def off_by_one(self, lane, row):
        lane.rng_counter += 1
        try:
            return self._host_pick(lane, row)
        finally:
            lane.rng_counter -= 1

    monkeypatch.setattr(SpecPhase, "_verify_pick", off_by_one)
    wrong, _ = run_cycler(True, sampling=SAMPLE, params=params, boost=2.0)
    assert wrong.out[1][:60] != want.out[1][:60]


def test_a_verify_that_picks_from_the_wrong_rows_is_caught(monkeypatch):
    want, _ = run_cycler(False, slot=0)
    shifted = Cycler.step_rows

    def step_rows(self, feeds):  # each token gets the row of the token before it
        out = shifted(self, feeds)
        return [np.concatenate([r[:1], r[:-1]]) for r in out]

    monkeypatch.setattr(Cycler, "step_rows", step_rows)
    wrong, _ = run_cycler(True)
    assert wrong.out[1][:60] != want.out[1][:60]


# ---------------------------------------------------------------- memory


def test_drafts_take_only_cells_no_lane_was_promised():
    """A tight pool: the drafting lane drafts into what is spare, the other
    lane's promised cells stay free for it, nothing faults, and with no spare
    cells there are no drafts at all."""
    def run(cells):
        ex = make_executor(Cycler(vocab_size=16, max_seq_len=64, page=4, eos_rate=0.0, cells_total=cells))
        ex.registry.spec_gate.force = True
        install(ex, 1, max_draft=16)
        d = Driver(ex)
        d.admit({1: Req([0, 1, 2, 3, 4, 0, 1, 2], slot=1), 2: Req([5, 6, 7, 8], slot=0)})
        d.decode({1: (4, 16), 2: (4, 0)})
        return d, ex.runtime.mem_counters()
    (roomy, _), (tight, mem) = run(0), run(24)
    # 6 pages: 3 held, 2 promised (one to each lane), 1 spare: lane 1 drafts 8, not 16.
    assert [s[0] for s in tight.spec[1]] == [8] and [s[0] for s in roomy.spec[1]] == [16]
    assert tight.out[2] == roomy.out[2] and tight.out[1] == roomy.out[1][:9]
    assert mem.cells_used == mem.cells_total


def test_a_full_pool_means_no_drafts_and_no_replan():
    ex = make_executor(Cycler(vocab_size=16, max_seq_len=64, page=4, eos_rate=0.0, cells_total=8))
    ex.registry.spec_gate.force = True
    install(ex)
    d = Driver(ex)
    d.admit({1: Req([0, 1, 2, 3, 4, 0, 1, 2], slot=1)})  # 7 cells held: both pages
    d.decode({1: (1, 30)})  # its one round fills the last cell: nothing spare for a draft
    assert d.spec[1] == [(0, 0, 1)] and d.out[1] == [3]


def test_a_verification_the_pool_refuses_is_decoded_without_drafts():
    runs = []
    for refuse in (False, True):
        ex = make_executor(Cycler(vocab_size=16, max_seq_len=64, page=4, eos_rate=0.0))
        ex.registry.spec_gate.force = True
        install(ex, max_draft=2)
        d = Driver(ex)
        d.admit({1: Req([0, 1, 2, 3, 4, 0, 1, 2], slot=1)})
        if refuse:
            ex.runtime.inject_capacity_fault(times=1)  # the first verification only
        d.decode({1: (6, 0)})  # (Driver: no fault)
        runs.append(d)
    assert runs[0].out[1] == runs[1].out[1] == [3, 4, 0, 1, 2, 3]
    # Drafts of 2: rounds of 3 + 3 tokens; refused, the first round is plain (1), then 3, then 2 (a draft of 1).
    assert [r.spec[1][0][0] for r in runs] == [4, 3]


def test_a_rejected_plan_leaves_strategies_gate_and_lanes_as_they_were():
    ex = make_executor(Cycler(vocab_size=16, max_seq_len=64, page=4, eos_rate=0.0, max_batch=2))
    install(ex)
    d = Driver(ex)
    d.admit({1: Req([0, 1, 2, 3, 4, 0, 1], slot=1)})
    d.decode({1: (4, 2)})
    plan = PlanBuilder(d.seq + 1, max_decode_lanes=3).decode(1, 4, 4).build()
    assert_reject(ex, plan, Status.RejectBudget, "TickPlan.max_decode_lanes")
    digest = ex.state_digest()
    assert_reject(ex, PlanBuilder(d.seq + 1).admit(2, put(ex, [1]), strategy_slot=5).build(),
                  Status.RejectIllegalCombination, "admits[0].strategy_slot")
    assert ex.state_digest() == digest


def test_length_and_eos_finish_a_drafting_lane_where_they_finish_a_plain_one():
    for kw in (dict(max_seq_len=24), dict(max_seq_len=128, eos_ids=[4], eos_rate=0.0)):
        outs = []
        for force, slot in ((True, 1), (False, 0)):
            ex = make_executor(Cycler(vocab_size=16, page=4, **{"eos_rate": 0.0, **kw}))
            ex.registry.spec_gate.force = force
            install(ex)
            d = Driver(ex)
            d.admit({1: Req([0, 1, 2, 3, 0, 1, 2], params=sampling_params(), slot=slot)})
            while 1 not in d.finish:
                d.decode({1: (5, 9)})
            outs.append((d.out[1], d.finish[1]))
        assert outs[0] == outs[1]
        assert outs[0][1] == int(Finish.LENGTH if "eos_ids" not in kw else Finish.EOS)



def test_a_lane_whose_drafts_keep_missing_pauses_drafting_longer_each_time():
    st = spec.StrategyTable().install(1, "prompt_lookup", 4, 1, 2)
    ls = spec.LaneSpec(st)
    history = [1, 2, 3, 1, 2, 3, 1, 2]
    assert ls.propose(history, 4) == [3, 1, 2, 3]
    for misses, pause in ((1, 2), (2, 4), (3, 8)):
        ls.verified(1, 0)  # nothing taken
        assert (ls.misses, ls.pause, ls.depth) == (misses, pause, 1)
        assert [ls.propose(history, 4) for _ in range(pause)] == [[]] * pause
        assert ls.propose(history, ls.depth) == [3]  # drafting again, one token deep (decode caps k at depth)
    ls.verified(1, 1)  # taken: no pause, and deeper again
    assert (ls.misses, ls.pause, ls.depth) == (0, 0, 2) and ls.propose(history, ls.depth) == [3, 1]
    for _ in range(10):
        ls.verified(1, 0)
    assert ls.pause == spec.MAX_PAUSE
