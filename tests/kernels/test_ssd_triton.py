"""The Mamba2 Triton kernels (kernels/ssd_triton.py) against the recurrence they compute.

Each kernel is checked against a per-token loop written here from the
definitions, and against kernels/ssd.py's torch references where that module
exists. Without a GPU they run under Triton's interpreter (conftest.py turns
it on), so shapes are small; the tile caps are lowered in one test so that
several position, head-dim and state tiles meet at these sizes.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from superfluid.kernels import ssd_triton as st
from superfluid.kernels.ssd_triton import causal_conv, ssd_chunk, ssm_update

pytestmark = pytest.mark.skipif(st.triton is None, reason="triton is not installed")

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the interpreter
TOL = dict(atol=1e-5, rtol=1e-5)


def _ssd_module():
    """kernels/ssd.py, the torch references, once it exists."""
    try:
        return importlib.import_module("superfluid.kernels.ssd")
    except ModuleNotFoundError as e:
        if e.name != "superfluid.kernels.ssd":
            raise
        return None


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- per-token references, straight from the definitions ---------------------------------------------


def _head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., G, S] -> [..., H, S]: head h reads group h // (H // G)."""
    return t.repeat_interleave(heads // t.shape[-2], dim=-2)


def _step(x, dt, A, B, C, h):
    """One token, out of place: x [N, H, P], dt [N, H], B, C [N, G, S], h [N, H, P, S]."""
    heads = x.shape[1]
    inject = (dt[:, :, None] * x)[..., None] * _head(B, heads)[:, :, None, :]
    h = torch.exp(dt * A)[:, :, None, None] * h + inject
    return (h * _head(C, heads)[:, :, None, :]).sum(-1), h


def _ssd_loop(x, dt, A, B, C, h0):
    h, ys = h0.clone(), []
    for t in range(x.shape[1]):
        y, h = _step(x[:, t], dt[:, t], A, B[:, t], C[:, t], h)
        ys.append(y)
    return torch.stack(ys, 1) if ys else torch.empty_like(x), h


def _conv_loop(x, state, w, b, lengths=None):
    K = w.shape[1]
    xs = torch.cat([state, x], 1)
    out = torch.empty_like(x)
    for t in range(x.shape[1]):
        acc = torch.zeros_like(x[:, 0])
        for k in range(K):
            acc = acc + w[:, k] * xs[:, t + k]
        if b is not None:
            acc = acc + b
        out[:, t] = acc / (1 + torch.exp(-acc))
    ends = [x.shape[1]] * x.shape[0] if lengths is None else lengths.tolist()
    return out, torch.stack([xs[i, e:e + K - 1] for i, e in enumerate(ends)])


# --- inputs ---------------------------------------------------------------------------------------------


def _ssd_inputs(n, L, H, P, G, S, seed, real=None):
    """The scan's inputs, rows zero-padded past real[i] tokens; a nonzero h0."""
    g = _gen(seed)
    x = torch.randn(n, L, H, P, generator=g)
    dt = torch.rand(n, L, H, generator=g) * 0.5 + 0.01  # softplus'd and clamped: positive
    A = -(torch.rand(H, generator=g) * 2 + 0.1)
    B = torch.randn(n, L, G, S, generator=g) * 0.5
    C = torch.randn(n, L, G, S, generator=g) * 0.5
    h0 = torch.randn(n, H, P, S, generator=g)
    for i, r in enumerate(real or []):
        for t in (x, dt, B, C):
            t[i, r:] = 0
    return tuple(t.to(DEV) for t in (x, dt, A, B, C, h0))


def _update_inputs(n, H, P, G, S, seed):
    g = _gen(seed)
    x = torch.randn(n, H, P, generator=g)
    dt = torch.rand(n, H, generator=g) * 0.5 + 0.01
    A = -(torch.rand(H, generator=g) * 2 + 0.1)
    B = torch.randn(n, G, S, generator=g)
    C = torch.randn(n, G, S, generator=g)
    h = torch.randn(n, H, P, S, generator=g)
    return tuple(t.to(DEV) for t in (x, dt, A, B, C, h))


def _conv_inputs(n, L, D, K, seed, bias=True):
    g = _gen(seed)
    x = torch.randn(n, L, D, generator=g)
    state = torch.randn(n, K - 1, D, generator=g)
    w = torch.randn(D, K, generator=g) * 0.5
    b = torch.randn(D, generator=g) if bias else None
    return x.to(DEV), state.to(DEV), w.to(DEV), None if b is None else b.to(DEV)


# --- ssd_chunk ------------------------------------------------------------------------------------------

SSD_SHAPES = [  # n, L, H, P, G, S, real tokens per row (None: all)
    (1, 16, 4, 8, 1, 8, None),
    (3, 13, 4, 8, 2, 8, [13, 9, 1]),
    (2, 7, 2, 5, 2, 3, [4, 0]),  # odd sizes; a row of padding only
]


@pytest.mark.parametrize("n,L,H,P,G,S,real", SSD_SHAPES)
def test_ssd_chunk_matches_the_recurrence(n, L, H, P, G, S, real):
    args = _ssd_inputs(n, L, H, P, G, S, seed=n * 100 + L, real=real)
    y, h_end = ssd_chunk(*args)
    want_y, want_h = _ssd_loop(*args)
    torch.testing.assert_close(y, want_y, **TOL)
    torch.testing.assert_close(h_end, want_h, **TOL)
    for i, r in enumerate(real or []):
        assert not y[i, r:].any(), "padded positions of y must be 0"
        # h_end is the state after the row's last real token.
        x, dt, A, B, C, h0 = args
        _, h_real = _ssd_loop(x[i:i + 1, :r], dt[i:i + 1, :r], A, B[i:i + 1, :r], C[i:i + 1, :r], h0[i:i + 1])
        torch.testing.assert_close(h_end[i:i + 1], h_real, **TOL)
    ref = _ssd_module()
    if ref is not None:
        ref_y, ref_h = ref.ssd_chunk(*(t.clone() for t in args))
        torch.testing.assert_close(y, ref_y, **TOL)
        torch.testing.assert_close(h_end, ref_h, **TOL)


def test_ssd_chunk_across_tiles(monkeypatch):
    # 16-wide tiles: 3 position tiles (the causal walk and the cumsum's carry cross tiles),
    # 2 head-dim blocks and 2 state blocks.
    monkeypatch.setattr(st, "_MAX_BLOCK_L", 16)
    monkeypatch.setattr(st, "_MAX_BLOCK_P", 16)
    monkeypatch.setattr(st, "_MAX_BLOCK_S", 16)
    args = _ssd_inputs(1, 40, 2, 20, 1, 20, seed=5, real=[37])
    y, h_end = ssd_chunk(*args)
    want_y, want_h = _ssd_loop(*args)
    torch.testing.assert_close(y, want_y, **TOL)
    torch.testing.assert_close(h_end, want_h, **TOL)


def test_ssd_chunk_rows_are_independent_of_the_batch():
    args = _ssd_inputs(3, 11, 4, 6, 2, 5, seed=9, real=[11, 6, 3])
    y, h_end = ssd_chunk(*args)
    for i in range(3):
        x, dt, A, B, C, h0 = (t if t.dim() == 1 else t[i:i + 1] for t in args)
        yi, hi = ssd_chunk(x, dt, A, B, C, h0)
        assert torch.equal(yi[0], y[i]) and torch.equal(hi[0], h_end[i]), f"row {i} differs alone"


def test_ssd_chunk_empty_chunk_keeps_the_state():
    x, dt, A, B, C, h0 = _ssd_inputs(2, 3, 2, 4, 1, 4, seed=2)
    y, h_end = ssd_chunk(x[:, :0], dt[:, :0], A, B[:, :0], C[:, :0], h0)
    assert y.shape == (2, 0, 2, 4) and torch.equal(h_end, h0)


def test_ssd_chunk_negative_controls():
    # The check above can tell a wrong decay, a shifted B or a wrong head-to-group map.
    x, dt, A, B, C, h0 = _ssd_inputs(2, 9, 4, 4, 2, 4, seed=3)
    y, h_end = ssd_chunk(x, dt, A, B, C, h0)
    wrong = [
        _ssd_loop(x, dt, A * 1.1, B, C, h0),
        _ssd_loop(x, dt, A, torch.roll(B, 1, dims=1), C, h0),
        _ssd_loop(x, dt, A, B.flip(2), C.flip(2), h0),  # head h on group 1 - h // 2
        _ssd_loop(x, dt, A, B, C, torch.zeros_like(h0)),
    ]
    for want_y, _want_h in wrong:
        assert not torch.allclose(y, want_y, **TOL)
    assert not torch.allclose(h_end, wrong[0][1], **TOL)


def test_ssd_chunk_rejects_bad_shapes():
    x, dt, A, B, C, h0 = _ssd_inputs(1, 4, 4, 4, 2, 4, seed=4)
    with pytest.raises(ValueError, match="h0"):
        ssd_chunk(x, dt, A, B, C, h0[:, :3])
    with pytest.raises(ValueError, match="groups"):
        ssd_chunk(x[:, :, :3], dt[:, :, :3], A[:3], B, C, h0[:, :3])


# --- ssm_update -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,H,P,G,S", [(1, 4, 8, 1, 8), (3, 4, 8, 2, 8), (2, 2, 5, 2, 3)])
def test_ssm_update_matches_the_recurrence_in_place(n, H, P, G, S):
    x, dt, A, B, C, h = _update_inputs(n, H, P, G, S, seed=n * 10 + S)
    want_y, want_h = _step(x, dt, A, B, C, h)
    storage = h.data_ptr()
    y = ssm_update(x, dt, A, B, C, h)
    assert h.data_ptr() == storage
    torch.testing.assert_close(h, want_h, **TOL)
    torch.testing.assert_close(y, want_y, **TOL)
    ref = _ssd_module()
    if ref is not None:
        x2, dt2, A2, B2, C2, h2 = _update_inputs(n, H, P, G, S, seed=n * 10 + S)
        ref_y = ref.ssm_update(x2, dt2, A2, B2, C2, h2)
        torch.testing.assert_close(y, ref_y, **TOL)
        torch.testing.assert_close(h, h2, **TOL)


def test_ssm_update_writes_a_strided_state_where_it_lives():
    # The state as a slice of a wider pool: only its own entries change.
    x, dt, A, B, C, h = _update_inputs(2, 2, 4, 1, 4, seed=8)
    pool = torch.randn(3, 2, 4, 7, generator=_gen(1)).to(DEV)
    pool[:2, :, :, :4] = h
    before = pool.clone()
    view = pool[:2, :, :, :4]
    assert not view.is_contiguous()
    want_y, want_h = _step(x, dt, A, B, C, h)
    y = ssm_update(x, dt, A, B, C, view)
    torch.testing.assert_close(y, want_y, **TOL)
    torch.testing.assert_close(pool[:2, :, :, :4], want_h, **TOL)
    assert torch.equal(pool[:2, :, :, 4:], before[:2, :, :, 4:]) and torch.equal(pool[2], before[2])


def test_ssm_update_token_by_token_equals_the_chunk():
    x, dt, A, B, C, h0 = _ssd_inputs(2, 6, 4, 4, 2, 4, seed=6)
    y, h_end = ssd_chunk(x, dt, A, B, C, h0)
    h = h0.clone()
    ys = [ssm_update(x[:, t], dt[:, t], A, B[:, t], C[:, t], h) for t in range(6)]
    torch.testing.assert_close(torch.stack(ys, 1), y, **TOL)
    torch.testing.assert_close(h, h_end, **TOL)


def test_ssm_update_rows_are_independent_of_the_batch():
    x, dt, A, B, C, h = _update_inputs(3, 4, 6, 2, 5, seed=7)
    hb = h.clone()
    y = ssm_update(x, dt, A, B, C, hb)
    for i in range(3):
        hi = h[i:i + 1].clone()
        yi = ssm_update(x[i:i + 1], dt[i:i + 1], A, B[i:i + 1], C[i:i + 1], hi)
        assert torch.equal(yi[0], y[i]) and torch.equal(hi[0], hb[i]), f"row {i} differs alone"


def test_ssm_update_negative_control():
    x, dt, A, B, C, h = _update_inputs(2, 4, 4, 2, 4, seed=11)
    for wrong in (_step(x, dt, A * 1.1, B, C, h), _step(x, dt, A, B.flip(1), C.flip(1), h)):
        y = ssm_update(x, dt, A, B, C, h.clone())
        assert not torch.allclose(y, wrong[0], **TOL)


# --- causal_conv ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,L,D,bias", [(1, 7, 24, True), (3, 2, 24, True), (2, 1, 5, False),
                                        (2, 0, 8, True)])
