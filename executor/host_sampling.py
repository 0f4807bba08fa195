"""The host path of sampling (contract §5): a lane's row treated and drawn on the host, numpy only.

A lane's row is treated in this order: grammar mask → logit bias → penalties over the
last PENALTY_WINDOW committed tokens (repeat, presence, frequency; EOS and special
tokens exempt) → [logprobs are taken here] → temperature → top-k → top-p → min-p →
draw. Everything from temperature on is the reference sampler's: `pick` hands the treated
row to kernels.reference_sampler.greedy / sample, the same counter-based generator as the
engine's device sampler, so a lane picked here and a lane picked in the engine get
the same token for the same row, params and position.

`pick` never writes into the caller's row: it copies it once, and only when a
grammar, a bias or a penalty will change it. apply_logit_bias and apply_penalties
work in place (that is their job); pick calls them on its copy.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias, runtime_checkable

import numpy as np

from superfluid.abi import MAX_TOP_LOGPROBS, Sampling
from superfluid.kernels import reference_sampler as reference
from superfluid.kernels.bitmask import apply_bitmask_row

PENALTY_WINDOW = 64
"""Penalties look at this many of the lane's most recent committed tokens."""

Bias: TypeAlias = Mapping[int, float] | tuple[np.ndarray, np.ndarray]
"""A logit bias: token id -> added value, or (ids, values) arrays (see as_bias_arrays)."""

Exempt: TypeAlias = Collection[int] | np.ndarray
"""Token ids penalties never touch (EOS and specials): a (frozen)set or an id array."""


@runtime_checkable
class GrammarMask(Protocol):
    """The grammar hook: mask(row) sets every disallowed logit to -inf in place.

    It may raise (a grammar overflow, say); pick lets the exception through, with the
    caller's row untouched, and the caller faults the lane."""

    def mask(self, row: np.ndarray) -> None: ...


class SamplingParamsLike(Protocol):
    """What pick reads of SamplingParams (abi.records.SamplingParams fits)."""

    # Read-only members: a frozen record fits.
    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...
    @property
    def min_p(self) -> float: ...
    @property
    def repeat_penalty(self) -> float: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def freq_penalty(self) -> float: ...


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A LaneLogprob's content: the chosen token and its logprob, and the most likely
    other tokens (most likely first, ties by lower id). Values are float32's, as the ABI
    stores them; masked or banned tokens (logprob -inf) are never listed as alternatives."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


# ------------------------------------------------------------------ penalties


def penalizes(params: SamplingParamsLike) -> bool:
    """Whether any penalty is on (repeat_penalty 0 or 1 is off; presence/freq 0 is off)."""
    r = params.repeat_penalty
    return (r != 0 and r != 1) or params.presence_penalty != 0 or params.freq_penalty != 0


def _penalty_targets(n_vocab: int, history: Sequence[int] | np.ndarray, exempt: Exempt
                     ) -> tuple[np.ndarray, np.ndarray] | None:
    """The distinct penalized ids of the window (ascending) and their counts; None if none."""
    tail = history[-PENALTY_WINDOW:] if len(history) > PENALTY_WINDOW else history
    if len(tail) == 0:
        return None
    ids, counts = np.unique(np.asarray(tail, dtype=np.int64), return_counts=True)
    keep = (ids >= 0) & (ids < n_vocab)
    if len(exempt):
        if isinstance(exempt, (set, frozenset)):
            # at most 64 ids: set membership beats building an array of every special each call
            keep &= np.fromiter((int(t) not in exempt for t in ids), dtype=bool, count=ids.size)
        else:
            keep &= ~np.isin(ids, np.asarray(exempt, dtype=np.int64))
    if not keep.any():
        return None
    return ids[keep], counts[keep]


