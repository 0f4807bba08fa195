"""Write a step's new K and V into their cells of the paged pool."""

from __future__ import annotations

import torch


def kv_write_torch(k_cache: torch.Tensor, v_cache: torch.Tensor, cells: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> None:
    """k_cache/v_cache [blocks, page, kv_heads, head_dim] of one layer; cells
    [n] flat cell ids (block * page + offset); k/v [n, kv_heads, head_dim]
    (the reference)."""
    blocks, page = k_cache.shape[:2]
    k_cache.view(blocks * page, *k_cache.shape[2:]).index_copy_(0, cells, k.to(k_cache.dtype))
    v_cache.view(blocks * page, *v_cache.shape[2:]).index_copy_(0, cells, v.to(v_cache.dtype))
