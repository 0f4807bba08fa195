"""RMSNorm: x * rsqrt(mean(x^2) + eps) * w, in float32 as HF computes it."""

from __future__ import annotations

import torch


def rmsnorm_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Rows of x [..., d] normalized over d (the reference)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * y.to(x.dtype)