def _apply_targets(row: np.ndarray, ids: np.ndarray, counts: np.ndarray, params: SamplingParamsLike) -> None:
    # float32 arithmetic throughout, as on the row itself (and as llama.cpp does it)
    x = row[ids]
    r = params.repeat_penalty
    if r != 0 and r != 1:
        r32 = np.float32(r)
        x = np.where(x > 0, x / r32, x * r32)  # -inf stays -inf (r > 0)
    pres, freq = params.presence_penalty, params.freq_penalty
    if pres != 0 or freq != 0:
        # one subtraction of count * freq + presence, llama.cpp's grouping
        with np.errstate(over="ignore", invalid="ignore"):  # huge penalties saturate to ±inf
            x = x - (counts.astype(np.float32) * np.float32(freq) + np.float32(pres))
    row[ids] = x


def apply_penalties(row: np.ndarray, history: Sequence[int] | np.ndarray, params: SamplingParamsLike,
                    exempt: Exempt = frozenset()) -> None:
    """Penalize, in place, the tokens of the last PENALTY_WINDOW entries of `history` (the
    lane's committed tokens, oldest first), except those in `exempt`. For each distinct
    token with count c in the window: repeat penalty r (if on) maps logit > 0 to logit / r
    and otherwise to logit * r; then count * freq_penalty + presence_penalty is subtracted.
    Ids outside the row are ignored. `row` must be a writable float32 array."""
    if not penalizes(params):
        return
    t = _penalty_targets(row.shape[-1], history, exempt)
    if t is not None:
        _apply_targets(row, *t, params)


# ---------------------------------------------------------------- logit bias


def as_bias_arrays(bias: Bias) -> tuple[np.ndarray, np.ndarray]:
    """A bias as (ids int64, values float32) arrays: convert once, at registration, so the
    per-round apply_logit_bias has no Python loop."""
    if isinstance(bias, Mapping):
        ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
        with np.errstate(over="ignore"):  # a huge value becomes ±inf, like any float32 cast
            vals = np.fromiter(bias.values(), dtype=np.float64, count=len(bias)).astype(np.float32)
        return ids, vals
    ids, vals = bias
    with np.errstate(over="ignore"):
        return np.asarray(ids, dtype=np.int64), np.asarray(vals, dtype=np.float32)


def _bias_len(bias: Bias | None) -> int:
    if bias is None:
        return 0
    return len(bias) if isinstance(bias, Mapping) else len(bias[0])


def apply_logit_bias(row: np.ndarray, bias: Bias) -> None:
    """Add the bias to `row` in place (float32). Ids outside the row are ignored (they were
    checked at registration); an id given twice in the array form adds twice. A -inf
    value bans the token."""
    ids, vals = as_bias_arrays(bias)
    inside = (ids >= 0) & (ids < row.shape[-1])
    if not inside.all():
        ids, vals = ids[inside], vals[inside]
    with np.errstate(invalid="ignore"):  # +inf logit + -inf bias is NaN, which ranks as -inf
        np.add.at(row, ids, vals)


# ------------------------------------------------------------------ logprobs


def _nan_free(row: np.ndarray) -> np.ndarray:
    """The row with NaN as -inf (the samplers' rule); the row itself when it has none."""
    nan = np.isnan(row)
    return np.where(nan, np.float32(-np.inf), row) if nan.any() else row


def _log_normalizer(x: np.ndarray) -> tuple[float, float]:
    """(m, log(sum(exp(x - m)))) of a NaN-free float32 row, in float64, with m = max(x);
    a logprob is then (x_i - m) - that, which keeps its precision near 0 (m + log(...)
    first would cancel). An infinite m comes back with 0 and _logprobs treats it."""
    m = float(x.max())
    if not math.isfinite(m):
        return m, 0.0
    e = x.astype(np.float64)
    e -= m
    np.exp(e, out=e)
    return m, math.log(float(e.sum()))


def _logprobs(v: np.ndarray, m: float, log_s: float, x: np.ndarray) -> np.ndarray:
    """float64 logprobs of the logits v of the row x, given _log_normalizer(x)."""
    v = np.asarray(v, dtype=np.float64)
    if m == -math.inf:
        return np.full(v.shape, -np.inf)  # every token masked
    if m == math.inf:
        n_inf = int(np.count_nonzero(x == np.inf))  # the +inf logits share all the mass
        return np.where(v == np.inf, 0.0 - math.log(n_inf), -np.inf)  # 0.0 - : no -0.0
    return (v - m) - log_s


