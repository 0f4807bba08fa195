"""Batch-invariant linear layers.

A row of `x @ W.T` must not depend on the other rows of x. Plain CPU GEMM
breaks that: the BLAS picks kernels and tail handling by the shape, so a row
computed alone (a GEMV) or in a ragged tail differs in its last bits from
the same row in a batch. We compute y.T = W @ x.T with the tokens as the
GEMM's columns, padded to a multiple of TOKEN_TILE: every token then goes
through the same full-tile micro-kernel whatever else shares the step
(checked bitwise in tests/kernels/test_invariance.py). Weights on the left
is also the faster way round at decode batch sizes (~30% at 32 tokens).
"""

from __future__ import annotations

import torch

TOKEN_TILE = 16
# A layer wider than this (the LM head) runs as fixed slices of its outputs,
# each turned back to tokens-major while it is still in cache: one 32000-wide
# GEMM then a transpose costs ~35% more. The slices depend only on the
# layer, so a row still never depends on the other rows.
OUT_CHUNK = 2048


def pad_rows(x: torch.Tensor, tile: int = TOKEN_TILE) -> torch.Tensor:
    n = x.shape[0]
    pad = (-n) % tile
    if pad == 0:
        return x
    return torch.cat([x, x.new_zeros((pad,) + tuple(x.shape[1:]))])


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *, invariant: bool = True) -> torch.Tensor:
    """x [n, in] @ w[out, in].T (+ b), each row computed the same way
    whatever n is (invariant=False: one plain GEMM, for measuring the tax)."""
    n = x.shape[0]
    if not invariant:
        y = x @ w.T
        return (y if b is None else y + b).contiguous()
    # .contiguous(): with a transposed view as the right operand, small GEMMs can take a
    # path hundreds of times slower (seen at hidden 64); the copy is tokens x hidden.
    xt = pad_rows(x).T.contiguous()
    out = w.shape[0]
    if out <= 2 * OUT_CHUNK:
        y = (w @ xt)[:, :n].T.contiguous()
    else:
        y = x.new_empty((n, out))
        for c in range(0, out, OUT_CHUNK):
            y[:, c:c + OUT_CHUNK] = (w[c:c + OUT_CHUNK] @ xt)[:, :n].T
    if b is not None:
        y += b
    return y


def swiglu_mlp(x: torch.Tensor, gate_up: torch.Tensor, gate_up_b: torch.Tensor | None, down: torch.Tensor,
               down_b: torch.Tensor | None) -> torch.Tensor:
    """down(silu(gate) * up) of x [n, hidden], gate_up [2 * inter, hidden]
    (gate first): the same arithmetic as linear -> swiglu -> linear, kept
    features-major in between so the wide intermediate is never transposed.
    Padding columns hold junk that no real column reads."""
    from superfluid.kernels.swiglu import silu

    n = x.shape[0]
    gu = gate_up @ pad_rows(x).T.contiguous()  # [2 * inter, padded tokens]
    if gate_up_b is not None:
        gu += gate_up_b[:, None]
    inter = gu.shape[0] // 2
    y = (down @ (silu(gu[:inter]) * gu[inter:]))[:, :n].T.contiguous()
    if down_b is not None:
        y += down_b
    return y
