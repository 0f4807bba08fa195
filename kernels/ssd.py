"""Mamba2's sequence mixing as torch reference kernels (fp32), batch-invariant on CPU.

Three ops, each over N independent rows (sequences or chunks of sequences):

- ssd_chunk: one chunk of the SSD scan from an initial state (a prefill).
- ssm_update: one token of the recurrence, the state updated in place (a decode).
- causal_conv: the depthwise causal conv over x with a carried left context.

A row's result never depends on the other rows nor on how many there are:
ssd_chunk runs each row as its own fixed-shape matmuls (a BLAS picks its
kernel, and so its summation order, by the shape, so a batched matmul of N
rows could round row i differently for another N); the other two are
elementwise ops and fixed-order sums only. SiLU is x / (1 + exp(-x)) for the
reason kernels/swiglu.silu gives. kernels/ssd_triton.py implements the same
signatures for the GPU and is tested against these.
"""

from __future__ import annotations

import math

import torch

__all__ = ["causal_conv", "silu", "ssd_chunk", "ssm_update"]


def silu(x: torch.Tensor) -> torch.Tensor:
    # Not F.silu: its CPU kernel rounds a vector body and a scalar tail differently.
    return x / (1 + torch.exp(-x))


def _per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., G, S] -> [..., H, S]: head h reads group h // (H // G)."""
    g = t.shape[-2]
    if g == heads:
        return t
    lead, s = t.shape[:-2], t.shape[-1]
    return t.unsqueeze(-2).expand(*lead, g, heads // g, s).reshape(*lead, heads, s)


def ssd_chunk(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of the SSD scan for each of N rows.

    x [N, L, H, P], dt [N, L, H] (softplus'd and clamped), A [H] (negative),
    B, C [N, L, G, S], h0 [N, H, P, S]. Positions past a row's real tokens are
    zero (x = dt = B = C = 0): they leave the state as it is and their y is 0.
    Returns y [N, L, H, P] (without the D skip) and the state after the
    chunk, h_end [N, H, P, S].

    Within the chunk the scan is a masked "attention" over log-decays
    accumulated from the chunk start; the initial state enters decayed to
    each position."""
    n, L, H, P = x.shape
    S = B.shape[-1]
    y = x.new_empty((n, L, H, P))
    h_end = x.new_empty((n, H, P, S))
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    for i in range(n):  # one row at a time: every matmul below has the same shape for any N
        dti = dt[i]                                                  # [L, H]
        xdt = (x[i] * dti[..., None]).transpose(0, 1)                # [H, L, P]
        acs = torch.cumsum(dti * A, dim=0).T.contiguous()            # [H, L] log-decay from the chunk start
        Bh = _per_head(B[i], H).transpose(0, 1)                      # [H, L, S]
        Ch = _per_head(C[i], H).transpose(0, 1)                      # [H, L, S]
        # decay[h, l, s] = exp(acs[l] - acs[s]) for s <= l; masked before exp, so no inf * 0.
        seg = (acs[:, :, None] - acs[:, None, :]).masked_fill(~causal, -math.inf)
        scores = torch.bmm(Ch, Bh.transpose(1, 2)) * torch.exp(seg)  # [H, L, L]
        yi = torch.bmm(scores, xdt)                                  # intra-chunk
        yi += torch.bmm(Ch, h0[i].transpose(1, 2)) * torch.exp(acs)[..., None]  # the carried state
        y[i] = yi.transpose(0, 1)
        total = acs[:, -1:]                                          # [H, 1]
        to_end = torch.exp(total - acs)                              # [H, L]
        gain = torch.bmm((xdt * to_end[..., None]).transpose(1, 2), Bh)  # [H, P, S]: the chunk's own input
        h_end[i] = torch.exp(total)[..., None] * h0[i] + gain
    return y, h_end


def ssm_update(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               h: torch.Tensor) -> torch.Tensor:
    """One token of the recurrence for each of N rows; h updated in place.

    x [N, H, P], dt [N, H] (softplus'd), A [H], B, C [N, G, S], h [N, H, P, S].
    h = exp(dt*A) h + (dt x) B; returns y = h . C over S, [N, H, P] (no D skip)."""
    H = x.shape[1]
    Bh, Ch = _per_head(B, H), _per_head(C, H)                        # [N, H, S]
    h.mul_(torch.exp(dt * A)[..., None, None])
    h.add_((dt[..., None] * x)[..., None] * Bh[:, :, None, :])
    # A sum over the contiguous last dim: each output reduced in an order fixed by S alone.
    return (h * Ch[:, :, None, :]).sum(-1)


def causal_conv(x: torch.Tensor, state: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU for each of N rows.

    x [N, L, D] inputs (zero past a row's real tokens is fine), state
    [N, K-1, D] the K-1 inputs before x, w [D, K], b [D] or None.
    Returns SiLU(conv) [N, L, D] and the K-1 inputs before position
    lengths[i] of x (default L: the last K-1 of cat(state, x)), [N, K-1, D].
    The taps are summed in order k = 0..K-1, then the bias is added."""
    n, L, D = x.shape
    K = w.shape[1]
    full = torch.cat([state, x], dim=1)                              # [N, K-1+L, D]
    acc = full[:, 0:L] * w[:, 0]
    for k in range(1, K):
        acc = acc + full[:, k:k + L] * w[:, k]
    if b is not None:
        acc = acc + b
    if lengths is None:
        new_state = full[:, L:].clone()
    else:
        # Row i's state after lengths[i] real tokens: full[i, lengths[i] : lengths[i] + K-1].
        idx = lengths.to(torch.long).view(n, 1) + torch.arange(K - 1, device=x.device).view(1, K - 1)
        new_state = torch.gather(full, 1, idx[..., None].expand(n, K - 1, D))
    return silu(acc), new_state
