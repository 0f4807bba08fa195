"""The executor's host sampler (contract §5): the order grammar → bias → penalties →
logprobs → temperature/filters/draw, the penalty formulas and their window and
exemptions, bans, the grammar hook, logprob records, bit-equality with the engine's
host and torch samplers, and that the caller's row is never written."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from scipy.special import log_softmax as ref_log_softmax

from superfluid.abi import MAX_TOP_LOGPROBS, Sampling
from superfluid.client.builder import sampling_params
from superfluid.executor import host_sampling as hs
from superfluid.executor.host_sampling import (
    PENALTY_WINDOW,
    GrammarMask,
    TokenLogprob,
    apply_logit_bias,
    apply_penalties,
    as_bias_arrays,
    log_softmax,
    penalizes,
    pick,
)
from superfluid.kernels import reference_sampler as reference
from superfluid.kernels.sampling import sample_torch

INF = float("inf")
NAN = float("nan")
U64 = 2**64 - 1
GREEDY, SAMPLE = int(Sampling.GPU_GREEDY), int(Sampling.GPU_SAMPLE)
f32 = np.float32


def row_of(*v: float) -> np.ndarray:
    return np.array(v, dtype=np.float32)


class AllowOnly:
    """A grammar stand-in: only `ids` stay; records the row it was shown."""

    def __init__(self, ids):
        self.ids = np.asarray(sorted(ids), dtype=np.int64)
        self.seen: np.ndarray | None = None

    def mask(self, row: np.ndarray) -> None:
        self.seen = row.copy()
        keep = row[self.ids].copy()
        row[:] = -np.inf
        row[self.ids] = keep


class Overflow(Exception):
    pass


class Overflowing:
    def mask(self, row: np.ndarray) -> None:
        row[:] = 0.0  # writes first, then fails: the caller's row must still be intact
        raise Overflow("grammar stack overflow")


# ---------------------------------------------------------------- penalizes


@pytest.mark.parametrize("kw, on", [
    ({}, False),
    ({"repeat_penalty": 1.0}, False),
    ({"repeat_penalty": 0.0}, False),
    ({"repeat_penalty": 1.1}, True),
    ({"repeat_penalty": 0.9}, True),
    ({"presence_penalty": 0.5}, True),
    ({"presence_penalty": -0.5}, True),
    ({"freq_penalty": 0.1}, True),
    ({"repeat_penalty": 1.0, "presence_penalty": 0.0, "freq_penalty": 0.0, "temperature": 1.0}, False),
])
def test_penalizes(kw, on):
    assert penalizes(sampling_params(**kw)) is on


# ---------------------------------------------------------------- penalties


def test_repeat_penalty_divides_positive_and_multiplies_non_positive_logits():
    row = row_of(2.0, -2.0, 0.0, 3.0, 1.5)
    apply_penalties(row, [0, 1, 2, 0, 0], sampling_params(repeat_penalty=2.0))
    # once per distinct token, whatever its count; token 3 and 4 untouched
    assert row.tolist() == [1.0, -4.0, 0.0, 3.0, 1.5]


def test_presence_once_and_frequency_per_count():
    row = row_of(1.0, 1.0, 1.0, 1.0)
    apply_penalties(row, [0, 0, 0, 2], sampling_params(presence_penalty=0.5, freq_penalty=0.25))
    assert row.tolist() == [1.0 - (3 * 0.25 + 0.5), 1.0, 1.0 - (0.25 + 0.5), 1.0]


def test_repeat_then_presence_and_frequency():
    row = row_of(3.0, -1.0)
    apply_penalties(row, [0, 1, 1], sampling_params(repeat_penalty=1.5, presence_penalty=0.5, freq_penalty=0.125))
    want = [f32(f32(3.0) / f32(1.5)) - f32(1 * 0.125 + 0.5), f32(f32(-1.0) * f32(1.5)) - f32(2 * 0.125 + 0.5)]
    assert row.tolist() == [float(f32(w)) for w in want]


def test_only_the_last_64_committed_tokens_count():
    history = [7] * 10 + [1] * PENALTY_WINDOW  # 7 only before the window
    row = np.ones(10, dtype=np.float32)
    apply_penalties(row, history, sampling_params(repeat_penalty=2.0, presence_penalty=1.0, freq_penalty=0.01))
    assert row[7] == 1.0
    assert row[1] == f32(f32(0.5) - f32(64 * 0.01 + 1.0))
    # a token before and inside the window: its count is the window's only
    history = [3] * 100 + [5] * 62 + [3] * 2
    row = np.zeros(10, dtype=np.float32)
    apply_penalties(row, np.array(history), sampling_params(freq_penalty=1.0))
    assert row[3] == -2.0 and row[5] == -62.0
    # exactly 64 back is inside, 65 back is out
    history = [4] + [8] + [1] * (PENALTY_WINDOW - 1)
    row = np.zeros(10, dtype=np.float32)
    apply_penalties(row, history, sampling_params(presence_penalty=1.0))
    assert row[4] == 0.0 and row[8] == -1.0


@pytest.mark.parametrize("exempt", [frozenset({2, 9}), {2, 9}, np.array([9, 2]), [2, 9]])
def test_exempt_ids_are_never_penalized(exempt):
    row = np.full(10, 2.0, dtype=np.float32)
    p = sampling_params(repeat_penalty=3.0, presence_penalty=1.0, freq_penalty=1.0)
    apply_penalties(row, [2, 9, 2, 9, 4], p, exempt)
    assert row[2] == 2.0 and row[9] == 2.0
    assert row[4] < 2.0


def test_ids_outside_the_row_and_off_params_are_ignored():
    row = row_of(1.0, 2.0)
    apply_penalties(row, [5, 99, -1], sampling_params(presence_penalty=1.0))
    assert row.tolist() == [1.0, 2.0]
    apply_penalties(row, [0, 1], sampling_params(repeat_penalty=1.0))  # off
    assert row.tolist() == [1.0, 2.0]
    apply_penalties(row, [], sampling_params(presence_penalty=1.0))
    assert row.tolist() == [1.0, 2.0]


def _reference_penalties(row, history, p, exempt):
    """A per-token loop in float32, straight from the formulas."""
    out = row.copy()
    tail = list(history)[-PENALTY_WINDOW:]
    r = p.repeat_penalty
    for t in sorted(set(tail)):
        if t in exempt or not 0 <= t < len(out):
            continue
        x = out[t]
        if r not in (0.0, 1.0):
            x = x / f32(r) if x > 0 else x * f32(r)
        x = f32(x - f32(f32(tail.count(t)) * f32(p.freq_penalty) + f32(p.presence_penalty)))
        out[t] = x
    return out


@given(row=st.lists(st.one_of(st.floats(-50, 50, width=32), st.just(-INF)), min_size=1, max_size=40),
       history=st.lists(st.integers(0, 45), max_size=150),
       r=st.sampled_from([0.0, 1.0, 0.5, 1.1, 2.0]), pres=st.sampled_from([0.0, 0.5, -1.0]),
       freq=st.sampled_from([0.0, 0.25, 1.5]), exempt=st.frozensets(st.integers(0, 45), max_size=5))
def test_penalties_match_the_per_token_reference(row, history, r, pres, freq, exempt):
    p = sampling_params(repeat_penalty=r, presence_penalty=pres, freq_penalty=freq)
    x = np.array(row, dtype=np.float32)
    want = _reference_penalties(x, history, p, exempt)
    apply_penalties(x, history, p, exempt)
    np.testing.assert_array_equal(x, want)


# --------------------------------------------------------------- logit bias


def test_logit_bias_mapping_and_arrays():
    row = row_of(0.0, 1.0, 2.0)
    apply_logit_bias(row, {0: 1.5, 2: -0.5, 7: 100.0})  # 7 is outside the row: ignored
    assert row.tolist() == [1.5, 1.0, 1.5]
    apply_logit_bias(row, (np.array([1, 1, -3]), np.array([0.25, 0.25, 9.0])))  # duplicates add
    assert row.tolist() == [1.5, 1.5, 1.5]
    apply_logit_bias(row, as_bias_arrays({0: -INF}))
    assert row.tolist() == [-INF, 1.5, 1.5]


def test_a_minus_inf_bias_bans_a_token():
    rng = np.random.default_rng(3)
    row = rng.standard_normal(50).astype(np.float32)
    best = int(np.argmax(row))
    row[best] += 5.0  # without the ban it is drawn almost always
    p = sampling_params(temperature=1.0)
    drawn = {pick(row, SAMPLE, p, pos, bias={best: -INF})[0] for pos in range(2000)}
    assert best not in drawn and len(drawn) > 5
    assert pick(row, GREEDY, p, 0, bias={best: -INF})[0] != best
    # +inf logit + -inf bias is NaN: still banned
    row[best] = INF
    assert best not in {pick(row, SAMPLE, p, pos, bias={best: -INF})[0] for pos in range(200)}


# --------------------------------------------------------- order of operations


def test_a_bias_makes_a_token_win():
    row = row_of(3.0, 1.0, 2.0)
    assert pick(row, GREEDY, sampling_params(), 0)[0] == 0
    assert pick(row, GREEDY, sampling_params(), 0, bias={1: 2.5})[0] == 1


def test_penalties_come_after_the_bias_and_logprobs_before_temperature():
    row = row_of(0.0, 0.0, 1.0)
    # bias first: token 1 goes 0 -> 4, then the repeat penalty halves it -> 2. (Penalty
    # first would give 0 * 2 + 4 = 4.) The exempt token 2 keeps its 1.
    p = sampling_params(temperature=0.25, repeat_penalty=2.0)
    tok, lp = pick(row, GREEDY, p, 0, bias={1: 4.0}, history=[1, 2], exempt=frozenset({2}), want_logprobs=3)
    treated = [0.0, 2.0, 1.0]
    m = 2.0
    ls = math.log(sum(math.exp(v - m) for v in treated))  # no temperature in the logprobs

    def want(i: int) -> float:
        return float(f32((treated[i] - m) - ls))

    assert tok == 1
    assert lp == TokenLogprob(1, want(1), (2, 0), (want(2), want(0)))
    # the same logprobs whatever the temperature, greedy or sampled
    for t in (0.0, 0.25, 1.0, 7.0):
        q = sampling_params(temperature=t, repeat_penalty=2.0)
        for pos in range(20):
            tok, lp2 = pick(row, SAMPLE, q, pos, bias={1: 4.0}, history=[1, 2], exempt=frozenset({2}),
                            want_logprobs=3)
            assert lp2.logprob == want(tok)
            assert dict(zip(lp2.top_ids, lp2.top_logprobs)) == {i: want(i) for i in range(3) if i != tok}


def test_the_grammar_mask_comes_first():
    row = row_of(5.0, 1.0, 2.0, 3.0)
    g = AllowOnly([1, 2])
    p = sampling_params(presence_penalty=1.0)
    tok, lp = pick(row, GREEDY, p, 0, grammar=g, bias={0: 10.0, 1: 0.5}, history=[2], want_logprobs=4)
    np.testing.assert_array_equal(g.seen, row)  # the grammar saw the raw row: no bias, no penalty
    assert tok == 1  # 1 + 0.5 beats 2 - 1; a bias never lifts a masked token
    assert lp.top_ids == (2,)  # masked tokens are no alternatives
    assert isinstance(g, GrammarMask)


@settings(max_examples=40)
@given(allowed=st.frozensets(st.integers(0, 63), min_size=1, max_size=4), seed=st.integers(0, 2**32 - 1),
       temperature=st.sampled_from([0.0, 0.5, 1.0, 5.0]), top_p=st.sampled_from([0.0, 0.9]))
def test_only_grammar_allowed_tokens_appear(allowed, seed, temperature, top_p):
    row = (np.random.default_rng(seed).standard_normal(64) * 3).astype(np.float32)
    p = sampling_params(temperature=temperature, top_p=top_p)
    for pos in range(seed, seed + 50):
        assert pick(row, SAMPLE, p, pos, grammar=AllowOnly(allowed))[0] in allowed


def test_a_grammar_failure_propagates_and_leaves_the_row_alone():
    row = row_of(1.0, 2.0, 3.0)
    with pytest.raises(Overflow):
        pick(row, SAMPLE, sampling_params(temperature=1.0), 0, grammar=Overflowing())
    assert row.tolist() == [1.0, 2.0, 3.0]


# ------------------------------------------------ one generator on every path

TEMPS = [0.0, -1.0, 1e-6, 0.05, 0.7, 1.0, 2.0, 100.0]
TOP_PS = [0.0, 0.1, 0.5, 0.9, 0.999999, 1.0, 1.5]
MIN_PS = [0.0, 0.01, 0.2, 0.5, 1.0]


def _random_case(rng: np.random.Generator, V: int):
    row = (rng.standard_normal(V) * rng.choice([0.1, 1.0, 5.0, 30.0])).astype(np.float32)
    row[rng.random(V) < rng.choice([0.0, 0.3, 0.9])] = -INF
    row[rng.random(V) < 0.02] = NAN
    if rng.random() < 0.3:
        row = np.where(np.isfinite(row), np.round(row), row).astype(np.float32)  # ties
    t = float(rng.choice(TEMPS)) if rng.random() < 0.7 else float(rng.uniform(0.1, 3.0))
    p = sampling_params(temperature=t, top_k=int(rng.choice([0, 1, 2, 3, V // 2, V, V + 5])),
                        top_p=float(rng.choice(TOP_PS)), min_p=float(rng.choice(MIN_PS)))
    return row, p, int(rng.integers(0, U64, dtype=np.uint64, endpoint=True))


def _torch_token(row: np.ndarray, p, pos: int) -> int:
    return int(sample_torch(torch.from_numpy(row[None].copy()), [p.temperature], [p.top_k], [p.top_p],
                            [p.min_p], [pos])[0])


def test_host_pick_is_the_engine_and_torch_draw():
    rng = np.random.default_rng(2024)
    for V in (1, 2, 7, 64, 333, 4096):
        for _ in range(60):
            row, p, pos = _random_case(rng, V)
            tok, _ = pick(row, SAMPLE, p, pos)
            assert tok == reference.sample(row, p.temperature, p.top_k, p.top_p, p.min_p, pos)
            assert tok == _torch_token(row, p, pos), (V, p, pos)


def test_host_pick_with_bias_and_penalties_draws_from_the_treated_row():
    rng = np.random.default_rng(5)
    V = 500
    for _ in range(100):
        row, p, pos = _random_case(rng, V)
        p = p._replace(repeat_penalty=1.3, presence_penalty=0.4, freq_penalty=0.1)
        history = rng.integers(0, V, 100).tolist()
        bias = {int(i): float(v) for i, v in zip(rng.integers(0, V, 10), rng.normal(0, 3, 10))}
        exempt = frozenset({0, 1})
        treated = row.copy()
        apply_logit_bias(treated, bias)
        apply_penalties(treated, history, p, exempt)
        tok, _ = pick(row, SAMPLE, p, pos, bias=bias, history=history, exempt=exempt)
        assert tok == reference.sample(treated, p.temperature, p.top_k, p.top_p, p.min_p, pos)
        assert tok == _torch_token(treated, p, pos)


def test_a_vocabulary_sized_row():
    rng = np.random.default_rng(11)
    row = (3 * rng.standard_normal(128_256)).astype(np.float32)
    p = sampling_params(temperature=0.8, top_k=40, top_p=0.95, min_p=0.02)
    for pos in (0, 2**63, U64):
        assert pick(row, SAMPLE, p, pos)[0] == _torch_token(row, p, pos)


# ------------------------------------------------------------------- greedy


@pytest.mark.parametrize("row, want", [
    ([1.0, 5.0, 5.0, 2.0], 1),
    ([5.0, 1.0, 5.0], 0),
    ([NAN, 5.0, 5.0], 1),
    ([-INF, -INF], 0),
])
def test_greedy_takes_the_lowest_id_on_ties(row, want):
    r = np.array(row, dtype=np.float32)
    assert pick(r, GREEDY, sampling_params(temperature=1.0), 9)[0] == want  # GPU_GREEDY ignores temperature
    for t in (0.0, -2.0):
        assert pick(r, SAMPLE, sampling_params(temperature=t), 9)[0] == want


# ----------------------------------------------------------------- logprobs


def _reference_alternatives(x: np.ndarray, chosen: int, n: int) -> list[int]:
    """Every token by (logit desc, id asc), full sort: the most likely others with mass."""
    x = np.where(np.isnan(x), -INF, x)
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    return [i for i in order if i != chosen and x[i] > -INF][: n - 1]


@settings(max_examples=80)
@given(row=st.lists(st.one_of(st.sampled_from([-INF, NAN, 0.0, 1.0, 2.0]), st.floats(-30, 30, width=32)),
                    min_size=1, max_size=60),
       n=st.integers(1, MAX_TOP_LOGPROBS + 5), temperature=st.sampled_from([0.0, 0.7, 1.0]),
       pos=st.integers(0, U64))
def test_logprob_records(row, n, temperature, pos):
    x = np.array(row, dtype=np.float32)
    tok, lp = pick(x, SAMPLE, sampling_params(temperature=temperature), pos, want_logprobs=n)
    assert tok == lp.token_id
    nn = min(n, MAX_TOP_LOGPROBS)
    assert list(lp.top_ids) == _reference_alternatives(x, tok, nn)
    assert len(lp.top_ids) == len(lp.top_logprobs) <= nn - 1
    assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
    finite = np.where(np.isnan(x), -INF, x)
    if np.isfinite(finite).any():
        ref = ref_log_softmax(finite.astype(np.float64))
        # float32 values of the float64 log-softmax (a summation-order ulp of slack)
        np.testing.assert_allclose(lp.logprob, ref[tok], rtol=1e-6)
        np.testing.assert_allclose(lp.top_logprobs, ref[list(lp.top_ids)], rtol=1e-6)
        full = log_softmax(x)
        assert math.isclose(float(np.exp(full).sum()), 1.0, rel_tol=1e-12)
        np.testing.assert_allclose(full, ref, rtol=1e-12, atol=1e-12)


def test_one_logprob_is_the_chosen_token_alone_and_n_is_capped():
    row = np.arange(100, dtype=np.float32)
    p = sampling_params()
    assert pick(row, GREEDY, p, 0, want_logprobs=1)[1].top_ids == ()
    assert pick(row, GREEDY, p, 0)[1] is None
    _, lp = pick(row, GREEDY, p, 0, want_logprobs=1000)
    assert lp.token_id == 99
    assert lp.top_ids == tuple(range(98, 98 - (MAX_TOP_LOGPROBS - 1), -1))


def test_logprob_ties_go_to_the_lower_id_on_a_large_row():
    rng = np.random.default_rng(8)
    V = 128_256
    row = rng.standard_normal(V).astype(np.float32)
    row[[5000, 17, 90_000, 3]] = 9.0  # a four-way tie at the top
    row[[60_000, 70_000]] = 8.0
    _, lp = pick(row, GREEDY, sampling_params(), 0, want_logprobs=6)
    assert lp.token_id == 3
    assert lp.top_ids == (17, 5000, 90_000, 60_000, 70_000)
    ref = ref_log_softmax(row.astype(np.float64))
    assert lp.logprob == float(f32(ref[3]))


def test_logprobs_of_degenerate_rows():
    _, lp = pick(row_of(-INF, -INF, -INF), SAMPLE, sampling_params(temperature=1.0), 0, want_logprobs=3)
    assert lp == TokenLogprob(0, -INF, (), ())
    _, lp = pick(row_of(INF, 1.0, INF), GREEDY, sampling_params(), 0, want_logprobs=3)
    assert lp == TokenLogprob(0, float(f32(-math.log(2))), (2,), (float(f32(-math.log(2))),))


# ------------------------------------------------------- the caller's row


def _configs():
    p = sampling_params(temperature=0.9, top_k=5, repeat_penalty=1.5, presence_penalty=0.5, freq_penalty=0.2)
    yield dict(params=p, history=[1, 2, 3, 3])
    yield dict(params=p, bias={0: 3.0, 4: -INF})
    yield dict(params=p, grammar=AllowOnly([1, 5, 7]))
    yield dict(params=p, bias={2: 1.0}, history=[2, 2], grammar=AllowOnly(range(8)), want_logprobs=4)


def _leaves_the_row_alone(picker) -> bool:
    row = np.random.default_rng(0).standard_normal(16).astype(np.float32)
    before = row.copy()
    for cfg in _configs():
        cfg = dict(cfg)
        params = cfg.pop("params")
        for mode in (GREEDY, SAMPLE):
            picker(row, mode, params, 77, **cfg)
            if not np.array_equal(row, before):
                return False
    return True


def _in_place_pick(row, mode, params, position, *, bias=None, history=(), exempt=frozenset(), grammar=None,
                   want_logprobs=0):
    """The bug the check is for: treating the caller's row instead of a copy."""
    if grammar is not None:
        grammar.mask(row)
    if bias:
        apply_logit_bias(row, bias)
    apply_penalties(row, history, params, exempt)
    return pick(row, mode, params, position, want_logprobs=want_logprobs)


def test_pick_never_writes_the_callers_row():
    assert _leaves_the_row_alone(pick)
    assert not _leaves_the_row_alone(_in_place_pick)  # negative control


def test_no_copy_when_nothing_applies_and_a_read_only_row_works(monkeypatch):
    seen = []
    real = reference.sample
    monkeypatch.setattr(hs.reference, "sample", lambda row, *a: seen.append(row) or real(row, *a))
    row = np.random.default_rng(1).standard_normal(32).astype(np.float32)
    row.flags.writeable = False  # a view of the logits ring, say
    p = sampling_params(temperature=1.0, presence_penalty=1.0)
    pick(row, SAMPLE, p, 1)  # penalties on, but no history
    pick(row, SAMPLE, p, 1, bias={}, history=[40, 50], exempt=frozenset({40}))  # nothing lands in the row
    assert seen[0] is row and seen[1] is row
    pick(row, SAMPLE, p, 1, bias={3: 1.0}, history=[4])
    assert not np.shares_memory(seen[2], row)
