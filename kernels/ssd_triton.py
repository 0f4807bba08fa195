"""Triton kernels of a Mamba2 mixer: the SSD chunk scan, the one-token state
update and the depthwise causal conv (kernels/ssd.py holds their torch
references, with the same signatures).

ssd_chunk takes each of its N rows as one chunk of L positions starting from
the row's state h0, in mamba-ssm's chunked form, three launches:
  1. _cumsum_kernel: the log-decay from the chunk start, cs_t = sum_{u<=t} dt_u A
     (ssd_chunk_state.py's _chunk_cumsum_fwd).
  2. _scan_kernel: y_t = exp(cs_t) C_t . h0  +  sum_{u<=t} exp(cs_t - cs_u) dt_u (C_t . B_u) x_u,
     a tile of output positions against the key tiles up to its own
     (ssd_chunk_scan.py's _chunk_scan_fwd, with C Bᵀ computed in place).
  3. _state_kernel: h_end = exp(cs_last) h0 + sum_u exp(cs_last - cs_u) dt_u x_u ⊗ B_u
     (chunk_state plus the one step of state_passing a single chunk needs).
Zero-padded positions (dt = x = B = C = 0) leave cs, and so h_end, unchanged
and give y = 0.

Batch invariance: a program reads one (row, head) only and its tile shapes
depend on L, P and S, never on N, so a row's results are bitwise the same
alone or in any batch.

Everything is float32; the dots ask for IEEE precision (no TF32), since the
references agree to 1e-5. Tiles are at least 16 wide, what tl.dot wants on a GPU.
"""

from __future__ import annotations

import torch

from superfluid.kernels.triton_import import tl, triton

__all__ = ["causal_conv", "ssd_chunk", "ssm_update"]

_MAX_BLOCK_L = 64  # positions a scan tile (mamba-ssm's chunk scan uses 64 too)
_MAX_BLOCK_P = 64  # head-dim channels a program
_MAX_BLOCK_S = 64  # state channels a state-kernel program
_MAX_BLOCK_D = 128  # conv channels a program


