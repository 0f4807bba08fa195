"""Paged attention on the Triton kernels: close to attention_torch, and a row
bitwise the same however its token came (decoded alone, among other feeds
in any order or grouping, or anywhere in any prefill chunk).

Without a GPU the kernels run under Triton's interpreter (conftest.py turns
it on), so pools and prompts are small; the lane's token sits past the first
split boundary (256) so the combine merges two splits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from superfluid.kernels import decode_attention as da
from superfluid.kernels.attention import AttnBatch, attention_torch, build_batch
from superfluid.kernels.decode_attention import decode_attention
from superfluid.kernels.prefill_attention import prefill_attention

pytestmark = pytest.mark.skipif(da.triton is None, reason="triton is not installed")

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the interpreter
PAGE = 16
SCALE = 0.2
LANE = list(range(20, 40))  # the lane's block table: 320 cells
OTHERS = [([1, 2, 3], 20, 9), ([4, 5], 0, 5), ([6, 7, 8, 9], 50, 1), ([10, 11], 30, 1)]


def _attention(q, k_cache, v_cache, batch, scale):
    from superfluid.kernels import triton_ops  # here: without triton, importing it raises

    return triton_ops.attention(q, k_cache, v_cache, batch, scale)


def _pool(n_kv: int, head_dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (48, PAGE, n_kv, head_dim)
    return torch.randn(shape, generator=g).to(DEV), torch.randn(shape, generator=g).to(DEV)


def _queries(feeds, heads: int, head_dim: int, seed: int, lane_at: int | None = None,
             lane_q: torch.Tensor | None = None) -> torch.Tensor:
    """Random queries for the step, the lane's token (token index lane_at) set to lane_q."""
    n = sum(f[2] for f in feeds)
    q = torch.randn(n, heads, head_dim, generator=torch.Generator().manual_seed(seed))
    if lane_at is not None:
        q[lane_at] = lane_q
    return q.to(DEV)


def _batch(feeds, g: int, **kw) -> AttnBatch:
    return build_batch(feeds, PAGE, g, device=DEV, **kw)


@pytest.mark.parametrize("n_kv,g,head_dim", [(2, 1, 16), (2, 2, 24), (1, 3, 40), (1, 20, 16)])
def test_attention_matches_reference(n_kv, g, head_dim):
    k_cache, v_cache = _pool(n_kv, head_dim, seed=g)
    feeds = [(LANE, 300, 1)] + OTHERS[:3]
    q = _queries(feeds, n_kv * g, head_dim, seed=head_dim)
    batch = _batch(feeds, g)
    want = attention_torch(q, k_cache, v_cache, batch, SCALE)
    torch.testing.assert_close(_attention(q, k_cache, v_cache, batch, SCALE), want, atol=1e-4, rtol=1e-4)


def test_decode_and_prefill_launchers_match_reference():
    n_kv, g, head_dim = 2, 3, 24
    k_cache, v_cache = _pool(n_kv, head_dim)
    decode = [(LANE, 300, 1), ([6, 7, 8, 9], 50, 1), ([4], 0, 1)]
    q = _queries(decode, n_kv * g, head_dim, seed=1)
    batch = _batch(decode, g)
    want = attention_torch(q, k_cache, v_cache, batch, SCALE)
    for launch in (decode_attention, prefill_attention):
        torch.testing.assert_close(launch(q, k_cache, v_cache, batch, SCALE), want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="more than one token"):
        decode_attention(q[:3], k_cache, v_cache, _batch([(LANE, 10, 3)], g), SCALE)


@pytest.mark.parametrize("g", [1, 2, 3])
def test_a_decode_row_ignores_the_other_feeds(g):
    n_kv, head_dim = 2, 24
    k_cache, v_cache = _pool(n_kv, head_dim, seed=10 + g)
    lane = (LANE, 300, 1)
    lane_q = torch.randn(1, n_kv * g, head_dim, generator=torch.Generator().manual_seed(99))
    alone = _attention(lane_q.to(DEV), k_cache, v_cache, _batch([lane], g), SCALE)[0]
    layouts = [(OTHERS[:at] + [lane] + OTHERS[at:], {}) for at in (0, 2, len(OTHERS))]
    layouts.append((OTHERS[::-1] + [lane], dict(max_group_elems=1)))  # a group per feed
    for seed, (feeds, kw) in enumerate(layouts):
        at = feeds.index(lane)
        lane_at = sum(f[2] for f in feeds[:at])
        q = _queries(feeds, n_kv * g, head_dim, seed, lane_at, lane_q[0])
        out = _attention(q, k_cache, v_cache, _batch(feeds, g, **kw), SCALE)
        assert torch.equal(out[lane_at], alone), (g, seed)


@pytest.mark.parametrize("g", [1, 2, 3])
def test_a_row_is_the_same_in_any_prefill_chunk(g):
    # The token at 270, fed alone (the decode path) or inside chunks that start
    # and end anywhere around it (the prefill path, tiles aligned differently).
    n_kv, head_dim, at = 2, 16, 270
    k_cache, v_cache = _pool(n_kv, head_dim, seed=20 + g)
    lane_q = torch.randn(n_kv * g, head_dim, generator=torch.Generator().manual_seed(98))
    alone = _attention(lane_q[None].to(DEV), k_cache, v_cache, _batch([(LANE, at, 1)], g), SCALE)[0]
    for seed, (start, stop, others) in enumerate([(267, 275, []), (256, 271, []), (263, 290, []),
                                                  (270, 273, OTHERS[:2])]):
        feeds = others + [(LANE, start, stop - start)]
        lane_at = sum(f[2] for f in others) + at - start
        q = _queries(feeds, n_kv * g, head_dim, seed, lane_at, lane_q)
        out = _attention(q, k_cache, v_cache, _batch(feeds, g), SCALE)
        assert torch.equal(out[lane_at], alone), (g, start, stop)


def test_a_wrong_mask_is_detected():
    # Negative control: the same chunk with the lane's query positions one
    # early (its row misses its own key) gives a different row, so the
    # comparisons above would catch a mask that is off by one.
    n_kv, g, head_dim, at = 2, 2, 16, 270
    k_cache, v_cache = _pool(n_kv, head_dim, seed=5)
    feeds = [OTHERS[0], (LANE, 266, 8)]
    lane_at = OTHERS[0][2] + at - 266
    q = _queries(feeds, n_kv * g, head_dim, seed=3)
    batch = _batch(feeds, g)
    good = _attention(q, k_cache, v_cache, batch, SCALE)[lane_at]
    shifted = []
    for grp in batch.groups:
        lane_rows = (grp.q_index == lane_at).any(1, keepdim=True)
        shifted.append(dataclasses.replace(grp, row_pos=torch.where(lane_rows, grp.row_pos - 1, grp.row_pos)))
    bad = _attention(q, k_cache, v_cache, dataclasses.replace(batch, groups=shifted), SCALE)[lane_at]
    assert not torch.allclose(bad, good, atol=1e-3)
    torch.testing.assert_close(good, attention_torch(q, k_cache, v_cache, batch, SCALE)[lane_at], atol=1e-4,
                               rtol=1e-4)
