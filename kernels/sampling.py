"""The on-device sampler: a torch implementation and a Triton kernel (contract §5).

Both implement the algorithm in kernels/reference_sampler.py's docstring (the reference
sampler) and give the same token for the same row, params and position:

- `sample_torch`: batched torch ops, on CPU or CUDA tensors; also the reference
  the kernel is tested against.
- `sample_triton`: the Triton kernel of kernels/sampling_triton.py, one
  program per row.

A grammar mask (int32 bitmask rows, one bit a token) comes first: both
paths turn a banned token into -inf before anything else reads the row, and
rows without a mask skip it (the kernel compiles it out when no row has one).
On the CPU the torch path applies it with kernels/bitmask.py.

The uniform comes from kernels.rng.uniform_torch and is passed to the kernel.
Triton is optional: without it this module still imports and sample_triton
raises. Without CUDA, Triton can only run through its interpreter
(kernels/triton_import.py turns it on before any kernel is defined).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from superfluid.kernels import bitmask
from superfluid.kernels.bitmask import apply_bitmask
from superfluid.kernels.rng import position_to_int64, uniform_torch
from superfluid.kernels.sampling_triton import sample_kernel
from superfluid.kernels.triton_import import triton

Param = torch.Tensor | Sequence[float] | Sequence[int]
Mask = torch.Tensor | np.ndarray  # int32 [n, ceil(V/32)]

_NEG_INF = float("-inf")


def _param(x: Param, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=dtype, device=device).reshape(-1)
    if t.numel() != n:
        raise ValueError(f"expected {n} per-row values, got {t.numel()}")
    return t


def _positions(position: Param, n: int, device: torch.device) -> torch.Tensor:
    """Positions as int64 with the u64's bits (Python ints may be >= 2^63)."""
    if isinstance(position, torch.Tensor):
        return _param(position, n, torch.int64, device)
    return _param([position_to_int64(int(p)) for p in position], n, torch.int64, device)