if triton is not None:

    @triton.jit
    def _cumsum_kernel(dt_ptr, a_ptr, cs_ptr, L, H: tl.constexpr, BLOCK_L: tl.constexpr):
        """One (row, head): cs[row, head, :] = cumsum(dt * A) over the chunk."""
        pid = tl.program_id(0).to(tl.int64)  # row * H + head
        n = pid // H
        h = pid % H
        a = tl.load(a_ptr + h)
        i = tl.arange(0, BLOCK_L)
        carry = 0.0
        for t0 in range(0, L, BLOCK_L):
            t = t0 + i
            m = t < L
            dt = tl.load(dt_ptr + (n * L + t) * H + h, mask=m, other=0.0)
            cs = carry + tl.cumsum(dt * a, 0)
            tl.store(cs_ptr + pid * L + t, cs, mask=m)
            # The tile's last entry, exactly (masked tail entries repeat it: their dt is 0).
            carry = tl.sum(tl.where(i == BLOCK_L - 1, cs, 0.0), 0)

    @triton.jit
    def _scan_kernel(x_ptr, dt_ptr, b_ptr, c_ptr, h0_ptr, cs_ptr, y_ptr, L,
                     H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, S: tl.constexpr,
                     BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr):
        """One (row, head) x a tile of output positions x a block of P: y of the tile."""
        pid = tl.program_id(0).to(tl.int64)  # row * H + head
        n = pid // H
        h = pid % H
        g = h // (H // G)
        t = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
        p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
        s = tl.arange(0, BLOCK_S)
        tm = t < L
        pm = p < P
        sm = s < S

        c = tl.load(c_ptr + ((n * L + t[:, None]) * G + g) * S + s[None, :], mask=tm[:, None] & sm[None, :],
                    other=0.0)
        cs_t = tl.load(cs_ptr + pid * L + t, mask=tm, other=0.0)
        # The carried state's part: exp(cs_t) C_t . h0, h0 read as [S, P].
        h0 = tl.load(h0_ptr + (pid * P + p[None, :]) * S + s[:, None], mask=sm[:, None] & pm[None, :],
                     other=0.0)
        acc = tl.dot(c, h0, input_precision="ieee") * tl.exp(cs_t)[:, None]

        # The chunk's own part, causal: key tiles up to and including this one.
        hi = tl.minimum((tl.program_id(1) + 1) * BLOCK_L, L)
        for u0 in range(0, hi, BLOCK_L):
            u = u0 + tl.arange(0, BLOCK_L)
            um = u < L
            b = tl.load(b_ptr + ((n * L + u[:, None]) * G + g) * S + s[None, :],
                        mask=um[:, None] & sm[None, :], other=0.0)
            x = tl.load(x_ptr + ((n * L + u[:, None]) * H + h) * P + p[None, :],
                        mask=um[:, None] & pm[None, :], other=0.0)
            dt_u = tl.load(dt_ptr + (n * L + u) * H + h, mask=um, other=0.0)
            cs_u = tl.load(cs_ptr + pid * L + u, mask=um, other=0.0)
            cb = tl.dot(c, tl.trans(b), input_precision="ieee")  # [t, u]
            # Masked before exp: above the diagonal cs_t - cs_u > 0 could overflow, and inf * 0 is nan.
            causal = (u[None, :] <= t[:, None]) & um[None, :]
            seg = tl.where(causal, cs_t[:, None] - cs_u[None, :], float("-inf"))
            cb = cb * tl.exp(seg) * dt_u[None, :]
            acc += tl.dot(cb, x, input_precision="ieee")

        tl.store(y_ptr + ((n * L + t[:, None]) * H + h) * P + p[None, :], acc, mask=tm[:, None] & pm[None, :])

    @triton.jit
    def _state_kernel(x_ptr, dt_ptr, b_ptr, h0_ptr, cs_ptr, h_ptr, L,
                      H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, S: tl.constexpr,
                      BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr):
        """One (row, head) x a block of P x a block of S: the state after the chunk."""
        pid = tl.program_id(0).to(tl.int64)  # row * H + head
        n = pid // H
        h = pid % H
        g = h // (H // G)
        p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
        s = tl.program_id(2) * BLOCK_S + tl.arange(0, BLOCK_S)
        pm = p < P
        sm = s < S
        cs_last = tl.load(cs_ptr + pid * L + L - 1)  # the wrapper launches for L >= 1 only

        acc = tl.zeros([BLOCK_P, BLOCK_S], tl.float32)
        for u0 in range(0, L, BLOCK_L):
            u = u0 + tl.arange(0, BLOCK_L)
            um = u < L
            x = tl.load(x_ptr + ((n * L + u[:, None]) * H + h) * P + p[None, :],
                        mask=um[:, None] & pm[None, :], other=0.0)
            b = tl.load(b_ptr + ((n * L + u[:, None]) * G + g) * S + s[None, :],
                        mask=um[:, None] & sm[None, :], other=0.0)
            dt_u = tl.load(dt_ptr + (n * L + u) * H + h, mask=um, other=0.0)
            cs_u = tl.load(cs_ptr + pid * L + u, mask=um, other=0.0)
            # A position's decay to the chunk end; `where` keeps exp() of the tile's tail out (inf * 0).
            w = tl.where(um, tl.exp(cs_last - cs_u) * dt_u, 0.0)
            acc += tl.dot(tl.trans(x * w[:, None]), b, input_precision="ieee")

        off = (pid * P + p[:, None]) * S + s[None, :]
        hm = pm[:, None] & sm[None, :]
        h0 = tl.load(h0_ptr + off, mask=hm, other=0.0)
        tl.store(h_ptr + off, tl.exp(cs_last) * h0 + acc, mask=hm)

    @triton.jit
    def _update_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, h_ptr, y_ptr,
                       stride_hn, stride_hh, stride_hp, stride_hs,
                       H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, S: tl.constexpr,
                       BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr):
        """One (row, head, block of P): the state advanced by one token, in place, and y."""
        n = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        g = h // (H // G)
        p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
        s = tl.arange(0, BLOCK_S)
        pm = p < P
        sm = s < S
        dt = tl.load(dt_ptr + n * H + h)
        decay = tl.exp(dt * tl.load(a_ptr + h))
        x = tl.load(x_ptr + (n * H + h) * P + p, mask=pm, other=0.0)
        b = tl.load(b_ptr + (n * G + g) * S + s, mask=sm, other=0.0)
        c = tl.load(c_ptr + (n * G + g) * S + s, mask=sm, other=0.0)
        # Strided: the state is updated where it lives (a slot of the caller's pool, say).
        at = n * stride_hn + h * stride_hh + p[:, None] * stride_hp + s[None, :] * stride_hs
        hm = pm[:, None] & sm[None, :]
        state = tl.load(h_ptr + at, mask=hm, other=0.0)
        state = decay * state + (dt * x)[:, None] * b[None, :]
        tl.store(h_ptr + at, state, mask=hm)
        tl.store(y_ptr + (n * H + h) * P + p, tl.sum(state * c[None, :], 1), mask=pm)

    @triton.jit
    def _cat_rows(x_ptr, state_ptr, n, j, jm, d, dm, L, D: tl.constexpr, K: tl.constexpr):
        """Rows j (where jm) of cat(state[n], x[n]), channels d (where dm); 0 elsewhere."""
        old = j < K - 1
        # Offsets clamped where masked: no out-of-range address is formed.
        v_old = tl.load(state_ptr + (n * (K - 1) + tl.where(old, j, 0)[:, None]) * D + d[None, :],
                        mask=(jm & old)[:, None] & dm[None, :], other=0.0)
        v_new = tl.load(x_ptr + (n * L + tl.where(old, 0, j - (K - 1))[:, None]) * D + d[None, :],
                        mask=(jm & (j >= K - 1))[:, None] & dm[None, :], other=0.0)
        return tl.where(old[:, None], v_old, v_new)

    @triton.jit
    def _conv_kernel(x_ptr, state_ptr, w_ptr, bias_ptr, len_ptr, out_ptr, new_state_ptr, L,
                     D: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LENGTHS: tl.constexpr,
                     BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr):
        """One row x a tile of positions x a block of channels: SiLU(conv) over cat(state, x).

        The tile at position 0 also writes the new state."""
        n = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
        d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
        tm = t < L
        dm = d < D
        acc = tl.zeros([BLOCK_L, BLOCK_D], tl.float32)
        # Taps in order k = 0..K-1, then the bias: the reference's order.
        for k in tl.static_range(K):
            wk = tl.load(w_ptr + d * K + k, mask=dm, other=0.0)
            acc += _cat_rows(x_ptr, state_ptr, n, t + k, tm, d, dm, L, D, K) * wk[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + d, mask=dm, other=0.0)[None, :]
        # SiLU as the references write it, x / (1 + exp(-x)), with an IEEE divide.
        tl.store(out_ptr + (n * L + t[:, None]) * D + d[None, :], tl.math.div_rn(acc, 1.0 + tl.exp(-acc)),
                 mask=tm[:, None] & dm[None, :])

        if tl.program_id(1) == 0:
            # New state row i is cat(state, x)[length + i]: the K-1 inputs before x[length].
            if HAS_LENGTHS:
                length = tl.load(len_ptr + n).to(tl.int64)
            else:
                length = L
            i = tl.arange(0, BLOCK_W)
            j = length + i
            im = (i < K - 1) & (j < L + K - 1)  # a length past L reads nothing
            tl.store(new_state_ptr + (n * (K - 1) + i[:, None]) * D + d[None, :],
                     _cat_rows(x_ptr, state_ptr, n, j, im, d, dm, L, D, K), mask=im[:, None] & dm[None, :])


