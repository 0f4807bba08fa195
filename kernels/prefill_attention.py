"""Prefill attention over the paged KV pool: query tiles of a feed against its cells.

A feed's query rows (token, query head of a KV group) go in BLOCK_M-row tiles
aligned at absolute positions; each tile is causal by absolute position (a
row sees keys 0..pos, keys the tile cannot reach are never loaded, whole
splits past the tile are skipped). The arithmetic is decode_attention.py's
kernels, launched with tiles of several positions: one split-partial kernel
and one combine for both, so a row comes out bitwise the same whether its
token is decoded alone or sits anywhere in any prefill chunk.

Cost of that choice: the partials go through scratch (n_tokens x heads x
splits x head_dim float32) instead of being merged in registers.
"""

from __future__ import annotations

import torch

from superfluid.kernels.attention import AttnBatch, AttnGroup
from superfluid.kernels.decode_attention import SplitScratch, combine_splits, launch_splits


def prefill_partials(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: AttnGroup,
                     scale: float, scratch: SplitScratch, n_tokens: int) -> None:
    """The split partials of every query column of a group's feeds."""
    launch_splits(q, k_cache, v_cache, group, scale, scratch, n_tokens, tq=group.q_index.shape[1])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttnBatch,
                      scale: float) -> torch.Tensor:
    """attention_torch's contract, for any step (decode feeds included)."""
    scratch = SplitScratch.for_batch(q, batch)
    for group in batch.groups:
        prefill_partials(q, k_cache, v_cache, group, scale, scratch, batch.n_tokens)
    return combine_splits(scratch, batch.positions, q.dtype)
