"""Prefill step sizing under the planner's latency_wanted flag, and how a
decode finishes: EOS (unless IGNORE_EOS) before LENGTH, the grant otherwise."""

from __future__ import annotations

from superfluid.abi import Finish, Status
from superfluid.client.builder import PlanBuilder, sampling_params
from superfluid.executor.tick import LATENCY_STEP_SECS, LATENCY_STEP_UNIT
from superfluid.testing.executor import BIG_BUDGET, emit_of, emitted, fake, make_executor, put

PROMPT = 4 * 256


def _prefill_steps(*, latency: bool, secs_per_token: float | None) -> tuple[int, list[int]]:
    rt = fake(max_seq_len=2048, prefill_step_tokens=PROMPT, eos_rate=0.0)
    ex = make_executor(rt)
    ex.counters.prefill_secs_per_token = secs_per_token
    ex.rings.latency_flag = latency
    tokens = [i % 60 for i in range(PROMPT)]
    rt.reset_stats()
    r = ex.tick(PlanBuilder(1, prefill_token_budget=BIG_BUDGET).admit(1, put(ex, tokens))
                .prefill(1, 0, PROMPT).decode(1, 3).build())
    assert r.ok, r.message
    return rt.stats.steps, emitted(ex, emit_of(r, 1))


def test_latency_wanted_cuts_prefill_into_steps_sized_from_the_measured_rate():
    # A measured 256 tokens per LATENCY_STEP_SECS: steps of 256 while latency is wanted.
    spt = LATENCY_STEP_SECS / 256
    assert 256 % LATENCY_STEP_UNIT == 0
    plain_steps, plain = _prefill_steps(latency=False, secs_per_token=spt)
    fast_steps, fast = _prefill_steps(latency=True, secs_per_token=spt)
    # 1 prefill step + 2 decode rounds (the prefill's last step gives the first row)
    assert plain_steps == 1 + 2
    assert fast_steps == PROMPT // 256 + 2
    assert fast == plain  # the step sizes never change a token


def test_latency_steps_never_go_below_the_unit_nor_above_prefill_step_tokens():
    steps, _ = _prefill_steps(latency=True, secs_per_token=1.0)  # slow: LATENCY_STEP_UNIT a step
    assert steps == PROMPT // LATENCY_STEP_UNIT + 2
    steps, _ = _prefill_steps(latency=True, secs_per_token=1e-9)  # fast: capped by prefill_step_tokens
    assert steps == 1 + 2
    steps, _ = _prefill_steps(latency=True, secs_per_token=None)  # nothing measured yet: no cut
    assert steps == 1 + 2


def test_the_prefill_rate_is_measured():
    rt = fake(max_seq_len=2048, eos_rate=0.0)
    ex = make_executor(rt)
    assert ex.counters.prefill_secs_per_token is None
    ex.tick(PlanBuilder(1, prefill_token_budget=BIG_BUDGET).admit(1, put(ex, [1] * 64)).prefill(1, 0, 64).build())
    assert ex.counters.prefill_secs_per_token is None  # fewer tokens than a unit: no sample
    ex.tick(PlanBuilder(2, prefill_token_budget=BIG_BUDGET).admit(2, put(ex, [1] * 300)).prefill(2, 0, 300).build())
    assert ex.counters.prefill_secs_per_token is not None and ex.counters.prefill_secs_per_token > 0


def _decode(grant: int, *, max_seq_len: int = 64, prompt: int = 4, ignore_eos: bool = False,
            eos_rate: float = 1.0):
    rt = fake(max_seq_len=max_seq_len, eos_rate=eos_rate)
    ex = make_executor(rt)
    r = ex.tick(PlanBuilder(1, prefill_token_budget=BIG_BUDGET)
                .admit(1, put(ex, list(range(1, prompt + 1))), params=sampling_params(ignore_eos=ignore_eos))
                .prefill(1, 0, prompt).decode(1, grant).build())
    assert r.status == Status.OK, r.message
    e = emit_of(r, 1)
    return e.finish, emitted(ex, e), rt.vocabulary().eos


def test_eos_finishes_a_lane_and_is_emitted():
    finish, toks, eos = _decode(5)
    assert finish == int(Finish.EOS) and len(toks) == 1 and toks[0] in eos


def test_ignore_eos_runs_the_whole_grant():
    finish, toks, eos = _decode(5, ignore_eos=True)
    assert finish == int(Finish.NONE) and len(toks) == 5 and all(t in eos for t in toks)


def test_length_finishes_at_max_seq_len():
    finish, toks, _ = _decode(10, max_seq_len=8, prompt=4, eos_rate=0.0)
    assert finish == int(Finish.LENGTH) and len(toks) == 4  # 4 prompt + 4 generated = max_seq_len


def test_eos_wins_over_length_on_the_last_cell():
    # The first token generated fills the last cell and is an EOS: EOS, not LENGTH.
    finish, toks, eos = _decode(3, max_seq_len=5, prompt=4)
    assert finish == int(Finish.EOS) and len(toks) == 1 and toks[0] in eos
    # negative control: the same lane with IGNORE_EOS ends on LENGTH
    finish, toks, _ = _decode(3, max_seq_len=5, prompt=4, ignore_eos=True)
    assert finish == int(Finish.LENGTH) and len(toks) == 1


def test_a_grant_used_up_is_no_finish():
    finish, toks, _ = _decode(3, eos_rate=0.0)
    assert finish == int(Finish.NONE) and len(toks) == 3
