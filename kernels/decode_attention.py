"""Paged decode attention, split-KV, and the two kernels prefill shares.

A sequence's keys are cut into splits of SPLIT cells at absolute positions
(0-255, 256-511, ...). One program of `_split_kernel` takes a query tile of
one feed and one KV head against one split: it walks the split's keys in
chunks of BLOCK_N (64, the reference's KEY_CHUNK) in order, with an online
softmax, and writes the split's partial (max, sum, weighted values) per row
to scratch. `_combine_kernel` then merges a row's splits in split order.
prefill_attention.py launches the same two kernels with wider query tiles.

Batch invariance by construction: everything a row's arithmetic depends on
is fixed by the row's own token, never by what shares the step.
  - Split and chunk boundaries are absolute positions; a row walks the
    chunks 0..pos of its splits, and a chunk past its position leaves its
    state untouched (a `where`, not an add of zeros).
  - Query tiles are BLOCK_M rows, aligned at absolute positions too: a tile
    holds TPT = BLOCK_M // GT consecutive positions, GT query heads of the
    KV group each (GT = min(q_per_kv, BLOCK_M)), and a row's place in the
    tile is (pos % TPT, head). A decode token sits where the same token sits
    in any prefill chunk. A GPU's MMA treats a tile's rows alike; under the
    interpreter tl.dot is a BLAS call that does not (here OpenBLAS rounds
    rows 0-5, 6-11 and 12-15 of a 16-row tile differently), and this
    alignment keeps interpreter results bitwise equal too.
  - Tile shapes are fixed (BLOCK_M, BLOCK_N, BLOCK_D); rows, keys and head
    dims of padding are masked, and masked keys get probability 0.

What the kernels take from an AttnGroup (build_batch's layout): a feed's
query positions are consecutive, row_pos[f, 0] + column; q_index pads with
n_tokens; batch.positions agrees with row_pos (the combine merges splits
0..positions[t] // SPLIT, the ones the split kernel wrote).
"""

from __future__ import annotations

import dataclasses

import torch

from superfluid.kernels.attention import KEY_CHUNK, AttnBatch, AttnGroup
from superfluid.kernels.triton_import import tl, triton

SPLIT = 256  # cells a split covers, at absolute positions
BLOCK_N = KEY_CHUNK  # keys a chunk inside a split
BLOCK_M = 16  # query rows a tile (tl.dot wants >= 16)
_COMBINE_HEADS = 16  # heads a combine program merges

