"""The host sampler and its generator (contract §5): the RNG's three
implementations agree bit for bit, the filters keep what the algorithm says,
greedy takes the lowest id on ties, and draws follow the filtered
distribution (chi-square, with a negative control)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st
from scipy import stats

from superfluid.kernels.reference_sampler import filtered_distribution, greedy, sample, sample_u
from superfluid.kernels.rng import (
    GOLDEN,
    MASK64,
    position_to_int64,
    splitmix64,
    uniform,
    uniform_np,
    uniform_torch,
)

INF = float("inf")
NAN = float("nan")

# ------------------------------------------------------------------- rng


def test_splitmix64_gives_the_reference_sequence_from_seed_0():
    # The reference generator advances its state by GOLDEN and mixes it: its outputs from
    # seed 0 are splitmix64 of the states GOLDEN*0, GOLDEN*1, GOLDEN*2.
    expected = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert [splitmix64((i * GOLDEN) & MASK64) for i in range(3)] == expected


EDGE_POSITIONS = [0, 1, 2, 3, 2**32 - 1, 2**32, 2**53, 2**63 - 1, 2**63, 2**63 + 1, 2**64 - 2, 2**64 - 1]


def _positions(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return EDGE_POSITIONS + rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True).tolist()


def test_uniform_python_numpy_and_torch_agree_bit_for_bit():
    pos = _positions(20_000)
    ref = np.array([uniform(p) for p in pos])
    assert np.array_equal(uniform_np(np.array(pos, dtype=np.uint64)), ref)
    got = uniform_torch(torch.tensor([position_to_int64(p) for p in pos], dtype=torch.int64))
    assert got.dtype == torch.float64
    assert np.array_equal(got.numpy(), ref)
    assert ((ref >= 0) & (ref < 1)).all()


@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=50))
def test_uniform_paths_agree_on_any_positions(pos):
    ref = [uniform(p) for p in pos]
    assert uniform_np(np.array(pos, dtype=np.uint64)).tolist() == ref
    assert uniform_torch(torch.tensor([position_to_int64(p) for p in pos])).tolist() == ref


def test_uniform_of_consecutive_positions_is_uniform():
    u = uniform_np(np.arange(200_000, dtype=np.uint64))
    assert stats.kstest(u, "uniform").pvalue > 1e-3


# ----------------------------------------------------------------- greedy


@pytest.mark.parametrize("row, want", [
    ([1.0, 5.0, 5.0, 2.0], 1),
    ([5.0, 1.0, 5.0], 0),
    ([NAN, 5.0, 5.0], 1),
    ([NAN, NAN], 0),
    ([-INF, -INF, -INF], 0),
    ([-INF, NAN, -3.0, -3.0], 2),
    ([1.0, INF, INF], 1),
])
def test_greedy_takes_the_lowest_id_on_ties(row, want):
    r = np.array(row, dtype=np.float32)
    assert greedy(r) == want
    for temperature in (0.0, -1.0, NAN):  # each is greedy
        assert sample(r, temperature, 0, 0.0, 0.0, 123) == want


def test_a_row_with_no_candidates_falls_back_to_greedy():
    r = np.array([-INF, NAN, INF, -INF], dtype=np.float32)
    assert sample(r, 1.0, 0, 0.0, 0.0, 7) == 2  # +inf is no candidate but wins the argmax
    r = np.array([-INF, NAN, -INF], dtype=np.float32)
    assert sample(r, 1.0, 3, 0.5, 0.1, 7) == 0


# ---------------------------------------------------------------- filters


def _kept(row, *params) -> list[int]:
    return filtered_distribution(np.array(row, dtype=np.float32), *params)[0].tolist()


def test_top_k_keeps_the_best_and_the_lowest_ids_among_ties():
    assert _kept([1, 3, 3, 2, 3], 1.0, 2) == [1, 2]
    assert _kept([1, 3, 3, 2, 3], 1.0, 4) == [1, 2, 3, 4]
    assert _kept([3, 3, 3], 1.0, 1) == [0]
    assert _kept([-INF, 3, 1, -INF], 1.0, 5) == [1, 2]  # top_k >= |S| is no filter
    assert _kept([-INF, 3, NAN, 1], 1.0, 1) == [1]


def test_top_p_keeps_the_shortest_prefix_by_weight_then_id():
    # equal weights: c = 1, 2, 3, 4 and the target 0.5 * 4 is reached at the second
    assert _kept([0, 0, 0, 0], 1.0, 0, 0.5) == [0, 1]
    assert _kept([0, 0, 0, 0], 1.0, 0, 0.50001) == [0, 1, 2]
    assert _kept(np.log([0.2, 0.5, 0.3]), 1.0, 0, 0.7) == [1, 2]
    assert _kept(np.log([0.2, 0.5, 0.3]), 1.0, 0, 1e-9) == [1]
    assert _kept(np.log([0.2, 0.5, 0.3]), 1.0, 0, 1.0) == [0, 1, 2]  # top_p >= 1 is no filter


def test_min_p_is_relative_to_the_best():
    assert _kept(np.log([1.0, 0.5, 0.04]), 1.0, 0, 0.0, 0.05) == [0, 1]
    assert _kept([2, 7, 7, 1], 1.0, 0, 0.0, 1.0) == [1, 2]  # min_p 1 keeps the ties of the best
    assert _kept([2, 7, 7, 1], 1.0, 0, 0.0, 2.0) == [1, 2]  # and so does anything above 1
    assert sample(np.array([2, 7, 7, 1], dtype=np.float32), 1.0, 0, 0.0, 5.0, 0) in (1, 2)


def test_temperature_sharpens_and_flattens():
    row = np.array([0.0, 1.0, 2.0], dtype=np.float32)
    _, hot = filtered_distribution(row, 100.0)
    _, cold = filtered_distribution(row, 0.01)
    assert hot.max() < 0.34 and cold[2] > 0.999
    # a tiny temperature is a near-greedy draw, never -inf or NaN
    assert {sample(row, 1e-30, 0, 0.0, 0.0, p) for p in range(50)} == {2}


def test_order_is_top_k_then_top_p_then_min_p():
    row = np.log(np.array([0.4, 0.3, 0.2, 0.1], dtype=np.float64)).astype(np.float32)
    # w = 1, .75, .5, .25. Top-k 3 leaves W = 2.25: top_p 0.7 needs 1.575, reached at 1.75.
    assert _kept(row, 1.0, 3, 0.7) == [0, 1]
    # Without top-k W = 2.5: top_p 0.75 needs 1.875, reached at 2.25 (the third).
    assert _kept(row, 1.0, 0, 0.75) == [0, 1, 2]
    # min-p after top-p: the third's 0.5 < 0.6.
    assert _kept(row, 1.0, 0, 0.75, 0.6) == [0, 1]


def test_the_draw_takes_the_first_running_sum_above_u_times_r():
    flat = np.zeros(4, dtype=np.float32)  # w = 1, 1, 1, 1: r = 1, 2, 3, 4
    assert [sample_u(flat, 1.0, 0, 0.0, 0.0, u) for u in (0.0, 0.25, 0.5, 0.74, 0.75, 1 - 2**-53)] == \
        [0, 1, 2, 2, 3, 3]
    # zero weights (exp underflow) stay in the kept set but are never drawn, even at u = 0
    row = np.array([-1e4, -1e4, 0.0, -1e4, 0.0], dtype=np.float32)
    assert filtered_distribution(row, 1.0)[0].tolist() == [0, 1, 2, 3, 4]
    assert [sample_u(row, 1.0, 0, 0.0, 0.0, u) for u in (0.0, 0.5, 0.99)] == [2, 4, 4]


# ----------------------------------------------------------------- purity


def test_a_draw_is_a_pure_function_of_row_params_and_position():
    rng = np.random.default_rng(5)
    row = rng.standard_normal(1000).astype(np.float32)
    params = (0.9, 50, 0.95, 0.01)
    first = [sample(row, *params, p) for p in range(300)]
    assert [sample(row.copy(), *params, p) for p in range(300)] == first
    assert len(set(first)) > 20  # different positions give different tokens
    flat = np.zeros(1000, dtype=np.float32)
    toks = [sample(flat, 1.0, 0, 0.0, 0.0, p) for p in range(2000)]
    assert len(set(toks)) > 800


def test_large_rows_and_huge_positions():
    rng = np.random.default_rng(6)
    row = (3 * rng.standard_normal(128_256)).astype(np.float32)
    row[rng.random(row.size) < 0.5] = -INF
    for params in [(1.0, 0, 0.0, 0.0), (0.7, 40, 0.9, 0.05), (1.0, 0, 0.99, 0.0), (1.0, 0, 0.0, 0.2)]:
        ids, _probs = filtered_distribution(row, *params)
        for pos in (0, 2**63, 2**64 - 1):
            tok = sample(row, *params, pos)
            assert tok in set(ids.tolist())
            assert np.isfinite(row[tok])


# ------------------------------------------------------------ statistics

N_DRAWS = 20_000

COMBOS = [
    (1.0, 0, 0.0, 0.0),
    (0.7, 12, 0.0, 0.0),
    (1.3, 0, 0.8, 0.0),
    (1.0, 0, 0.0, 0.05),
    (0.9, 20, 0.9, 0.02),
]


def _row() -> np.ndarray:
    rng = np.random.default_rng(11)
    row = (1.5 * rng.standard_normal(40)).astype(np.float32)
    row[[3, 17, 29]] = -INF  # masked
    row[8] = row[9]  # a tie
    return row


def _chi2_p(tokens: np.ndarray, ids: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit over ids, the bins expected < 5 pooled; any token outside ids makes p 0."""
    if not np.isin(tokens, ids).all():
        return 0.0
    counts = np.array([np.count_nonzero(tokens == i) for i in ids], dtype=np.float64)
    exp = probs * tokens.size
    big = exp >= 5
    obs_b, exp_b = list(counts[big]), list(exp[big])
    if (~big).any():
        obs_b.append(counts[~big].sum())
        exp_b.append(exp[~big].sum())
    if len(obs_b) < 2:
        return 1.0
    exp_b = np.array(exp_b) * (sum(obs_b) / sum(exp_b))  # chisquare wants equal totals
    return float(stats.chisquare(obs_b, exp_b).pvalue)


@pytest.mark.parametrize("params", COMBOS)
def test_draws_follow_the_filtered_distribution(params):
    row = _row()
    ids, probs = filtered_distribution(row, *params)
    assert abs(probs.sum() - 1) < 1e-12 and (probs > 0).all()
    tokens = np.array([sample(row, *params, p) for p in range(N_DRAWS)])
    assert set(tokens.tolist()) <= set(ids.tolist()), "a token outside the kept set"
    assert _chi2_p(tokens, ids, probs) > 1e-3
    # negative control: the unfiltered softmax at the same temperature does not fit
    # (the filtered combos) and neither does a wrong temperature
    z = row.astype(np.float64) / params[0]
    fin = np.flatnonzero(np.isfinite(z))
    soft = np.exp(z[fin] - z[fin].max())
    soft /= soft.sum()
    if len(fin) != len(ids):
        assert _chi2_p(tokens, fin, soft) < 1e-9
    wrong_ids, wrong = filtered_distribution(row, params[0] * 1.5, *params[1:])
    assert _chi2_p(tokens, wrong_ids, wrong) < 1e-9