def test_causal_conv_matches_the_definition(n, L, D, bias):
    # L < K - 1 too: part of the new state is the old one.
    x, state, w, b = _conv_inputs(n, L, D, 4, seed=n * 10 + L, bias=bias)
    out, new_state = causal_conv(x, state, w, b)
    want_out, want_state = _conv_loop(x, state, w, b)
    torch.testing.assert_close(out, want_out, **TOL)
    assert torch.equal(new_state, want_state)
    ref = _ssd_module()
    if ref is not None:
        ref_out, ref_state = ref.causal_conv(x.clone(), state.clone(), w, b)
        torch.testing.assert_close(out, ref_out, **TOL)
        assert torch.equal(new_state, ref_state)


def test_causal_conv_state_after_each_rows_length():
    # A ragged batch zero-padded to L: row i's state is the K-1 inputs before x[i, lengths[i]].
    x, state, w, b = _conv_inputs(4, 5, 12, 4, seed=21)
    lengths = torch.tensor([5, 3, 1, 0], device=DEV)
    out, new_state = causal_conv(x, state, w, b, lengths)
    want_out, want_state = _conv_loop(x, state, w, b, lengths)
    torch.testing.assert_close(out, want_out, **TOL)
    assert torch.equal(new_state, want_state)
    ref = _ssd_module()
    if ref is not None:
        assert torch.equal(new_state, ref.causal_conv(x, state, w, b, lengths)[1])


