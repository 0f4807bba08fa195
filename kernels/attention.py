"""Attention over the paged KV pool, the same arithmetic for prefill and decode.

Every query row (a token and one query head of a KV group) attends to the
cells 0..pos of its own sequence. Keys are taken in fixed chunks of
KEY_CHUNK cells at absolute positions (0-63, 64-127, ...); each chunk gives a
partial softmax (its max, its sum, its weighted values) and the partials are
combined in chunk order. The split depends only on the sequence, never on
what shares the step, so a row is bitwise the same whether its token came
alone, in a batch, or in any chunk of a prefill:
  - score and value GEMMs have fixed inner sizes (head_dim, KEY_CHUNK) and
    rows padded to a multiple of ROW_TILE;
  - padding (rows, keys past a sequence, chunks past the longest sequence)
    adds exact zeros to the chunk combination.

`AttnBatch` is what a step's feeds look like to a kernel: token indices,
positions and block tables, never lanes.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

KEY_CHUNK = 64
# Query rows of a score GEMM are padded to this: MKL's full-tile kernel then
# treats every row alike (kernels/linear.py has the same story for tokens).
ROW_TILE = 8
NEG_INF = float("-inf")


@dataclasses.dataclass
class DenseKV:
    """A decode group's cells gathered once and kept across steps, so a
    steady decode batch reads its keys in place instead of gathering them
    from the pool every step. K is [layers, kv_heads, F, capacity, head_dim]
    (one score GEMM per row over all keys); V is chunk-major, [layers,
    capacity / KEY_CHUNK, kv_heads, F, KEY_CHUNK, head_dim], so the first
    chunks are one contiguous run for the per-chunk value GEMMs. This step's
    new cells are copied in from the pool (`cells`) at `pos`."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor  # [F] position of this step's token in each feed
    cells: torch.Tensor  # [F] its flat cell id in the pool
    _where: tuple | None = None  # the indices above, split once for every layer of the step

    def where(self, page: int) -> tuple:
        if self._where is None:
            f = torch.arange(self.k.shape[2], device=self.k.device)
            self._where = (f, self.pos, self.cells // page, self.cells % page, self.pos // KEY_CHUNK,
                           self.pos % KEY_CHUNK)
        return self._where


@dataclasses.dataclass
class AttnGroup:
    """Feeds computed together with the same padded shapes."""

    q_index: torch.Tensor  # [F, Tq] token index in the step; n_tokens = a zero pad row
    row_pos: torch.Tensor  # [F, Tq] absolute position of each query token (0 for pads)
    kv_blocks: torch.Tensor  # [F, Lp / page] block ids of keys [0, Lp), TRASH past the sequence
    key_len: int  # Lp: a multiple of KEY_CHUNK and of the page
    feeds: list[int] = dataclasses.field(default_factory=list)  # index of each row's feed in the step
    max_tokens: int = 0  # the most tokens any feed of the group brings
    dense: DenseKV | None = None
    masked: torch.Tensor | None = None  # [1, F, rows, key_len] keys past each row: built once per step


