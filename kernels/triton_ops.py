"""The ops TritonBackend (kernels/backend.py) calls, dispatched to the Triton launchers.

Importing this module without triton fails, which is how TritonBackend
reports a missing install.
"""

from __future__ import annotations

import torch

from superfluid.kernels import decode_attention as _decode
from superfluid.kernels.attention import AttnBatch
from superfluid.kernels.kv_write import kv_write_triton
from superfluid.kernels.prefill_attention import prefill_partials
from superfluid.kernels.rmsnorm import rmsnorm_triton
from superfluid.kernels.rope import rope_triton
from superfluid.kernels.swiglu import swiglu_triton

if _decode.triton is None:
    raise ImportError("the triton backend needs triton (pip install superfluid[triton])")

__all__ = ["attention", "kv_write", "rmsnorm", "rope", "swiglu"]

rmsnorm = rmsnorm_triton
rope = rope_triton
swiglu = swiglu_triton
kv_write = kv_write_triton


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttnBatch,
              scale: float) -> torch.Tensor:
    """attention_torch's contract: the decode launcher for groups of one-token
    feeds, the prefill launcher otherwise (the same rows either way), then
    one combine for the whole step."""
    scratch = _decode.SplitScratch.for_batch(q, batch)
    for group in batch.groups:
        if _decode.is_decode_group(group, batch.n_tokens):
            _decode.decode_partials(q, k_cache, v_cache, group, scale, scratch, batch.n_tokens)
        else:
            prefill_partials(q, k_cache, v_cache, group, scale, scratch, batch.n_tokens)
    return _decode.combine_splits(scratch, batch.positions, q.dtype)
