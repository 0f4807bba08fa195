"""RMSNorm: x * rsqrt(mean(x^2) + eps) * w, in float32 as HF computes it.

The Triton kernel takes one row a program, so a row's sum of squares is
reduced the same way whatever else is in the tensor.
"""

from __future__ import annotations

import torch

from superfluid.kernels.triton_import import tl, triton


def rmsnorm_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Rows of x [..., d] normalized over d (the reference)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * y.to(x.dtype)


if triton is not None:

    @triton.jit
    def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, d, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < d
        x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        inv = tl.math.rsqrt(tl.sum(x * x, 0) / d + eps)
        # Rounded to x's dtype before the weight, as the reference does.
        y = (x * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, w * y, mask=m)


def rmsnorm_triton(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm_torch's contract (rows of any leading shape), one row a program."""
    if triton is None:
        raise RuntimeError("rmsnorm_triton needs triton (pip install superfluid[triton]); use rmsnorm_torch")
    d = x.shape[-1]
    if w.shape != (d,):
        raise ValueError(f"w: expected shape ({d},), got {tuple(w.shape)}")
    rows = x.reshape(-1, d)
    if rows.shape[0] and rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.result_type(w, x), device=x.device)
    if rows.numel():
        block = triton.next_power_of_2(d)
        _rmsnorm_kernel[(rows.shape[0],)](rows, w.contiguous(), out, rows.stride(0), out.stride(0), d, eps,
                                          BLOCK=block, num_warps=_warps(block))
    return out.view(x.shape)


def _warps(block: int) -> int:
    return max(1, min(16, block // 512))
