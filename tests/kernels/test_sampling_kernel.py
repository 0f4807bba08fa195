"""One generator on every path (contract §5): the torch device sampler and the
Triton kernel give the host sampler's token for the same row, params and
position. Without a GPU the kernel runs under Triton's interpreter (slow), so
its cases are small, with small blocks so the multi-block paths run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from superfluid.kernels import sampling as ks
from superfluid.kernels.reference_sampler import sample, sample_u
from superfluid.kernels.rng import position_to_int64
from superfluid.kernels.sampling import sample_torch
from superfluid.testing.kernels import KDEV, U64, needs_triton

INF = float("inf")
NAN = float("nan")


def _host(rows: np.ndarray, T, K, P, M, pos) -> list[int]:
    return [sample(rows[i], float(T[i]), int(K[i]), float(P[i]), float(M[i]), int(pos[i]))
            for i in range(rows.shape[0])]


def _torch(rows: np.ndarray, *params, device: str = "cpu") -> list[int]:
    return sample_torch(torch.from_numpy(rows).to(device), *params).cpu().tolist()


def _triton(rows: np.ndarray, *params, block: int) -> list[int]:
    return ks.sample_triton(torch.from_numpy(rows).to(KDEV), *params, block=block).cpu().tolist()


# --------------------------------------------------------- random cases

TEMPS = [0.0, -1.0, 1e-30, 1e-6, 0.05, 0.7, 1.0, 2.0, 100.0]
TOP_PS = [0.0, 1e-9, 0.1, 0.5, 0.9, 0.999999, 1.0, 1.5]
MIN_PS = [0.0, 0.01, 0.2, 0.5, 1.0, 3.0]


def _random_batch(rng: np.random.Generator, B: int, V: int):
    """Rows with masks, NaNs, ties and exact duplicates; params across their edges."""
    rows = (rng.standard_normal((B, V)) * rng.choice([0.1, 1.0, 5.0, 30.0], (B, 1))).astype(np.float32)
    rows[rng.random((B, V)) < rng.choice([0.0, 0.3, 0.9], (B, 1))] = -INF
    rows[rng.random((B, V)) < 0.02] = NAN
    coarse = rng.random(B) < 0.3  # few distinct values: ties everywhere
    rows[coarse] = np.where(np.isfinite(rows[coarse]), np.round(rows[coarse]), rows[coarse])
    rows[rng.random(B) < 0.05] = -INF  # no candidates
    T = rng.choice(TEMPS, B)
    free = rng.random(B) < 0.3
    T[free] = rng.uniform(0.1, 3.0, int(free.sum()))
    K = rng.choice([0, 1, 2, 3, V // 2, V - 1, V, V + 5, -1], B)
    P = rng.choice(TOP_PS, B)
    free = rng.random(B) < 0.3
    P[free] = rng.random(int(free.sum()))
    M = rng.choice(MIN_PS, B)
    pos = rng.integers(0, U64, B, dtype=np.uint64, endpoint=True).tolist()
    pos[0] = U64
    return rows, T, K, P, M, pos


def test_torch_matches_host_on_a_seeded_bulk():
    rng = np.random.default_rng(1234)
    for V in (1, 2, 5, 17, 64, 333):
        for _ in range(2):
            batch = _random_batch(rng, 400, V)
            assert _torch(*batch) == _host(*batch), V


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_torch_on_the_gpu_matches_host():
    # GPU cumsum and exp round differently in the last bit: a token can differ only when a
    # comparison lands within ulps of a boundary, which random rows do not hit.
    rng = np.random.default_rng(99)
    for V in (5, 64, 333, 4096):
        batch = _random_batch(rng, 256, V)
        assert _torch(*batch, device="cuda") == _host(*batch), V


def test_torch_matches_host_on_vocabulary_sized_rows():
    rng = np.random.default_rng(7)
    V = 128_256
    rows = (3 * rng.standard_normal((6, V))).astype(np.float32)
    rows[1, rng.random(V) < 0.99] = -INF  # a grammar mask
    rows[2, :1000] = rows[2].max()  # a wide tie at the top
    params = ([1.0, 0.7, 1.0, 0.5, 1.2, 0.0], [0, 40, 0, 50, 0, 0], [0.0, 0.9, 0.95, 0.0, 0.999, 0.0],
              [0.0, 0.0, 0.0, 0.05, 0.01, 0.0], [0, 2**63, 5, 2**64 - 1, 99, 1])
    assert _torch(rows, *params) == _host(rows, *params)


VALUES = st.one_of(st.sampled_from([-INF, NAN, INF, 0.0, -0.0, 1.0, -1.0, 2.5, 1e-30, -1e30]),
                   st.floats(-60, 60, width=32))


@st.composite
def batches(draw, max_b: int = 6, max_v: int = 24):
    B = draw(st.integers(1, max_b))
    V = draw(st.integers(1, max_v))
    rows = np.array(draw(st.lists(st.lists(VALUES, min_size=V, max_size=V), min_size=B, max_size=B)),
                    dtype=np.float32)
    cols = st.lists
    T = draw(cols(st.one_of(st.sampled_from(TEMPS), st.floats(1e-3, 10)), min_size=B, max_size=B))
    K = draw(cols(st.integers(-1, V + 2), min_size=B, max_size=B))
    P = draw(cols(st.one_of(st.sampled_from(TOP_PS), st.floats(0, 1)), min_size=B, max_size=B))
    M = draw(cols(st.one_of(st.sampled_from(MIN_PS), st.floats(0, 1)), min_size=B, max_size=B))
    pos = draw(cols(st.integers(0, U64), min_size=B, max_size=B))
    return rows, T, K, P, M, pos


@settings(max_examples=300, deadline=None)
@given(batches())
def test_torch_matches_host(batch):
    assert _torch(*batch) == _host(*batch)


def test_positions_as_an_int64_tensor_mean_the_same_u64():
    rows = np.zeros((3, 50), dtype=np.float32)
    pos = [2**63, 2**64 - 1, 12]
    as_tensor = torch.tensor([position_to_int64(p) for p in pos], dtype=torch.int64)
    args = ([1.0] * 3, [0] * 3, [0.0] * 3, [0.0] * 3)
    assert sample_torch(torch.from_numpy(rows), *args, as_tensor).tolist() == _host(rows, *args, pos)


# ------------------------------------------------------------ greedy ties

TIE_ROWS = [
    ([1.0, 5.0, 5.0, 2.0], 1),
    ([NAN, 5.0, 5.0], 1),
    ([-INF, -INF, -INF], 0),
    ([NAN, NAN, -INF], 0),
    ([1.0, INF, INF], 1),
]


@pytest.mark.parametrize("row, want", TIE_ROWS)
def test_torch_greedy_takes_the_lowest_id_on_ties(row, want):
    rows = np.array([row] * 3, dtype=np.float32)
    got = _torch(rows, [0.0, -2.0, NAN], [0, 5, 0], [0.0, 0.5, 0.0], [0.0, 0.1, 0.0], [1, 2, 3])
    assert got == [want] * 3


@needs_triton
def test_triton_greedy_takes_the_lowest_id_on_ties_across_blocks():
    V = 150
    rows = np.full((5, V), -1.0, dtype=np.float32)
    rows[0, [70, 20, 140]] = 9.0  # ties in three blocks of 64
    rows[1, [64, 65, 127]] = 9.0  # a tie at a block's first id
    rows[2, :] = -INF
    rows[3, :] = NAN
    rows[4, [3, 100]] = INF
    got = _triton(rows, [0.0] * 5, [0] * 5, [0.0] * 5, [0.0] * 5, list(range(5)), block=64)
    assert got == [20, 64, 0, 0, 3]
    for row, want in TIE_ROWS:
        r = np.array([row], dtype=np.float32)
        assert _triton(r, [0.0], [0], [0.0], [0.0], [0], block=16) == [want]


# ---------------------------------------------------------------- triton


@needs_triton
@pytest.mark.parametrize("V, block, B", [(7, 64, 24), (64, 16, 16), (300, 128, 10)])
def test_triton_matches_host(V, block, B):
    rng = np.random.default_rng(V)
    batch = _random_batch(rng, B, V)
    assert _triton(*batch, block=block) == _host(*batch)


@needs_triton
def test_triton_matches_host_on_the_filters_edges():
    """Ties at the top-k and top-p thresholds across blocks, min_p 1, masks, tiny temperature."""
    V = 48  # three blocks of 16
    base = np.full(V, -2.0, dtype=np.float32)
    base[[5, 30, 31, 40, 47]] = 3.0
    base[[0, 20, 33]] = 1.0
    base[[10, 12]] = -INF
    cases = [  # (temperature, top_k, top_p, min_p)
        (1.0, 2, 0.0, 0.0), (1.0, 4, 0.0, 0.0), (1.0, 6, 0.0, 0.0), (1.0, 7, 0.0, 0.0),
        (1.0, 0, 0.3, 0.0), (1.0, 0, 0.5, 0.0), (1.0, 0, 0.97, 0.0), (1.0, 6, 0.9, 0.0),
        (1.0, 0, 0.0, 1.0), (1.0, 0, 0.0, 0.5), (1e-6, 0, 0.0, 0.0), (1.0, 1, 0.0, 0.0),
        (1.0, 0, 1e-12, 0.0), (0.5, 3, 0.999, 0.01),
    ]
    rows = np.stack([base] * len(cases))
    T, K, P, M = (list(c) for c in zip(*cases))
    rows, T, K, P, M = np.concatenate([rows, rows]), T * 2, K * 2, P * 2, M * 2
    positions = list(range(100, 100 + len(cases))) + [U64] * len(cases)
    assert _triton(rows, T, K, P, M, positions, block=16) == _host(rows, T, K, P, M, positions)


@needs_triton
@settings(max_examples=12, deadline=None)
@given(batches(max_b=3, max_v=40))
def test_triton_matches_host_on_drawn_cases(batch):
    assert _triton(*batch, block=16) == _host(*batch)


@needs_triton
def test_triton_matches_torch_on_a_uniform_row_over_many_positions():
    """A flat row spreads draws over every id; each must match."""
    B, V = 24, 33
    rows = np.zeros((B, V), dtype=np.float32)
    args = ([1.0] * B, [0] * B, [0.0] * B, [0.0] * B, list(range(B)))
    got = _triton(rows, *args, block=32)
    assert got == _torch(rows, *args) == _host(rows, *args)
    assert len(set(got)) > 10


BOUNDARY_US = [0.0, 0.25, 0.5, 0.75, 0.5 + 2**-53, 1 - 2**-53]


def _boundary_batch(exp_exact: bool = True):
    """Rows whose running sums and top-p targets land exactly on boundaries: equal
    weights (target top_p * W an integer) and zero weights at u = 0. With exp_exact,
    also cases that need the path's exp to round like numpy's (the interpreter's does;
    a GPU's may not, off by an ulp)."""
    V = 40
    flat = np.zeros(V, dtype=np.float32)
    zeros_first = np.zeros(V, dtype=np.float32)
    zeros_first[:20] = -1e4  # w = 0: kept, never drawn
    rows, T, K, P, M, U = [], [], [], [], [], []
    # Two w = 1 and two w = e = exp(x), e's last two bits 0, so every sum of them is exact in
    # any order; top_p * W is then exactly 2, the mass of the ones: top-p keeps just them.
    two_levels = np.full(V, -INF, dtype=np.float32)
    two_levels[[3, 5]] = 0.0
    two_levels[[7, 9]] = -0.29999998211860657
    cases = [(flat, 0, 0.0), (flat, 0, 0.5), (flat, 0, 0.25), (flat, 10, 0.5), (flat, 20, 0.0),
             (zeros_first, 0, 0.0), (zeros_first, 0, 0.5)]
    if exp_exact:
        cases.append((two_levels, 0, 0.5744425124404038))
    for row, top_k, top_p in cases:
        for u in BOUNDARY_US:
            rows.append(row); T.append(1.0); K.append(top_k); P.append(top_p); M.append(0.0); U.append(u)
    if exp_exact:
        # min_p exactly the weight exp(float64(x) / T) of the second token: kept (>=), which
        # needs z in float64 with T in float64. Only where numpy's and torch's exp agree.
        for x in (-0.1, -0.35, -0.9, -1.7, -2.2, -3.1):
            row = np.full(V, -INF, dtype=np.float32)
            row[[4, 30]] = [0.0, x]
            z = np.float64(np.float32(x)) / 0.7
            w = float(np.exp(z))
            if w != torch.exp(torch.tensor(z, dtype=torch.float64)).item():
                continue
            rows.append(row); T.append(0.7); K.append(0); P.append(0.0); M.append(w); U.append(0.99)
    return np.stack(rows), T, K, P, M, U


def _with_uniforms(monkeypatch, us: list[float]) -> None:
    """The device paths draw with these uniforms instead of the positions' (host: sample_u)."""
    monkeypatch.setattr(ks, "uniform_torch",
                        lambda pos: torch.tensor(us, dtype=torch.float64, device=pos.device))


def test_torch_matches_host_on_exact_boundaries(monkeypatch):
    rows, T, K, P, M, U = _boundary_batch()
    want = [sample_u(rows[i], T[i], K[i], P[i], M[i], U[i]) for i in range(len(U))]
    assert want[6:12] == [0, 5, 10, 15, 10, 19]  # top_p 0.5 of 40 equal weights keeps 20
    assert set(want[42:48]) == {3, 5}
    assert want[48:] and set(want[48:]) == {30}  # u = 0.99 draws the second token, kept by min_p
    _with_uniforms(monkeypatch, U)
    assert _torch(rows, T, K, P, M, [0] * len(U)) == want


@needs_triton
def test_triton_matches_host_on_exact_boundaries(monkeypatch):
    rows, T, K, P, M, U = _boundary_batch(exp_exact=KDEV == "cpu")
    want = [sample_u(rows[i], T[i], K[i], P[i], M[i], U[i]) for i in range(len(U))]
    _with_uniforms(monkeypatch, U)
    assert _triton(rows, T, K, P, M, [0] * len(U), block=32) == want


def test_sample_triton_rejects_a_block_that_is_not_a_power_of_two():
    if ks.triton is None:
        with pytest.raises(RuntimeError, match="needs triton"):
            ks.sample_triton(torch.zeros(1, 4), [1.0], [0], [0.0], [0.0], [0])
    else:
        with pytest.raises(ValueError, match="power of two"):
            ks.sample_triton(torch.zeros(1, 4), [1.0], [0], [0.0], [0.0], [0], block=48)
