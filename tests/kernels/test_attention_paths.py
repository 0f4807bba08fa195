"""Attention (kernels/sf_attn.c, sf_attn512.c) gives the same bits on every
ISA path: AVX-512 runs blocks of queries (tokens of one feed x the query
heads of a KV head) over each key once, AVX2 one query at a time, scalar one
lane at a time, all the same chains. A path the CPU lacks skips, naming it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from superfluid.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the CPU kernels are not built")

BEST = cpu.ISA_LEVELS.get(cpu.best_isa(), 0)
PATHS = [p for p in ("scalar", "avx2", "avx512") if cpu.ISA_LEVELS[p] <= BEST]


def need_avx512() -> None:
    if cpu.ISA_LEVELS["avx512"] > BEST:
        pytest.skip("this CPU lacks avx512f/dq/bw/vl (cpuid): the avx512 attention path cannot run here")


def attend(path, q, k, v, feeds, pools, cos, sin, norms=(None, None)):
    n, nh, d = q.shape
    kp, vp = pools[0].clone(), pools[1].clone()
    qkv = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], 1)
    cpu.force_isa(path)
    try:
        out = cpu.attention(qkv, cpu.step_layout(feeds, kp.shape[2]), kp, vp, n_heads=nh, n_kv=k.shape[1],
                            head_dim=d, cos=cos, sin=sin, q_norm=norms[0], k_norm=norms[1], eps=1e-6,
                            scale=d ** -0.5)
    finally:
        cpu.force_isa(None)
    return out.view(n, nh, d), kp, vp


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t.contiguous().view(torch.int16)


def case(seed, dtype, nkv, g, d, page, lens, starts):
    """Feeds of `lens` new tokens after `starts` cached ones, their own pages."""
    gen = torch.Generator().manual_seed(seed)
    feeds, at = [], 0
    for n_new, start in zip(lens, starts):
        pages = (start + n_new + page - 1) // page
        feeds.append((list(range(at, at + pages)), start, n_new))
        at += pages
    n = sum(lens)
    pools = (torch.randn(nkv, at + 1, page, d, generator=gen).to(dtype),
             torch.randn(nkv, at + 1, page, d, generator=gen).to(dtype))
    q = torch.randn(n, nkv * g, d, generator=gen)
    k, v = torch.randn(n, nkv, d, generator=gen), torch.randn(n, nkv, d, generator=gen)
    return (q, k, v, feeds, pools, *rope(d, 512))


def rope(d: int, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.arange(float(positions))[:, None] * 0.02 * torch.arange(1., d // 2 + 1)
    return torch.cos(ang), torch.sin(ang)


def assert_paths_agree(q, k, v, feeds, pools, cos, sin, norms=(None, None)):
    ref = attend("scalar", q, k, v, feeds, pools, cos, sin, norms)
    for path in PATHS[1:]:
        got = attend(path, q, k, v, feeds, pools, cos, sin, norms)
        for name, a, b in zip(("out", "k pool", "v pool"), got, ref):
            assert torch.equal(bits(a), bits(b)), (path, name, (a.float() - b.float()).abs().max().item())
    return ref[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nkv,g", [(2, 1), (2, 2), (1, 3), (2, 4), (1, 5), (1, 8), (1, 12)])
@pytest.mark.parametrize("d", [8, 24, 64, 80, 128])
def test_every_path_gives_the_scalar_paths_bits(dtype, nkv, g, d):
    # prefills of 1..13 tokens (blocks of 8 / g tokens and their tails), after cached tokens, and decodes
    lens, starts = [13, 1, 4, 5, 1, 9], [0, 37, 3, 0, 120, 17]
    for page in (1, 5, 16):
        assert_paths_agree(*case(d + g + page, dtype, nkv, g, d, page, lens, starts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_and_rope_give_the_same_bits_on_every_path(dtype):
    q, k, v, feeds, pools, cos, sin = case(7, dtype, 2, 2, 72, 4, [6, 1, 3], [0, 30, 5])
    norms = (torch.rand(72) + 0.5, torch.rand(72) + 0.5)
    assert_paths_agree(q, k, v, feeds, pools, cos, sin, norms)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), g=st.sampled_from([1, 2, 3, 4, 8]), d=st.sampled_from([16, 32, 48]),
       page=st.integers(1, 9), feeds=st.lists(st.tuples(st.integers(1, 11), st.integers(0, 40)), min_size=1,
                                             max_size=5), bf16=st.booleans())
def test_random_steps_give_the_same_bits_on_every_path(seed, g, d, page, feeds, bf16):
    lens, starts = [f[0] for f in feeds], [f[1] for f in feeds]
    assert_paths_agree(*case(seed, torch.bfloat16 if bf16 else torch.float32, 2, g, d, page, lens, starts))


@pytest.mark.parametrize("path", ["avx2", "avx512"])
def test_a_later_tokens_key_and_value_never_reach_an_earlier_row(path):
    # a block's queries share key reads: the ones past a query's position must not enter its chains
    if cpu.ISA_LEVELS[path] > BEST:
        pytest.skip(f"this CPU lacks the {path} path (cpuid)")
    q, k, v, feeds, pools, cos, sin = case(11, torch.float32, 1, 2, 64, 16, [8], [0])
    base = attend(path, q, k, v, feeds, pools, cos, sin)[0]
    k2, v2 = k.clone(), v.clone()
    k2[5:], v2[5:] = float("nan"), float("inf")
    got = attend(path, q, k2, v2, feeds, pools, cos, sin)[0]
    assert torch.equal(bits(got[:5]), bits(base[:5]))
    assert got[5:].isnan().all()  # the control: those rows do read them


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nkv,g,d", [(2, 6, 40), (1, 7, 256), (1, 16, 64), (8, 1, 128)])
def test_long_contexts_big_heads_and_wide_groups_on_every_path_and_thread_count(dtype, nkv, g, d):
    # contexts past 2000 keys, prefills split over tasks, a decode batch; 1, 2 and 7 threads
    args = case(d + g, dtype, nkv, g, d, 16, [37, 1, 1, 1, 23, 3, 1, 1], [0, 1500, 2001, 63, 777, 1, 900, 5])
    args = (*args[:5], *rope(d, 2100))
    for t in (1, 2, 7):
        cpu.set_threads(t)
        try:
            assert_paths_agree(*args)
        finally:
            cpu.set_threads(None)


def test_a_nan_key_and_an_inf_value_give_the_same_bits_on_every_path():
    q, k, v, feeds, pools, cos, sin = case(12, torch.bfloat16, 2, 4, 32, 8, [5, 1], [3, 20])
    pools[1][0, 0, 2, 0] = float("inf")  # the first feed's cached position 2, KV head 0: a value
    pools[0][1, 1, 4, 7] = float("nan")  # the second feed's cached position 4, KV head 1: a key
    out = assert_paths_agree(q, k, v, feeds, pools, cos, sin)
    assert out[:5, :4, 0].isinf().all() and out[:5, :4, 1:].isfinite().all()  # the value reached every row
    assert out[5, 4:].isfinite().all()  # a NaN score's exp is 0 on every path (sf_internal.h's exp)
