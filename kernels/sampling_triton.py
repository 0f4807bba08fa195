"""The Triton sampling kernel: one program per row (kernels/sampling.py's sample_triton launches it).

The row is read in BLOCK chunks (a row may be 128k wide), with several
passes: argmax and z statistics; top-k by bisection on an order-preserving
int64 key of z, then the ties at the threshold by id; the weights' sum; top-p
by bisection on the weight's bits (non-negative floats order like their bit
patterns) plus an id-ordered count of the ties at the threshold; min-p; the
draw by a block-by-block running sum in id order. A grammar mask row is read
word by word beside the row (HAS_MASK compiles it out when no row has one).
Without Triton, sample_kernel is None.
"""

from __future__ import annotations

from typing import Any

from superfluid.kernels.triton_import import tl, triton

sample_kernel: Any = None  # the @triton.jit kernel below, where Triton is installed

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
    def sample_kernel(rows_ptr, row_stride, V, temp_ptr, topk_ptr, topp_ptr, minp_ptr, u_ptr, out_ptr,
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
