"""Write a step's new K and V into their cells of the paged pool."""

from __future__ import annotations

import torch

from superfluid.kernels.triton_import import tl, triton

_BLOCK = 1024


def kv_write_torch(k_cache: torch.Tensor, v_cache: torch.Tensor, cells: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> None:
    """k_cache/v_cache [blocks, page, kv_heads, head_dim] of one layer; cells
    [n] flat cell ids (block * page + offset); k/v [n, kv_heads, head_dim]
    (the reference)."""
    blocks, page, n_kv, d = k_cache.shape
    for cache, new in ((k_cache, k), (v_cache, v)):
        heads = cache.permute(2, 0, 1, 3)
        if heads.is_contiguous():  # the torch backend's pool: [kv_heads, blocks, page, head_dim] underneath
            heads.view(n_kv, blocks * page, d).index_copy_(1, cells, new.to(cache.dtype).transpose(0, 1))
        else:
            cache.view(blocks * page, n_kv, d).index_copy_(0, cells, new.to(cache.dtype))


if triton is not None:

    @triton.jit
    def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, cells_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_cell, HEAD_DIM: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # element of the token's [kv_heads, head_dim]
        m = e < ROW
        h, d = e // HEAD_DIM, e % HEAD_DIM
        dst = tl.load(cells_ptr + t) * stride_cell + e
        tl.store(kc_ptr + dst, tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=m), mask=m)
        tl.store(vc_ptr + dst, tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=m), mask=m)


def kv_write_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, cells: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> None:
    """kv_write_torch's contract, one token a program (k/v may be strided
    views of the fused projection as long as head_dim is dense)."""
    if triton is None:
        raise RuntimeError("kv_write_triton needs triton (pip install superfluid[triton]); "
                           "use kv_write_torch")
    blocks, page, n_kv, head_dim = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: expected shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    n = cells.shape[0]
    for name, t in (("k", k), ("v", v)):
        if t.shape != (n, n_kv, head_dim):
            raise ValueError(f"{name}: expected shape ({n}, {n_kv}, {head_dim}), got {tuple(t.shape)}")
    # Views, not copies: the kernel must write into the pool itself (raises if the layer is not dense).
    kc = k_cache.view(blocks * page, n_kv * head_dim)
    vc = v_cache.view(blocks * page, n_kv * head_dim)
    k, v = _dense_as(k, k_cache.dtype), _dense_as(v, v_cache.dtype)
    if n == 0:
        return
    row = n_kv * head_dim
    block = min(_BLOCK, triton.next_power_of_2(row))
    _kv_write_kernel[(n, triton.cdiv(row, block))](k, v, kc, vc, cells, k.stride(0), k.stride(1), v.stride(0),
                                                   v.stride(1), kc.stride(0), HEAD_DIM=head_dim, ROW=row,
                                                   BLOCK=block)


def _dense_as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype with a dense last dim. A dtype change is torch's .to() (round to
    nearest even; the interpreter's float casts truncate), so the kernel only copies."""
    if t.dtype != dtype:
        return t.to(dtype, memory_format=torch.contiguous_format)
    return t if t.stride(-1) == 1 else t.contiguous()