def test_causal_conv_across_tiles_and_in_pieces(monkeypatch):
    # 16-position tiles, 16-channel blocks; and a sequence run in two pieces, the state
    # carried, gives the same rows bitwise.
    monkeypatch.setattr(st, "_MAX_BLOCK_L", 16)
    monkeypatch.setattr(st, "_MAX_BLOCK_D", 16)
    x, state, w, b = _conv_inputs(2, 21, 20, 4, seed=3)
    out, new_state = causal_conv(x, state, w, b)
    want_out, want_state = _conv_loop(x, state, w, b)
    torch.testing.assert_close(out, want_out, **TOL)
    assert torch.equal(new_state, want_state)
    a, mid = causal_conv(x[:, :9].contiguous(), state, w, b)
    c, end = causal_conv(x[:, 9:].contiguous(), mid, w, b)
    assert torch.equal(torch.cat([a, c], 1), out) and torch.equal(end, new_state)


def test_causal_conv_rows_are_independent_of_the_batch():
    x, state, w, b = _conv_inputs(3, 6, 24, 4, seed=12)
    out, new_state = causal_conv(x, state, w, b)
    for i in range(3):
        oi, si = causal_conv(x[i:i + 1], state[i:i + 1], w, b)
        assert torch.equal(oi[0], out[i]) and torch.equal(si[0], new_state[i]), f"row {i} differs alone"


def test_causal_conv_negative_control():
    x, state, w, b = _conv_inputs(2, 6, 8, 4, seed=13)
    out, _ = causal_conv(x, state, w, b)
    for wrong in (_conv_loop(x, state, w.flip(1), b), _conv_loop(x, torch.zeros_like(state), w, b)):
        assert not torch.allclose(out, wrong[0], **TOL)
