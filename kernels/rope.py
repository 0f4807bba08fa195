"""Rotary position embedding (rotate-half layout, as the Llama family).

The Triton kernel takes one token a program (all its heads): each element is
rotated by its own position's angle with the reference's products and sums,
rounded one at a time (no a*b+c fusion).
"""

from __future__ import annotations

import torch

from superfluid.kernels.triton_import import tl, triton


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [n, heads, head_dim] rotated by the angles of `positions` [n];
    cos/sin tables [max_len, head_dim / 2] (the reference)."""
    half = x.shape[-1] // 2
    c = cos[positions].unsqueeze(1).to(x.dtype)
    s = sin[positions].unsqueeze(1).to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


if triton is not None:

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, stride_xt, stride_xh, stride_ot, stride_oh,
                     stride_tab, n_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_HALF: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t)
        h = tl.arange(0, BLOCK_H)
        j = tl.arange(0, BLOCK_HALF)
        jm = j < HALF
        m = (h < n_heads)[:, None] & jm[None, :]
        dt = x_ptr.dtype.element_ty
        c = tl.load(cos_ptr + pos * stride_tab + j, mask=jm, other=0.0).to(dt)[None, :]
        s = tl.load(sin_ptr + pos * stride_tab + j, mask=jm, other=0.0).to(dt)[None, :]
        src = x_ptr + t * stride_xt + h[:, None] * stride_xh + j[None, :]
        x1 = tl.load(src, mask=m, other=0.0)
        x2 = tl.load(src + HALF, mask=m, other=0.0)
        dst = out_ptr + t * stride_ot + h[:, None] * stride_oh + j[None, :]
        tl.store(dst, x1 * c - x2 * s, mask=m)
        tl.store(dst + HALF, x2 * c + x1 * s, mask=m)


def rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
    """rope_torch's contract, one token a program; x may be a strided view
    (q/k sliced out of the fused projection) as long as head_dim is dense."""
    if triton is None:
        raise RuntimeError("rope_triton needs triton (pip install superfluid[triton]); use rope_torch")
    n, n_heads, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"x: head_dim must be even for rotate-half, got {head_dim}")
    half = head_dim // 2
    if cos.shape[-1] != half or sin.shape != cos.shape:
        raise ValueError(f"cos/sin: expected [max_len, {half}] each, "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if positions.shape != (n,):
        raise ValueError(f"positions: expected shape ({n},), got {tuple(positions.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((n, n_heads, head_dim), dtype=x.dtype, device=x.device)
    if x.numel():
        # No fusion: x1*c - x2*s rounds each product, as torch's separate ops do.
        _rope_kernel[(n,)](x, cos, sin, positions, out, x.stride(0), x.stride(1), out.stride(0),
                           out.stride(1), cos.stride(0), n_heads, HALF=half,
                           BLOCK_H=triton.next_power_of_2(n_heads), BLOCK_HALF=triton.next_power_of_2(half),
                           enable_fp_fusion=False)
    return out