if SPLIT % BLOCK_N:
    raise ValueError(f"SPLIT ({SPLIT}) must be a multiple of BLOCK_N ({BLOCK_N})")


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How a KV group's query rows fill BLOCK_M-row tiles."""

    heads: int  # GT: query heads of a token in one tile
    head_tiles: int  # tiles it takes to cover the q_per_kv heads of a token
    positions: int  # TPT: consecutive positions a tile holds

    @classmethod
    def of(cls, q_per_kv: int) -> Tiling:
        gt = min(q_per_kv, BLOCK_M)
        return cls(gt, -(-q_per_kv // gt), BLOCK_M // gt)


@dataclasses.dataclass
class SplitScratch:
    """Per-split partials of every (token, query head) of a step, float32.
    Entries past a row's last split are never written nor read."""

    m: torch.Tensor  # [n_tokens, heads, splits] the split's max score
    l: torch.Tensor  # [n_tokens, heads, splits] sum of exp(score - m)
    acc: torch.Tensor  # [n_tokens, heads, splits, head_dim] sum of exp(score - m) * v

    @classmethod
    def for_batch(cls, q: torch.Tensor, batch: AttnBatch) -> SplitScratch:
        n, heads, head_dim = q.shape
        splits = max((-(-g.key_len // SPLIT) for g in batch.groups), default=1)
        f32 = dict(dtype=torch.float32, device=q.device)
        return cls(torch.empty((n, heads, splits), **f32), torch.empty((n, heads, splits), **f32),
                   torch.empty((n, heads, splits, head_dim), **f32))

    @property
    def splits(self) -> int:
        return self.m.shape[2]


if triton is not None:

    # Decode and prefill launches differ in these values only: not specializing on them (== 1,
    # multiples of 16) keeps one compiled kernel, the same code for a row whichever path it took.
    @triton.jit(do_not_specialize=["n_tokens", "tq", "n_tiles", "key_len", "n_splits", "stride_feed",
                                   "stride_table"])
    def _split_kernel(q_ptr, k_ptr, v_ptr, q_index_ptr, row_pos_ptr, kv_blocks_ptr, m_ptr, l_ptr, acc_ptr,
                      scale, n_tokens, tq, n_tiles, key_len, n_splits,
                      stride_qt, stride_qh, stride_feed, stride_table, stride_cell, stride_kvh,
                      N_HEADS: tl.constexpr, G: tl.constexpr, GT: tl.constexpr, HEAD_TILES: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        """One (feed, query tile, head tile) x KV head x split: the split's partial for each row."""
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        head_tile = pid % HEAD_TILES
        feed = (pid // HEAD_TILES) // n_tiles
        tile = (pid // HEAD_TILES) % n_tiles
        TPT: tl.constexpr = BLOCK_M // GT

        # Rows: (position slot, head) with the slot = pos % TPT, so a row's place in the
        # tile depends on its absolute position only.
        r = tl.arange(0, BLOCK_M)
        slot = r // GT
        j = head_tile * GT + r % GT
        first = tl.load(row_pos_ptr + feed * stride_feed)  # the feed's first query position
        pos = (first // TPT + tile) * TPT + slot
        col = pos - first  # the token's column in the group's q_index
        ok = (slot < TPT) & (j < G) & (col >= 0) & (col < tq)
        tok = tl.load(q_index_ptr + feed * stride_feed + col, mask=ok, other=n_tokens)
        ok = ok & (tok < n_tokens)  # q_index pads with n_tokens
        pos = tl.where(ok, pos, -1)  # a dead row has no key
        head = kvh * G + j

        d = tl.arange(0, BLOCK_D)
        dm = d < HEAD_DIM
        q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=ok[:, None] & dm[None, :], other=0.0)

        start = split * SPLIT
        want = tl.minimum(tl.max(pos, 0) + 1 - start, SPLIT)  # keys of this split the tile reaches
        n_chunks = tl.cdiv(tl.maximum(want, 0), BLOCK_N)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        n = tl.arange(0, BLOCK_N)
        for c in range(0, n_chunks):
            c0 = start + c * BLOCK_N
            kp = c0 + n
            km = kp < key_len
            blk = tl.load(kv_blocks_ptr + feed * stride_table + kp // PAGE, mask=km, other=0)
            cell = blk * PAGE + kp % PAGE
            kv_off = cell[:, None] * stride_cell + kvh * stride_kvh + d[None, :]
            kv_m = km[:, None] & dm[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_m, other=0.0)
            v = tl.load(v_ptr + kv_off, mask=kv_m, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            s = tl.where(kp[None, :] <= pos[:, None], s, float("-inf"))
            has = c0 <= pos  # the row has a key in this chunk
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # For a row without keys here any finite base keeps exp() quiet; `where` drops it.
            base = tl.where(has, m_new, tl.maximum(m_i, 0.0))
            alpha = tl.exp(m_i - base)
            p = tl.exp(s - base[:, None])
            l_new = l_i * alpha + tl.sum(p, 1)
            acc_new = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = tl.where(has, m_new, m_i)
            l_i = tl.where(has, l_new, l_i)
            acc = tl.where(has[:, None], acc_new, acc)

        # A row stores the splits it reaches; the combine reads exactly those.
        live = ok & (pos >= start)
        at = (tok.to(tl.int64) * N_HEADS + head) * n_splits + split
        tl.store(m_ptr + at, m_i, mask=live)
        tl.store(l_ptr + at, l_i, mask=live)
        tl.store(acc_ptr + at[:, None] * HEAD_DIM + d[None, :], acc, mask=live[:, None] & dm[None, :])

    @triton.jit(do_not_specialize=["n_splits"])
    def _combine_kernel(m_ptr, l_ptr, acc_ptr, pos_ptr, out_ptr, n_splits, stride_ot, stride_oh,
                        N_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_D: tl.constexpr, SPLIT: tl.constexpr):
        """One token x a block of heads: the splits 0..pos // SPLIT merged in split order."""
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = h < N_HEADS
        d = tl.arange(0, BLOCK_D)
        hdm = hm[:, None] & (d < HEAD_DIM)[None, :]
        n_live = tl.load(pos_ptr + t) // SPLIT + 1  # every one of them holds a key
        row = (t * N_HEADS + h) * n_splits
        m_all = tl.full([BLOCK_H], float("-inf"), tl.float32)
        for s in range(0, n_live):
            m_all = tl.maximum(m_all, tl.load(m_ptr + row + s, mask=hm, other=float("-inf")))
        m_all = tl.where(hm, m_all, 0.0)
        num = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        den = tl.zeros([BLOCK_H], tl.float32)
        for s in range(0, n_live):
            w = tl.exp(tl.load(m_ptr + row + s, mask=hm, other=float("-inf")) - m_all)
            den += tl.load(l_ptr + row + s, mask=hm, other=0.0) * w
            part = tl.load(acc_ptr + (row + s)[:, None] * HEAD_DIM + d[None, :], mask=hdm, other=0.0)
            num += part * w[:, None]
        o = num / tl.where(hm, den, 1.0)[:, None]
        tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :], o, mask=hdm)


def _need_triton(what: str) -> None:
    if triton is None:
        raise RuntimeError(f"{what} needs triton (pip install superfluid[triton]); use attention_torch")


def launch_splits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: AttnGroup,
                  scale: float, scratch: SplitScratch, n_tokens: int, tq: int) -> None:
    """The split partials of a group's rows: the first `tq` query columns of
    each feed, in tiles aligned at absolute positions. Decode and prefill
    both come here; only tq differs."""
    _need_triton("paged attention")
    n_feeds = group.q_index.shape[0]
    _, page, n_kv, head_dim = k_cache.shape
    n_heads = q.shape[1]
    g = n_heads // n_kv
    tiling = Tiling.of(g)
    # A feed's tq consecutive positions start anywhere in a tile: at most this many tiles.
    n_tiles = (tq + tiling.positions - 2) // tiling.positions + 1
    n_splits = -(-group.key_len // SPLIT)
    if n_feeds == 0 or n_tokens == 0:
        return
    if q.stride(-1) != 1:
        q = q.contiguous()
    q_index, row_pos = group.q_index.contiguous(), group.row_pos.contiguous()
    kv_blocks = group.kv_blocks.contiguous()
    kc = k_cache.view(-1, n_kv, head_dim)  # [cells, kv_heads, head_dim]; raises if the layer is not dense
    vc = v_cache.view(-1, n_kv, head_dim)
    grid = (n_feeds * n_tiles * tiling.head_tiles, n_kv, n_splits)
    _split_kernel[grid](
        q, kc, vc, q_index, row_pos, kv_blocks, scratch.m, scratch.l, scratch.acc,
        scale, n_tokens, tq, n_tiles, group.key_len, scratch.splits,
        q.stride(0), q.stride(1), q_index.stride(0), kv_blocks.stride(0), kc.stride(0), kc.stride(1),
        N_HEADS=n_heads, G=g, GT=tiling.heads, HEAD_TILES=tiling.head_tiles, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), PAGE=page, SPLIT=SPLIT, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, PRECISION="ieee" if q.dtype == torch.float32 else None)


def combine_splits(scratch: SplitScratch, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n_tokens, heads, head_dim]: each row's splits merged in split order."""
    _need_triton("paged attention")
    n, n_heads, _, head_dim = scratch.acc.shape
    out = torch.empty((n, n_heads, head_dim), dtype=dtype, device=scratch.acc.device)
    if n == 0:
        return out
    block_h = min(_COMBINE_HEADS, triton.next_power_of_2(n_heads))
    _combine_kernel[(n, triton.cdiv(n_heads, block_h))](
        scratch.m, scratch.l, scratch.acc, positions, out, scratch.splits, out.stride(0), out.stride(1),
        N_HEADS=n_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(head_dim),
        SPLIT=SPLIT)
    return out


def is_decode_group(group: AttnGroup, n_tokens: int) -> bool:
    """Whether every feed of the group brings one token (its other columns
    are pads). Reads the group's indices: a device sync on a GPU."""
    return bool((group.q_index[:, 1:] == n_tokens).all())


def decode_partials(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: AttnGroup,
                    scale: float, scratch: SplitScratch, n_tokens: int) -> None:
    """A decode group's split partials: one tile per (feed, KV head, split)
    holding the token's query heads of the KV group."""
    launch_splits(q, k_cache, v_cache, group, scale, scratch, n_tokens, tq=1)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttnBatch,
                     scale: float) -> torch.Tensor:
    """attention_torch's contract for a step whose feeds all bring one token."""
    scratch = SplitScratch.for_batch(q, batch)
    for i, group in enumerate(batch.groups):
        if not is_decode_group(group, batch.n_tokens):
            raise ValueError(f"batch.groups[{i}].q_index: a feed brings more than one token; "
                             "use prefill_attention")
        decode_partials(q, k_cache, v_cache, group, scale, scratch, batch.n_tokens)
    return combine_splits(scratch, batch.positions, q.dtype)