@dataclasses.dataclass
class AttnBatch:
    """One step's attention layout, shared by every layer."""

    n_tokens: int
    positions: torch.Tensor  # [n_tokens] absolute positions
    cells: torch.Tensor  # [n_tokens] flat cell id (block * page + offset) each new K/V goes to
    groups: list[AttnGroup]


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def token_layout(feeds: list[tuple[list[int], int, int]], page: int) -> tuple[np.ndarray, ...]:
    """Per feed (block table, cells before the step, tokens fed), in step
    order: tokens fed, start, first token in the step, the TRASH-padded
    block tables; per token: its feed, position and the flat cell its K/V
    goes to."""
    nf = len(feeds)
    n = np.fromiter((f[2] for f in feeds), dtype=np.int64, count=nf)
    start = np.fromiter((f[1] for f in feeds), dtype=np.int64, count=nf)
    first = np.cumsum(n) - n
    width = max((len(f[0]) for f in feeds), default=0)
    table = np.zeros((nf, max(width, 1)), dtype=np.int64)
    for i, f in enumerate(feeds):
        table[i, :len(f[0])] = f[0]
    feed_of = np.repeat(np.arange(nf), n)
    positions = np.arange(int(n.sum())) - np.repeat(first, n) + np.repeat(start, n)
    cells = table[feed_of, positions // page] * page + positions % page
    return n, start, first, table, feed_of, positions, cells


def build_batch(feeds: list[tuple[list[int], int, int]], page: int, q_per_kv: int,
                device: str | torch.device = "cpu", max_group_elems: int = 1 << 24) -> AttnBatch:
    """The layout of a step. `feeds`: (block table, cells before the step,
    tokens fed) per feed, in step order (tokens are laid out feed after feed).
    Feeds are grouped by padded query length so a decode batch is one group
    and each long prefill its own; grouping never changes a result."""
    n, start, first, table, _feed_of, positions, cells = token_layout(feeds, page)
    return _grouped(n, start, first, table, positions, cells, page, q_per_kv, device, max_group_elems)


def batch_of_layout(positions: np.ndarray, cells: np.ndarray, feed_of: np.ndarray, tables: np.ndarray, page: int,
                    q_per_kv: int, device: str | torch.device = "cpu") -> AttnBatch:
    """build_batch's layout from token_layout's arrays (a step as a
    tensor-parallel leader ships it to its ranks): the same groups."""
    nf = tables.shape[0]
    n = np.bincount(feed_of, minlength=nf).astype(np.int64)
    first = np.cumsum(n) - n
    start = np.zeros(nf, dtype=np.int64)
    fed = n > 0
    start[fed] = positions[first[fed]]
    return _grouped(n, start, first, tables, positions, cells, page, q_per_kv, device, 1 << 24)


def _grouped(n: np.ndarray, start: np.ndarray, first: np.ndarray, table: np.ndarray, positions: np.ndarray,
             cells: np.ndarray, page: int, q_per_kv: int, device: str | torch.device,
             max_group_elems: int) -> AttnBatch:
    nf = len(n)
    end = start + n
    n_tokens = int(n.sum())
    # Rows per token are q_per_kv; pad the token count so rows are a multiple of ROW_TILE.
    tq_unit = ROW_TILE // math.gcd(q_per_kv, ROW_TILE)
    key_unit = KEY_CHUNK * page // math.gcd(KEY_CHUNK, page)
    by_tq: dict[int, list[int]] = {}
    for i in range(nf):
        tq = _round_up(int(n[i]), tq_unit)
        tq = 1 << (tq - 1).bit_length() if tq > tq_unit else tq  # few distinct shapes
        by_tq.setdefault(_round_up(tq, tq_unit), []).append(i)
    groups = []
    for tq, members in sorted(by_tq.items()):
        members.sort(key=lambda i: end[i])  # stable: ties keep step order
        while members:
            # As many as fit the element budget, shortest sequences together.
            take = 1
            while take < len(members):
                lp = _round_up(int(end[members[take]]), key_unit)
                if (take + 1) * tq * q_per_kv * lp > max_group_elems:
                    break
                take += 1
            chunk, members = np.array(members[:take]), members[take:]
            lp = _round_up(int(end[chunk].max()), key_unit)
            nb = lp // page
            col = np.arange(tq)
            real = col[None, :] < n[chunk, None]
            q_index = np.where(real, first[chunk, None] + col, n_tokens)
            row_pos = np.where(real, start[chunk, None] + col, 0)
            kv_blocks = np.zeros((len(chunk), nb), dtype=np.int64)
            kv_blocks[:, :min(nb, table.shape[1])] = table[chunk, :nb]
            groups.append(AttnGroup(torch.from_numpy(q_index).to(device), torch.from_numpy(row_pos).to(device),
                                    torch.from_numpy(kv_blocks).to(device), lp, feeds=chunk.tolist(),
                                    max_tokens=int(n[chunk].max())))
    return AttnBatch(n_tokens, torch.from_numpy(positions).to(device), torch.from_numpy(cells).to(device), groups)


def heads_major(cache: torch.Tensor) -> torch.Tensor:
    """A layer's cache [blocks, page, kv_heads, head_dim] as [kv_heads,
    blocks, page, head_dim]: free when the pool stores it that way (the torch
    backend's pool does), a copy otherwise."""
    h = cache.permute(2, 0, 1, 3)
    return h if h.is_contiguous() else h.contiguous()


def group_keys(grp: AttnGroup, kh: torch.Tensor, vh: torch.Tensor,
               layer: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's keys [kv_heads, F, L, head_dim] and values by chunk
    [L / KEY_CHUNK, kv_heads, F, KEY_CHUNK, head_dim] (L >= key_len, a
    multiple of KEY_CHUNK): from its DenseKV when it has one, else gathered
    from the pool (heads-major [kv, blocks, page, d])."""
    n_kv, page, d = kh.shape[0], kh.shape[2], kh.shape[-1]
    if grp.dense is not None and layer is not None:
        dk, dv = grp.dense.k[layer], grp.dense.v[layer]
        f, pos, blocks, offs, chunk, within = grp.dense.where(page)
        dk[:, f, pos] = kh[:, blocks, offs]
        dv[chunk, :, f, within] = vh[:, blocks, offs].transpose(0, 1)
        return dk, dv
    f = grp.kv_blocks.shape[0]
    flat = grp.kv_blocks.reshape(-1)
    k = kh.index_select(1, flat).view(n_kv, f, grp.key_len, d)
    v = vh.index_select(1, flat).view(n_kv, f, grp.key_len // KEY_CHUNK, KEY_CHUNK, d).permute(2, 0, 1, 3, 4)
    return k, v


def attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttnBatch,
                    scale: float, layer: int | None = None) -> torch.Tensor:
    """q [n_tokens, heads, head_dim] of one layer (the step's K/V already in
    the cache, [blocks, page, kv_heads, head_dim]) -> [n_tokens, heads,
    head_dim] (the reference; the CPU serving path). `layer` selects the
    layer of a group's DenseKV, if it has one."""
    n, n_heads, d = q.shape
    kh, vh = heads_major(k_cache), heads_major(v_cache)  # [kv, blocks, page, d]
    n_kv, _, _page, _ = kh.shape
    g = n_heads // n_kv
    out = q.new_empty(n + 1, n_heads, d)
    q_pad = torch.cat([q, q.new_zeros(1, n_heads, d)])
    for grp in batch.groups:
        f, tq = grp.q_index.shape
        rows = tq * g
        real = min(rows, _round_up(grp.max_tokens * g, 1) if grp.max_tokens else rows)
        # Rows of a KV head: (token, query head in the group), token-major.
        qg = q_pad[grp.q_index].view(f, tq, n_kv, g, d).permute(2, 0, 1, 3, 4).reshape(n_kv, f, rows, d)
        k, v = group_keys(grp, kh, vh, layer)
        lp = grp.key_len
        nc = lp // KEY_CHUNK
        k, v = k[:, :, :lp], v[:nc]
        # One score GEMM over all keys (columns are invariant in multiples of
        # KEY_CHUNK), then only the rows that are not padding.
        s = (torch.matmul(qg, k.transpose(-1, -2)) * scale)[:, :, :real]  # [kv, f, real, lp]
        if grp.masked is None or grp.masked.shape[2] != real:  # the same for every layer of the step
            row_pos = grp.row_pos.repeat_interleave(g, dim=1)[:, :real].view(1, f, real, 1)
            grp.masked = torch.arange(lp, device=q.device).view(1, 1, 1, lp) > row_pos
        s = s.masked_fill(grp.masked, NEG_INF).view(n_kv, f, real, nc, KEY_CHUNK)
        m = s.amax(-1)  # [kv, f, real, nc]
        p = torch.exp(s - m.masked_fill(m == NEG_INF, 0.0).unsqueeze(-1))
        l_part = p.sum(-1)
        # Value GEMMs per chunk (their inner size is KEY_CHUNK), rows padded back to ROW_TILE.
        pt = p.permute(3, 0, 1, 2, 4)  # [nc, kv, f, real, chunk]
        if real % ROW_TILE:
            pt = torch.nn.functional.pad(pt, (0, 0, 0, ROW_TILE - real % ROW_TILE))
        acc = torch.matmul(pt, v)[:, :, :, :real]  # [nc, kv, f, real, d]
        m_all = m.amax(-1, keepdim=True)
        w = torch.exp(m - m_all.masked_fill(m_all == NEG_INF, 0.0)).permute(3, 0, 1, 2)  # [nc, kv, f, real]
        # Sums over the chunk axis (the outer axis): chunk order, zeros for padding.
        num = (acc * w.unsqueeze(-1)).sum(0)  # [kv, f, real, d]
        den = (l_part.permute(3, 0, 1, 2) * w).sum(0)
        o = num / den.unsqueeze(-1)
        if real < rows:
            o = torch.nn.functional.pad(o, (0, 0, 0, rows - real))
        o = o.view(n_kv, f, tq, g, d).permute(1, 2, 0, 3, 4).reshape(f * tq, n_heads, d)
        out[grp.q_index.reshape(-1)] = o
    return out[:n]


def attention_plain(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttnBatch,
                    scale: float, layer: int | None = None) -> torch.Tensor:
    """The same attention as one masked softmax per group, with no care for
    invariance: only to measure what invariance costs."""
    n, n_heads, d = q.shape
    kh, vh = heads_major(k_cache), heads_major(v_cache)
    n_kv = kh.shape[0]
    g = n_heads // n_kv
    out = q.new_empty(n + 1, n_heads, d)
    q_pad = torch.cat([q, q.new_zeros(1, n_heads, d)])
    for grp in batch.groups:
        f, tq = grp.q_index.shape
        qg = q_pad[grp.q_index].transpose(1, 2)  # [f, heads, tq, d]
        k, v = group_keys(grp, kh, vh, layer)
        lp = k.shape[2]
        k = k.transpose(0, 1).repeat_interleave(g, dim=1)
        v = v.permute(2, 1, 0, 3, 4).reshape(f, n_kv, lp, d).repeat_interleave(g, dim=1)
        mask = torch.arange(lp, device=q.device).view(1, 1, 1, lp) <= grp.row_pos.view(f, 1, tq, 1)
        o = torch.nn.functional.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
        out[grp.q_index.reshape(-1)] = o.transpose(1, 2).reshape(f * tq, n_heads, d)
    return out[:n]