def _mask(mask: Mask | None, mask_rows: Param | None, B: int, V: int,
          device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The grammar mask as int32 [n, ceil(V/32)] on the device and the rows it
    masks (int64 [n], distinct; None: every row, in order); None when it masks no row."""
    if mask is None:
        return None
    bits = torch.as_tensor(mask, device=device)
    W = (V + 31) // 32
    if bits.dtype != torch.int32 or bits.dim() != 2 or bits.shape[1] != W:
        raise ValueError(f"a token mask must be int32 [n, {W}], got {bits.dtype} {tuple(bits.shape)}")
    if mask_rows is None:
        if bits.shape[0] != B:
            raise ValueError(f"a token mask of {bits.shape[0]} rows for {B} rows (and no mask_rows)")
        return (bits.contiguous(), None) if B else None
    if not isinstance(mask_rows, torch.Tensor):
        listed = [int(r) for r in mask_rows]
        if len(listed) != bits.shape[0]:
            raise ValueError(f"{len(listed)} mask_rows for a token mask of {bits.shape[0]} rows")
        if listed and (min(listed) < 0 or max(listed) >= B or len(set(listed)) != len(listed)):
            raise ValueError(f"mask_rows must be distinct rows of 0..{B - 1}")
        if not listed:
            return None
        if listed == list(range(B)):
            return bits.contiguous(), None
        return bits.contiguous(), torch.tensor(listed, dtype=torch.int64, device=device)
    rows = mask_rows.to(device=device, dtype=torch.int64).reshape(-1)
    if rows.numel() != bits.shape[0]:
        raise ValueError(f"{rows.numel()} mask_rows for a token mask of {bits.shape[0]} rows")
    if rows.numel() == 0:
        return None
    return bits.contiguous(), rows


def apply_bitmask_torch(x: torch.Tensor, bits: torch.Tensor, rows: torch.Tensor | None = None, *,
                        reuse: bool = False, inplace: bool = False) -> torch.Tensor:
    """x [B, V] with the tokens that row rows[j]'s mask bits[j] does not allow at -inf
    (rows None: bits has a row per row of x, in order); a new tensor: x is not
    written. reuse: on the CPU the result may be this thread's buffer, which
    the next call with reuse overwrites (sample_torch's, which keeps nothing of it).
    inplace: x itself may be written and returned (where the CPU kernels can:
    the rows are still in cache from the LM head, a scratch buffer is not)."""
    V = x.shape[1]
    if x.device.type == "cpu" and x.dtype == torch.float32:
        xn = x.detach().numpy()
        listed = None if rows is None else rows.tolist()
        if inplace and x.is_contiguous() and bitmask.native():
            apply_bitmask(xn, bits.numpy(), listed, xn)
            return x
        return torch.from_numpy(apply_bitmask(xn, bits.numpy(), listed, reuse=reuse))
    ids = torch.arange(V, device=x.device)
    allowed = ((bits[:, ids >> 5] >> (ids & 31).to(torch.int32)) & 1).bool()
    if rows is None:
        return torch.where(allowed, x, _NEG_INF)
    out = x.clone()
    out[rows] = torch.where(allowed, x[rows], _NEG_INF)
    return out


# ------------------------------------------------------------------ torch


def sample_torch(rows: torch.Tensor, temperature: Param, top_k: Param, top_p: Param, min_p: Param,
                 position: Param, mask: Mask | None = None, mask_rows: Param | None = None, *,
                 consume: bool = False) -> torch.Tensor:
    """One token per row of `rows` [B, V] with per-row params; int64 [B] on rows' device.
    mask: a grammar bitmask (int32 [n, ceil(V/32)], engine.runtime.TokenMasks' layout)
    applied first to rows mask_rows (None: one mask row per row). consume: the
    caller keeps nothing of `rows`, so the mask may be applied in place."""
    B, V = rows.shape
    dev = rows.device
    temp = _param(temperature, B, torch.float64, dev)
    k = _param(top_k, B, torch.int64, dev)
    p = _param(top_p, B, torch.float64, dev)
    mp = _param(min_p, B, torch.float64, dev)
    if B == 0 or V == 0:
        return torch.zeros(B, dtype=torch.int64, device=dev)

    x = rows.to(torch.float32)
    got = _mask(mask, mask_rows, B, V, dev)
    if got is not None:
        x = apply_bitmask_torch(x, *got, reuse=True, inplace=consume)
    greedy = torch.argmax(x, dim=1)  # first maximum: the lowest id on ties
    if bool(torch.isnan(x.gather(1, greedy[:, None])).any()):
        # argmax ranks NaN first; the rule ranks it last. Only then pay for a masked copy.
        x = torch.where(torch.isnan(x), _NEG_INF, x)
        greedy = torch.argmax(x, dim=1)

    samp = temp > 0  # False for NaN too
    if not bool(samp.any()):
        return greedy  # all greedy: none of the float64 work below
    if not bool(samp.all()):
        # Only the sampled rows go through the filters; the rest keep their argmax.
        r = samp.nonzero().squeeze(1)
        out = greedy.clone()
        out[r] = sample_torch(x[r], temp[r], k[r], p[r], mp[r], _positions(position, B, dev)[r])
        return out
    u = uniform_torch(_positions(position, B, dev))  # (greedy rows draw nothing)
    z = x.to(torch.float64) / torch.where(samp, temp, 1.0)[:, None]
    keep = torch.isfinite(z)
    n = keep.sum(1)
    samp &= n > 0
    zmax = torch.where(samp, torch.where(keep, z, _NEG_INF).amax(1), 0.0)

    do_k = samp & (k > 0) & (k < n)
    if bool(do_k.any()):
        r = do_k.nonzero().squeeze(1)
        zr = torch.where(keep[r], z[r], _NEG_INF)
        kr = k[r]
        # the k-th best value is exact whatever order topk returns ties in
        t = torch.topk(zr, int(kr.max()), dim=1).values.gather(1, (kr - 1)[:, None])
        gt = zr > t
        eq = zr == t
        need = kr[:, None] - gt.sum(1, keepdim=True)
        keep[r] = gt | (eq & (eq.cumsum(1) <= need))

    w = torch.where(keep, torch.exp(torch.where(keep, z, zmax[:, None]) - zmax[:, None]), 0.0)

    do_p = samp & (p > 0) & (p < 1)
    if bool(do_p.any()):
        r = do_p.nonzero().squeeze(1)
        kr, wr = keep[r], w[r]
        # As on the host: the running sums in (w desc, id asc) order need only the sorted
        # values; the dropped (-1) sort last and add 0.
        sw = torch.sort(torch.where(kr, wr, -1.0), dim=1, descending=True).values.clamp(min=0.0)
        c = torch.cumsum(sw, dim=1)
        j = torch.argmax((c >= p[r, None] * c[:, -1:]).to(torch.int8), dim=1, keepdim=True)
        tau = sw.gather(1, j)
        gt = kr & (wr > tau)
        eq = kr & (wr == tau)
        keep[r] = gt | (eq & (eq.cumsum(1) <= j + 1 - gt.sum(1, keepdim=True)))

    use_min = samp & (mp > 0)
    keep &= w >= torch.where(use_min, mp.clamp(max=1.0), 0.0)[:, None]  # w_max == 1 always stays

    wf = torch.where(keep, w, 0.0)
    cs = torch.cumsum(wf, dim=1)
    hit = keep & (cs > (u * cs[:, -1])[:, None])
    ids = torch.arange(V, device=dev)
    first = torch.argmax(hit.to(torch.int8), dim=1)
    last = torch.where(keep, ids, -1).amax(1)
    tok = torch.where(hit.any(1), first, last)
    return torch.where(samp, tok, greedy)


# ----------------------------------------------------------------- triton


def sample_triton(rows: torch.Tensor, temperature: Param, top_k: Param, top_p: Param, min_p: Param,
                  position: Param, mask: Mask | None = None, mask_rows: Param | None = None, *,
                  block: int = 1024) -> torch.Tensor:
    """sample_torch's contract, computed by the Triton kernel (one program per row);
    the mask is read in the kernel, word by word beside the row."""
    if triton is None:
        raise RuntimeError("sample_triton needs triton (pip install superfluid[triton]); use sample_torch")
    if block <= 0 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    B, V = rows.shape
    dev = rows.device
    x = rows.to(torch.float32).contiguous()
    temp = _param(temperature, B, torch.float64, dev)
    k = _param(top_k, B, torch.int64, dev)
    p = _param(top_p, B, torch.float64, dev)
    mp = _param(min_p, B, torch.float64, dev)
    u = uniform_torch(_positions(position, B, dev))
    out = torch.zeros(B, dtype=torch.int64, device=dev)
    if B == 0 or V == 0:
        return out
    got = _mask(mask, mask_rows, B, V, dev)
    if got is None:
        bits, mrow = out, out  # never read (HAS_MASK is off)
    else:
        bits, rows_m = got
        if rows_m is None:
            mrow = torch.arange(B, dtype=torch.int32, device=dev)
        else:
            mrow = torch.full((B,), -1, dtype=torch.int32, device=dev)
            mrow[rows_m] = torch.arange(rows_m.numel(), dtype=torch.int32, device=dev)
    # No a*b+c fusion: the kernel's float64 ops round one at a time, as the host's do.
    sample_kernel[(B,)](x, x.stride(0), V, temp, k, p, mp, u, out, bits, bits.stride(0), mrow, BLOCK=block,
                         HAS_MASK=got is not None, enable_fp_fusion=False)
    return out
