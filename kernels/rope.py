"""Rotary position embedding (rotate-half layout, as the Llama family)."""

from __future__ import annotations

import torch


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [n, heads, head_dim] rotated by the angles of `positions` [n];
    cos/sin tables [max_len, head_dim / 2] (the reference)."""
    half = x.shape[-1] // 2
    c = cos[positions].unsqueeze(1).to(x.dtype)
    s = sin[positions].unsqueeze(1).to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
