"""The reference sampler (numpy): the one algorithm behind every draw from a logits row (contract §5).

One generator on every path. The host path (executor/host_sampling.py) draws
with this module; the torch device sampler and the Triton kernel
(kernels/sampling.py, kernels/sampling_triton.py) implement the same
algorithm, so the same row, params and position give the same token on
every path.

The algorithm. Inputs: `row` (float32, length V), temperature, top_k, top_p,
min_p, position (u64). The grammar mask, logit bias and penalties have
been applied to the row before (masked tokens are -inf). The mask is
kernels/bitmask.py's to apply; mask_allowed and apply_bitmask here are its
plain form, the oracle the tests hold that against.

- u = uniform(position) (kernels/rng.py): splitmix64 of the position, top 53
  bits scaled into [0, 1). The position is the only key.
- Greedy when temperature <= 0: argmax with the LOWEST id on ties; NaN counts
  as -inf; if every entry is -inf or NaN the answer is 0.
- Otherwise z_i = float64(row_i) / float64(temperature). The candidates S are
  the ids with finite z (-inf entries are masked tokens; NaN counts as -inf;
  +inf, and a z that overflows, is not finite either). If S is empty the
  answer is the greedy argmax above.
- 0 < top_k < |S|: keep exactly the top_k best by (z desc, id asc).
- w_i = exp(z_i - z_max) over the kept set, in float64; z_max is the largest
  kept z, so w_max == 1.
- 0 < top_p < 1: order the kept ids by (w desc, id asc); running sums c_j in
  that order (float64, left to right); W = the last c; keep the shortest
  prefix whose c_j >= top_p * W.
- min_p > 0: keep the ids with w_i >= min(min_p, 1) (w_max == 1, so this is
  relative to the best, and min_p >= 1 keeps only the ties of the best; the
  clamp keeps the set non-empty).
- Draw: the kept ids in ascending id order; running sums r_j (float64, left
  to right); R = the last r; target = u * R; the token is the first id with
  r_j > target, or the last kept id if none is (rounding).

Paths that sum in another order (a parallel scan on a GPU) or whose exp
differs by an ulp can disagree only when a comparison lands within a few ulps
of a boundary, which for a random position has probability ~V * 2^-52.
"""

from __future__ import annotations

import numpy as np

from superfluid.kernels.rng import uniform


def mask_allowed(bits: np.ndarray, n_vocab: int) -> np.ndarray:
    """A grammar bitmask row as bool [n_vocab]: token t is allowed when bit
    t % 32 of word t // 32 is set (int32 [ceil(n_vocab / 32)], llguidance's layout)."""
    b = np.ascontiguousarray(bits, dtype="<i4")  # the layout is little-endian words
    if b.shape != ((n_vocab + 31) // 32,):
        raise ValueError(f"a token mask of shape {b.shape} for a vocabulary of {n_vocab}: "
                         f"expected ({(n_vocab + 31) // 32},)")
    return np.unpackbits(b.view(np.uint8), count=n_vocab, bitorder="little").view(bool)


def apply_bitmask(row: np.ndarray, bits: np.ndarray) -> None:
    """In place: every token of `row` (float32 [V]) the mask does not allow becomes -inf."""
    np.putmask(row, ~mask_allowed(bits, row.shape[-1]), np.float32(-np.inf))


def greedy(row: np.ndarray) -> int:
    """Argmax with the lowest id on ties; NaN counts as -inf; 0 when every entry is -inf or NaN."""
    x = np.asarray(row)
    nan = np.isnan(x)
    if nan.any():
        x = np.where(nan, -np.inf, x)
    return int(np.argmax(x))  # numpy's argmax returns the first maximum


def _kept(row: np.ndarray, temperature: float, top_k: int, top_p: float,
          min_p: float) -> tuple[np.ndarray, np.ndarray] | None:
    """The kept ids (ascending) and their weights w (max 1) after top-k, top-p and
    min-p; None when the draw falls back to greedy."""
    if not temperature > 0:
        return None
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf is excluded below
        z = np.asarray(row, dtype=np.float32).astype(np.float64) / float(temperature)
    ids = np.flatnonzero(np.isfinite(z))
    n = ids.size
    if n == 0:
        return None
    zs = z[ids]
    if 0 < top_k < n:
        # the k-th best value, then the ties at it by ascending id (ids are ascending)
        t = np.partition(zs, n - top_k)[n - top_k]
        gt = zs > t
        eq = zs == t
        need = top_k - int(np.count_nonzero(gt))
        keep = gt | (eq & (np.cumsum(eq) <= need))
        ids, zs = ids[keep], zs[keep]
    w = np.exp(zs - zs.max())
    if 0 < top_p < 1:
        # The running sums in (w desc, id asc) order depend only on the sorted values,
        # so sort values (fast) rather than ids (a stable argsort is ~10x slower); the
        # prefix is then every w above the value where c first reaches top_p * W, and
        # the lowest ids among the ties at it.
        sw = np.sort(w)[::-1]
        c = np.cumsum(sw)
        # c is non-decreasing and c[-1] >= top_p * c[-1], so a first hit exists
        j = int(np.argmax(c >= top_p * c[-1]))
        tau = sw[j]
        gt = w > tau
        eq = w == tau
        keep = gt | (eq & (np.cumsum(eq) <= j + 1 - int(np.count_nonzero(gt))))
        ids, w = ids[keep], w[keep]
    if min_p > 0:
        keep = w >= min(min_p, 1.0)  # w_max == 1 always stays
        ids, w = ids[keep], w[keep]
    return ids, w


def _draw(ids: np.ndarray, w: np.ndarray, u: float) -> int:
    r = np.cumsum(w)  # sequential, left to right
    hit = r > u * r[-1]
    return int(ids[np.argmax(hit)]) if hit.any() else int(ids[-1])


def sample(row: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float, position: int) -> int:
    """The token for this row, params and position (see the module docstring)."""
    return sample_u(row, temperature, top_k, top_p, min_p, uniform(position))


def sample_u(row: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float, u: float) -> int:
    """sample() with the uniform given (u in [0, 1)), for tests of the draw's boundaries."""
    kept = _kept(row, temperature, top_k, top_p, min_p)
    if kept is None:
        return greedy(row)
    return _draw(*kept, u)


def filtered_distribution(row: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 0.0,
                          min_p: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """The distribution sample() draws from: the kept ids (ascending) and their
    probabilities w / R. Greedy cases give the argmax with probability 1."""
    kept = _kept(row, temperature, top_k, top_p, min_p)
    if kept is None:
        return np.array([greedy(row)], dtype=np.int64), np.ones(1)
    ids, w = kept
    return ids.astype(np.int64), w / np.cumsum(w)[-1]  # R as the draw computes it