def _need_triton(what: str) -> None:
    if triton is None:
        raise RuntimeError(f"{what} needs triton (pip install superfluid[triton]); use kernels/ssd.py")


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """t as a contiguous float32 tensor of `shape`, or a ValueError naming it."""
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    if t.dtype != torch.float32:
        raise ValueError(f"{name}: expected float32, got {t.dtype}")
    return t.contiguous()


def _groups(h: int, g: int) -> None:
    if g < 1 or h % g:
        raise ValueError(f"{h} heads do not split into {g} groups")


def _block(n: int, cap: int) -> int:
    return min(cap, max(16, triton.next_power_of_2(n)))


def ssd_chunk(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of the SSD scan per row, from state h0.

    x [N, L, H, P], dt [N, L, H] (softplus'd and clamped), A [H] (negative), B, C [N, L, G, S]
    (head h reads group h // (H // G)), h0 [N, H, P, S], all float32. Returns y [N, L, H, P]
    (without the D skip) and h_end [N, H, P, S], the state after position L - 1."""
    _need_triton("ssd_chunk")
    n, L, H, P = x.shape
    G, S = B.shape[2], B.shape[3]
    _groups(H, G)
    x = _check("x", x, (n, L, H, P))
    dt = _check("dt", dt, (n, L, H))
    A = _check("A", A, (H,))
    B = _check("B", B, (n, L, G, S))
    C = _check("C", C, (n, L, G, S))
    h0 = _check("h0", h0, (n, H, P, S))
    y = torch.empty_like(x)
    if n == 0 or L == 0:
        return y, h0.clone()
    h_end = torch.empty_like(h0)
    cs = torch.empty((n, H, L), dtype=torch.float32, device=x.device)
    block_l = _block(L, _MAX_BLOCK_L)
    block_p = _block(P, _MAX_BLOCK_P)
    dims = dict(H=H, G=G, P=P, S=S, BLOCK_L=block_l, BLOCK_P=block_p)
    _cumsum_kernel[(n * H,)](dt, A, cs, L, H=H, BLOCK_L=block_l)
    # The scan dots C against B and h0 over all of S at once.
    _scan_kernel[(n * H, triton.cdiv(L, block_l), triton.cdiv(P, block_p))](
        x, dt, B, C, h0, cs, y, L, BLOCK_S=max(16, triton.next_power_of_2(S)), **dims)
    block_s = _block(S, _MAX_BLOCK_S)
    _state_kernel[(n * H, triton.cdiv(P, block_p), triton.cdiv(S, block_s))](
        x, dt, B, h0, cs, h_end, L, BLOCK_S=block_s, **dims)
    return y, h_end


def ssm_update(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               h: torch.Tensor) -> torch.Tensor:
    """One token's recurrent step: h = exp(dt A) h + dt x ⊗ B, in place, and y = h . C.

    x [N, H, P], dt [N, H], A [H], B, C [N, G, S], h [N, H, P, S] float32 (any strides: it is
    written where it is). Returns y [N, H, P] (without D, z or dt_bias: the caller's)."""
    _need_triton("ssm_update")
    n, H, P = x.shape
    G, S = B.shape[1], B.shape[2]
    _groups(H, G)
    x = _check("x", x, (n, H, P))
    dt = _check("dt", dt, (n, H))
    A = _check("A", A, (H,))
    B = _check("B", B, (n, G, S))
    C = _check("C", C, (n, G, S))
    if tuple(h.shape) != (n, H, P, S) or h.dtype != torch.float32:
        raise ValueError(f"h: expected float32 of shape {(n, H, P, S)}, got {h.dtype} {tuple(h.shape)}")
    y = torch.empty_like(x)
    if y.numel() == 0:
        return y
    block_p = min(_MAX_BLOCK_P, triton.next_power_of_2(P))
    _update_kernel[(n, H, triton.cdiv(P, block_p))](
        x, dt, A, B, C, h, y, *h.stride(), H=H, G=G, P=P, S=S, BLOCK_P=block_p,
        BLOCK_S=triton.next_power_of_2(S))
    return y


def causal_conv(x: torch.Tensor, state: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv with SiLU, continuing from the previous K-1 inputs.

    x [N, L, D], state [N, K-1, D], w [D, K], b [D] or None, float32. Returns
    out [N, L, D] = SiLU(sum_k w[:, k] * cat(state, x)[t + k] + b) and the new
    state [N, K-1, D]: the K-1 inputs before x[lengths[i]] (lengths [N] integers
    in 0..L, default L: the last K-1 rows of cat(state, x))."""
    _need_triton("causal_conv")
    n, L, D = x.shape
    K = w.shape[1] if w.dim() == 2 else 0
    if K < 1:
        raise ValueError(f"w: expected shape ({D}, K) with K >= 1, got {tuple(w.shape)}")
    x = _check("x", x, (n, L, D))
    state = _check("state", state, (n, K - 1, D))
    w = _check("w", w, (D, K))
    if b is not None:
        b = _check("b", b, (D,))
    if lengths is not None:
        if tuple(lengths.shape) != (n,) or lengths.dtype.is_floating_point:
            raise ValueError(f"lengths: expected integers of shape ({n},), got {lengths.dtype} "
                             f"{tuple(lengths.shape)}")
        lengths = lengths.contiguous()
    out = torch.empty_like(x)
    new_state = torch.empty_like(state)
    if n == 0 or D == 0 or (L == 0 and K == 1):
        return out, new_state
    block_l = min(_MAX_BLOCK_L, triton.next_power_of_2(max(L, 1)))
    block_d = min(_MAX_BLOCK_D, triton.next_power_of_2(D))
    # At least one tile of positions, even for L == 0: the first tile writes the new state.
    _conv_kernel[(n, max(1, triton.cdiv(L, block_l)), triton.cdiv(D, block_d))](
        x, state, w, w if b is None else b, x if lengths is None else lengths, out, new_state, L,
        D=D, K=K, HAS_BIAS=b is not None, HAS_LENGTHS=lengths is not None,
        BLOCK_L=block_l, BLOCK_D=block_d, BLOCK_W=triton.next_power_of_2(max(K - 1, 1)))
    return out, new_state