def log_softmax(row: np.ndarray) -> np.ndarray:
    """The row's log-softmax in float64 (NaN counts as -inf): the values pick's logprobs
    are rounded from."""
    x = _nan_free(np.asarray(row, dtype=np.float32))
    return _logprobs(x, *_log_normalizer(x), x)


def _top_ids(x: np.ndarray, k: int) -> np.ndarray:
    """The k best finite-or-+inf ids of NaN-free x by (value desc, id asc), without a full sort."""
    n = x.shape[0]
    k = min(k, n)
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    t = x[np.argpartition(x, n - k)[n - k]]  # the k-th largest value
    gt = np.flatnonzero(x > t)
    if t == -np.inf:
        cand = gt  # -inf entries are masked tokens, never alternatives
    else:
        # flatnonzero is ascending, so the first ties are the lowest ids
        cand = np.concatenate([gt, np.flatnonzero(x == t)[: k - gt.size]])
    return cand[np.lexsort((cand, -x[cand]))]  # at most k ids: (value desc, id asc)


def token_logprob(row: np.ndarray, token: int, n: int) -> TokenLogprob:
    """The logprob record for `token` of the treated `row`: its logprob and the n - 1 most
    likely other tokens (n is capped at MAX_TOP_LOGPROBS)."""
    x = _nan_free(np.asarray(row, dtype=np.float32))
    m, log_s = _log_normalizer(x)
    n = min(n, MAX_TOP_LOGPROBS)
    alt = np.zeros(0, dtype=np.int64)
    if n > 1:
        alt = _top_ids(x, n)  # the n best: the chosen token may be one of them
        alt = alt[alt != token][: n - 1]
    lps = _logprobs(x[np.append(alt, token)], m, log_s, x).astype(np.float32)  # stored as float32
    chosen, lps = lps[-1], lps[:-1]
    live = lps > -np.inf  # a token with no mass (masked, banned, or beside a +inf) is no alternative
    return TokenLogprob(int(token), float(chosen), tuple(alt[live].tolist()), tuple(lps[live].tolist()))


# ---------------------------------------------------------------------- pick


def pick(row: np.ndarray, sampling_mode: int, params: SamplingParamsLike, position: int, *,
         bias: Bias | None = None, history: Sequence[int] | np.ndarray = (), exempt: Exempt = frozenset(),
         grammar: GrammarMask | None = None, mask: np.ndarray | None = None,
         want_logprobs: int = 0) -> tuple[int, TokenLogprob | None]:
    """Pick a lane's token from its logits row (contract §5) and, when want_logprobs = n > 0,
    its logprob record (chosen token + n - 1 alternatives, from the row after bias and
    penalties, before temperature). Greedy when sampling_mode is GPU_GREEDY or
    temperature <= 0; otherwise the engine's counter-based draw at `position`.
    mask: a grammar bitmask row (int32 [ceil(V/32)], grammar.GrammarRegistry.fill's),
    applied first, as the engine applies engine.runtime.TokenMasks. The caller's row
    is never written."""
    x = np.asarray(row, dtype=np.float32)
    # a list, or a row of another dtype, was converted into a fresh array we may write
    owned = not (isinstance(row, np.ndarray) and np.may_share_memory(x, row))

    def writable() -> np.ndarray:
        nonlocal x, owned
        if not owned:
            x, owned = x.copy(), True
        return x

    if mask is not None:
        apply_bitmask_row(writable(), mask)
    if grammar is not None:
        grammar.mask(writable())
    if bias is not None and _bias_len(bias):
        apply_logit_bias(writable(), bias)
    if penalizes(params):
        t = _penalty_targets(x.shape[-1], history, exempt)
        if t is not None:
            _apply_targets(writable(), *t, params)

    temperature = float(params.temperature)
    if sampling_mode == Sampling.GPU_GREEDY or not temperature > 0:
        token = reference.greedy(x)
    else:
        token = reference.sample(x, temperature, int(params.top_k), float(params.top_p),
                                       float(params.min_p), position)
    return token, (token_logprob(x, token, want_logprobs) if want_logprobs > 0 else None)
