"""The on-device sampler: a torch implementation and a Triton kernel (contract §5).

Both implement the algorithm in kernels/reference_sampler.py's docstring (the reference
sampler) and give the same token for the same row, params and position:

- `sample_torch`: batched torch ops, on CPU or CUDA tensors; also the reference
  the kernel is tested against.
- `sample_triton`: one program per row, the row read in BLOCK chunks (a row
  may be 128k wide), with several passes: argmax and z statistics; top-k by
  bisection on an order-preserving int64 key of z, then the ties at the
  threshold by id; the weights' sum; top-p by bisection on the weight's bits
  (non-negative floats order like their bit patterns) plus an id-ordered count
  of the ties at the threshold; min-p; the draw by a block-by-block running
  sum in id order.

A grammar mask (int32 bitmask rows, one bit a token) comes first: both
paths turn a banned token into -inf before anything else reads the row, and
rows without a mask skip it (the kernel compiles it out when no row has one).

The uniform comes from kernels.rng.uniform_torch and is passed to the kernel.
Triton is optional: without it this module still imports and sample_triton
raises. Without CUDA, Triton can only run through its interpreter
(kernels/triton_import.py turns it on before any kernel is defined).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import numpy as np
import torch

from superfluid.kernels import cpu as _cpu
from superfluid.kernels.rng import position_to_int64, uniform_torch
from superfluid.kernels.triton_import import tl, triton

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


_NEG_INF_BITS = np.int32(-0x800000)  # float32 -inf's bits (0xff800000) as an int32
_scratch = threading.local()  # each thread's reused buffers (sample_torch's masks)


def _buffer(name: str, shape: tuple[int, ...], reuse: bool) -> np.ndarray:
    """An int32 array of `shape`: with reuse, one of this thread's, grown as needed
    and overwritten by the next call (a fresh array page-faults its first touch:
    ~0.5 ms a MB beside torch's allocations, most of a mask's cost at vocab 32k)."""
    n = math.prod(shape)
    if not reuse:
        return np.empty(shape, dtype=np.int32)
    have = getattr(_scratch, name, None)
    if have is None or have.size < n:
        have = np.empty(n, dtype=np.int32)
        setattr(_scratch, name, have)
    return have[:n].reshape(shape)


def _apply_bitmask_cpu(x: np.ndarray, bits: np.ndarray, rows: list[int] | None, reuse: bool) -> np.ndarray:
    """float32 x [B, V] with rows `rows` (None: all, in order) at -inf where their masks
    bits [n, ceil(V/32)] have a clear bit; a new (or with reuse, this thread's) array.

    Integer ops on the floats' bits, one thread, the same time at any mask: a
    select (torch.where, np.copyto(where=)) mispredicts a branch a token where
    allowed and banned tokens alternate (3-6x slower at vocab 32k), and
    torch.where's threads wait for a core on a busy machine (B32 in a decode
    step: ~1 ms idle, ~7 ms busy, vs ~2.2 ms for these either way). With the
    CPU kernels built, sf_apply_bitmask does it in one pass (~10x less)."""
    B, V = x.shape
    n = bits.shape[0]
    if _cpu.available():
        out = _buffer("out", (B, V), reuse).view(np.float32)
        _cpu.apply_bitmask(x, bits, rows, out)
        return out
    # keep: -1 where allowed, 0 where banned (the words are little-endian: unpackbits' order)
    u = np.unpackbits(bits.astype("<i4", copy=False).view(np.uint8), axis=1, count=V, bitorder="little")
    keep = _buffer("keep", (n, V), reuse)
    np.subtract(0, u, out=keep, dtype=np.int32)
    xi = x.view(np.int32)
    out = _buffer("out", (B, V), reuse)
    dst = out
    if rows is not None:
        np.copyto(out, xi)
        dst = np.take(xi, rows, axis=0, out=_buffer("rows", (n, V), reuse))
        xi = dst
    # x where keep is -1, -inf's bits where it is 0
    np.bitwise_xor(xi, _NEG_INF_BITS, out=dst)
    np.bitwise_and(dst, keep, out=dst)
    np.bitwise_xor(dst, _NEG_INF_BITS, out=dst)
    if rows is not None:
        out[rows] = dst
    return out.view(np.float32)


def apply_bitmask_torch(x: torch.Tensor, bits: torch.Tensor, rows: torch.Tensor | None = None, *,
                        reuse: bool = False, inplace: bool = False) -> torch.Tensor:
    """x [B, V] with the tokens that row rows[j]'s mask bits[j] does not allow at -inf
    (rows None: bits has a row per row of x, in order); a new tensor: x is not
    written. reuse: on the CPU the result may be this thread's buffer, which
    the next call with reuse overwrites (sample_torch's, which keeps nothing of it).
    inplace: x itself may be written and returned (where the CPU kernels can:
    the rows are still in cache from the LM head, a scratch buffer is not)."""
    V = x.shape[1]
    if inplace and x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous() and _cpu.available():
        xn = x.detach().numpy()
        _cpu.apply_bitmask(xn, bits.numpy(), None if rows is None else rows.tolist(), xn)
        return x
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(_apply_bitmask_cpu(x.detach().numpy(), bits.numpy(),
                                                   None if rows is None else rows.tolist(), reuse))
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

if triton is not None:
    _MAX_I64 = tl.constexpr(0x7FFFFFFFFFFFFFFF)
    _MIN_I64 = tl.constexpr(-0x8000000000000000)
    _ONE_KEY = tl.constexpr(0x3FF0000000000000)  # the bits of 1.0, the largest weight

    @triton.jit
    def _z(x, m, t_safe):
        """z = float64(x) / temperature, -0.0 folded into 0.0; and whether it is a candidate."""
        z = x.to(tl.float64) / t_safe
        z = tl.where(z == 0.0, 0.0, z)  # -0.0 == 0.0 but their keys differ
        fin = m & (z == z) & (tl.abs(z) < float("inf"))
        return z, fin

    @triton.jit
    def _zkey(z):
        """An int64 that orders like the float64 z (for finite z)."""
        b = z.to(tl.int64, bitcast=True)
        return tl.where(b < 0, b ^ 0x7FFFFFFFFFFFFFFF, b)

    @triton.jit
    def _load(row_ptr, idx, V, bits_ptr, masked, HAS_MASK: tl.constexpr):
        """A block of the row, NaN and the grammar mask's banned tokens as -inf."""
        m = idx < V
        x = tl.load(row_ptr + idx, mask=m, other=float("-inf"))
        x = tl.where(x != x, float("-inf"), x)
        if HAS_MASK:
            # unmasked rows load no word (other=-1: every bit set)
            word = tl.load(bits_ptr + (idx >> 5), mask=tl.where(masked, m, False), other=-1)
            x = tl.where(((word >> (idx & 31)) & 1) != 0, x, float("-inf"))
        return x

    @triton.jit
    def _weights(row_ptr, idx, V, bits_ptr, masked, HAS_MASK: tl.constexpr, t_safe, zmax, t_key, cut_k):
        """w over the top-k kept set, -1.0 elsewhere (so kept weights are the >= 0 ones)."""
        m = idx < V
        x = _load(row_ptr, idx, V, bits_ptr, masked, HAS_MASK)
        z, fin = _z(x, m, t_safe)
        key = _zkey(z)
        kept = fin & ((key > t_key) | ((key == t_key) & (idx <= cut_k)))
        w = tl.exp(tl.where(kept, z - zmax, 0.0))
        return tl.where(kept, w, -1.0)

    if type(_z).__name__ == "InterpretedFunction":
        # The interpreter re-patches triton.language on every call of a jitted helper
        # (~0.5 ms, most of the kernel's time there): call the rewritten plain functions.
        _z, _zkey, _load, _weights = _z.rewrite(), _zkey.rewrite(), _load.rewrite(), _weights.rewrite()

    @triton.jit
    def _sample_kernel(rows_ptr, row_stride, V, temp_ptr, topk_ptr, topp_ptr, minp_ptr, u_ptr, out_ptr,
                       bits_ptr, bits_stride, mrow_ptr, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr):
        pid = tl.program_id(0)
        row_ptr = rows_ptr + pid.to(tl.int64) * row_stride
        # mrow: this row's mask row in bits, or -1 for none
        mrow = tl.full((), -1, tl.int32)
        if HAS_MASK:
            mrow = tl.load(mrow_ptr + pid)
        masked = mrow >= 0
        bits_ptr = bits_ptr + tl.maximum(mrow, 0).to(tl.int64) * bits_stride
        temp = tl.load(temp_ptr + pid)
        top_k = tl.load(topk_ptr + pid)
        top_p = tl.load(topp_ptr + pid)
        min_p = tl.load(minp_ptr + pid)
        u = tl.load(u_ptr + pid)
        offs = tl.arange(0, BLOCK)
        t_safe = tl.where(temp > 0, temp, 1.0)

        # Pass 1: the greedy argmax on the row; the candidates' count, max z and smallest key.
        best_val = tl.full((), float("-inf"), tl.float32)
        best_idx = tl.full((), 0, tl.int32)
        n_fin = tl.full((), 0, tl.int64)
        zmax = tl.full((), float("-inf"), tl.float64)
        kmin = tl.full((), _MAX_I64, tl.int64)
        for start in range(0, V, BLOCK):
            idx = start + offs
            m = idx < V
            x = _load(row_ptr, idx, V, bits_ptr, masked, HAS_MASK)
            bm = tl.max(x, 0)
            bi = tl.min(tl.where(x == bm, idx, V), 0)
            better = bm > best_val  # strict: an earlier block keeps its tie
            best_idx = tl.where(better, bi, best_idx)
            best_val = tl.where(better, bm, best_val)
            z, fin = _z(x, m, t_safe)
            n_fin += tl.sum(fin.to(tl.int64), 0)
            zmax = tl.maximum(zmax, tl.max(tl.where(fin, z, float("-inf")), 0))
            kmin = tl.minimum(kmin, tl.min(tl.where(fin, _zkey(z), _MAX_I64), 0))

        do_sample = (temp > 0) & (n_fin > 0)
        zmax = tl.where(do_sample, zmax, 0.0)

        # Top-k: the largest key t with count(key >= t) >= k, by bisection. Each bound snaps
        # to the nearest key present, so the search ends once one distinct key is left in
        # [lo, hi) (or a midpoint splits off exactly k), not after 64 halvings.
        do_k = do_sample & (top_k > 0) & (top_k < n_fin)
        lo = tl.where(do_k, kmin, 0)  # count(key >= lo) == cnt_lo >= k
        hi = tl.where(do_k, _zkey(zmax) + 1, 1)  # count(key >= hi) == cnt_hi < k
        cnt_lo = n_fin
        cnt_hi = tl.full((), 0, tl.int64)
        while (lo < hi - 1) & (cnt_lo != top_k):
            mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
            cnt = tl.full((), 0, tl.int64)
            up = tl.full((), _MAX_I64, tl.int64)  # the smallest key >= mid
            dn = tl.full((), _MIN_I64, tl.int64)  # the largest key < mid
            for start in range(0, V, BLOCK):
                idx = start + offs
                m = idx < V
                x = _load(row_ptr, idx, V, bits_ptr, masked, HAS_MASK)
                z, fin = _z(x, m, t_safe)
                key = _zkey(z)
                ge = fin & (key >= mid)
                cnt += tl.sum(ge.to(tl.int64), 0)
                up = tl.minimum(up, tl.min(tl.where(ge, key, _MAX_I64), 0))
                dn = tl.maximum(dn, tl.max(tl.where(fin & (key < mid), key, _MIN_I64), 0))
            ok = cnt >= top_k
            lo = tl.where(ok, up, lo)
            cnt_lo = tl.where(ok, cnt, cnt_lo)
            hi = tl.where(ok, hi, dn + 1)
            cnt_hi = tl.where(ok, cnt_hi, cnt)
        exact = cnt_lo == top_k
        t_key = tl.where(do_k, tl.where(exact, lo - 1, lo), _MIN_I64)
        need = tl.where(exact, 0, top_k - cnt_hi)  # the ties at t_key to keep, lowest ids first
        # The need-th tie at t_key in id order; -1 keeps no tie, V keeps all.
        found = V
        run = tl.full((), 0, tl.int64)
        n_tie = tl.where(do_k & (need > 0), V, 0)
        for start in range(0, n_tie, BLOCK):
            idx = start + offs
            m = idx < V
            x = _load(row_ptr, idx, V, bits_ptr, masked, HAS_MASK)
            z, fin = _z(x, m, t_safe)
            eq = fin & (_zkey(z) == t_key)
            c = tl.cumsum(eq.to(tl.int64), 0) + run
            found = tl.minimum(found, tl.min(tl.where(eq & (c == need), idx, V), 0))
            run += tl.sum(eq.to(tl.int64), 0)
        cut_k = tl.where(do_k, tl.where(need > 0, found, -1), V)

        # The weights' sum W and the smallest kept weight's key.
        n_samp = tl.where(do_sample, V, 0)
        W = tl.full((), 0.0, tl.float64)
        wmin = tl.full((), _ONE_KEY, tl.int64)
        for start in range(0, n_samp, BLOCK):
            w = _weights(row_ptr, start + offs, V, bits_ptr, masked, HAS_MASK, t_safe, zmax, t_key, cut_k)
            W += tl.sum(tl.maximum(w, 0.0), 0)
            wmin = tl.minimum(wmin, tl.min(tl.where(w >= 0, w.to(tl.int64, bitcast=True), _ONE_KEY), 0))

        # Top-p: the largest weight key tau with mass(w >= tau) >= top_p * W, by bisection
        # with snapping as for top-k (mass(w >= wmin) is W, summed in the same order, and
        # top_p * W > 0 as W >= 1); then the ties at tau in id order until the running sum
        # reaches top_p * W.
        do_p = do_sample & (top_p > 0) & (top_p < 1)
        target_p = top_p * W
        plo = tl.where(do_p, wmin, 0)
        phi = tl.where(do_p, _ONE_KEY + 1, 1)
        s_hi = tl.full((), 0.0, tl.float64)  # mass(w >= phi)
        while plo < phi - 1:
            mid = (plo + phi) >> 1  # both below 2^62: no overflow
            s = tl.full((), 0.0, tl.float64)
            up = tl.full((), _MAX_I64, tl.int64)
            dn = tl.full((), -1, tl.int64)
            for start in range(0, V, BLOCK):
                w = _weights(row_ptr, start + offs, V, bits_ptr, masked, HAS_MASK, t_safe, zmax, t_key, cut_k)
                wk = w.to(tl.int64, bitcast=True)  # negative for the dropped (-1.0)
                ge = wk >= mid
                s += tl.sum(tl.where(ge, w, 0.0), 0)
                up = tl.minimum(up, tl.min(tl.where(ge, wk, _MAX_I64), 0))
                dn = tl.maximum(dn, tl.max(tl.where((wk >= 0) & (wk < mid), wk, -1), 0))
            ok = s >= target_p
            plo = tl.where(ok, up, plo)
            phi = tl.where(ok, phi, dn + 1)
            s_hi = tl.where(ok, s_hi, s)
        tau = plo.to(tl.float64, bitcast=True)
        found_p = V
        run_p = tl.full((), 0, tl.int64)
        n_tie_p = tl.where(do_p, V, 0)
        for start in range(0, n_tie_p, BLOCK):
            idx = start + offs
            w = _weights(row_ptr, idx, V, bits_ptr, masked, HAS_MASK, t_safe, zmax, t_key, cut_k)
            tie = w.to(tl.int64, bitcast=True) == plo
            cnt = tl.cumsum(tie.to(tl.int64), 0) + run_p
            hit = tie & (s_hi + cnt.to(tl.float64) * tau >= target_p)
            found_p = tl.minimum(found_p, tl.min(tl.where(hit, idx, V), 0))
            run_p += tl.sum(tie.to(tl.int64), 0)
        cut_p = found_p  # V when off (or when rounding never reaches: keep every tie)
        min_w = tl.where(do_sample & (min_p > 0), tl.minimum(min_p, 1.0), 0.0)  # w_max == 1 stays

        # The kept mass R, then the draw: the first id whose running sum exceeds u * R.
        R = tl.full((), 0.0, tl.float64)
        for start in range(0, n_samp, BLOCK):
            idx = start + offs
            w = _weights(row_ptr, idx, V, bits_ptr, masked, HAS_MASK, t_safe, zmax, t_key, cut_k)
            wk = w.to(tl.int64, bitcast=True)
            keep = (w >= min_w) & (w >= 0) & ((wk > plo) | ((wk == plo) & (idx <= cut_p)))
            R += tl.sum(tl.where(keep, w, 0.0), 0)
        target = u * R
        carry = tl.full((), 0.0, tl.float64)
        pick = V
        last = tl.full((), -1, tl.int32)
        for start in range(0, n_samp, BLOCK):
            idx = start + offs
            w = _weights(row_ptr, idx, V, bits_ptr, masked, HAS_MASK, t_safe, zmax, t_key, cut_k)
            wk = w.to(tl.int64, bitcast=True)
            keep = (w >= min_w) & (w >= 0) & ((wk > plo) | ((wk == plo) & (idx <= cut_p)))
            wf = tl.where(keep, w, 0.0)
            cs = carry + tl.cumsum(wf, 0)
            pick = tl.minimum(pick, tl.min(tl.where(keep & (cs > target), idx, V), 0))
            last = tl.maximum(last, tl.max(tl.where(keep, idx, -1), 0))
            carry += tl.sum(wf, 0)
        tok = tl.where(pick < V, pick, last)
        tl.store(out_ptr + pid, tl.where(do_sample, tok, best_idx).to(tl.int64))


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
    _sample_kernel[(B,)](x, x.stride(0), V, temp, k, p, mp, u, out, bits, bits.stride(0), mrow, BLOCK=block,
                         HAS_MASK=got is not None, enable_fp_fusion=False)
    return out
