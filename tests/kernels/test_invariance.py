"""The building blocks of batch invariance, on the torch backend: a row of
a linear layer and of attention does not depend on the other rows."""

from __future__ import annotations

import torch

from superfluid.kernels.attention import attention_torch, build_batch
from superfluid.kernels.linear import OUT_CHUNK, linear, swiglu_mlp
from superfluid.kernels.swiglu import silu, swiglu_torch


def test_a_linear_row_is_the_same_in_any_batch_and_position():
    torch.manual_seed(0)
    w = torch.randn(384, 256)
    x = torch.randn(300, 256)
    ref = linear(x[:1], w)[0]
    for n in (1, 2, 3, 7, 8, 9, 31, 64, 100, 300):
        for p in {0, n // 2, n - 1}:
            xx = x[:n].clone()
            xx[p] = x[0]
            assert torch.equal(linear(xx, w)[p], ref), (n, p)


def test_a_wide_linear_row_is_the_same_in_any_batch_and_position():
    # Wider than 2 * OUT_CHUNK, so it runs in output slices (the LM head's path).
    torch.manual_seed(2)
    w = torch.randn(2 * OUT_CHUNK + 777, 64)
    x = torch.randn(40, 64)
    ref = linear(x[:1], w)[0]
    assert torch.allclose(ref, (x[:1] @ w.T)[0], rtol=1e-5, atol=1e-4)
    for n in (1, 2, 17, 40):
        xx = x[:n].clone()
        xx[n - 1] = x[0]
        assert torch.equal(linear(xx, w)[n - 1], ref), n


def test_the_fused_mlp_is_bitwise_the_composition():
    # swiglu_mlp skips two transposes; it must not change a bit of what it replaces.
    torch.manual_seed(3)
    for hidden, inter, bias in ((64, 128, False), (48, 80, True)):
        gu, dn = torch.randn(2 * inter, hidden) * 0.1, torch.randn(hidden, inter) * 0.1
        gb, db = (torch.randn(2 * inter), torch.randn(hidden)) if bias else (None, None)
        for n in (1, 3, 16, 17, 45):
            x = torch.randn(n, hidden)
            got = swiglu_mlp(x, gu, gb, dn, db)
            assert torch.equal(got, linear(swiglu_torch(linear(x, gu, gb)), dn, db)), (hidden, bias, n)
            ref = torch.nn.functional.linear(swiglu_torch(torch.nn.functional.linear(
                x.double(), gu.double(), None if gb is None else gb.double())), dn.double(),
                None if db is None else db.double())
            assert got.abs().max() > 0.1 and torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_plain_gemm_is_not_row_invariant():
    # Negative control: why linear() pads and puts the tokens on the columns.
    torch.manual_seed(0)
    w = torch.randn(384, 256)
    x = torch.randn(64, 256)
    ref = (x[:1] @ w.T)[0]
    assert any(not torch.equal((x[:n] @ w.T)[0], ref) for n in (2, 3, 8, 9, 17, 64))


def test_silu_is_position_independent():
    x = torch.randn(40000) * 4
    ref = silu(x)
    for n, off in ((1, 0), (7, 3), (33, 11), (1000, 5), (32769, 17)):
        assert torch.equal(silu(x[off:off + n]), ref[off:off + n])


def test_attention_rows_ignore_other_feeds():
    torch.manual_seed(1)
    page, n_kv, g, d = 16, 2, 3, 32
    blocks = 64
    k_cache = torch.randn(blocks, page, n_kv, d)
    v_cache = torch.randn(blocks, page, n_kv, d)
    lane_blocks = [5, 9, 2, 30, 31]
    q_lane = torch.randn(1, n_kv * g, d)
    alone = attention_torch(q_lane, k_cache, v_cache, build_batch([(lane_blocks, 70, 1)], page, g), 0.2)
    others = [([1, 3], 20, 4), ([7, 8, 10, 11, 12, 13, 14], 100, 1), ([40], 0, 9)]
    for at in range(len(others) + 1):
        feeds = others[:at] + [(lane_blocks, 70, 1)] + others[at:]
        n = sum(f[2] for f in feeds)
        q = torch.randn(n, n_kv * g, d)
        first = sum(f[2] for f in feeds[:at])
        q[first] = q_lane[0]
        out = attention_torch(q, k_cache, v_cache, build_batch(feeds, page, g), 0.2)
        assert torch.equal(out[first], alone[0])
