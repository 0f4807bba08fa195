"""Attention over the paged KV pool, the same arithmetic for prefill and decode.

Every query row (a token and one query head of a KV group) attends to the
cells 0..pos of its own sequence. Keys are taken in fixed chunks of
KEY_CHUNK cells at absolute positions (0-63, 64-127, ...); each chunk gives a
partial softmax (its max, its sum, its weighted values) and the partials are
combined in chunk order. The split depends only on the sequence, never on
what shares the step, so a row is bitwise the same whether its token came
alone, in a batch, or in any chunk of a prefill:
  - score and value GEMMs have fixed inner sizes (head_dim, KEY_CHUNK) and
    rows padded to a multiple of 8 (kernels/linear.py says why);
  - padding (rows, keys past a sequence, chunks past the longest sequence)
    adds exact zeros to the chunk combination.

`AttnBatch` is what a step's feeds look like to a kernel: token indices,
positions and block tables, never lanes.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from superfluid.kernels.linear import ROW_TILE

KEY_CHUNK = 64
NEG_INF = float("-inf")


@dataclasses.dataclass
class AttnGroup:
    """Feeds computed together with the same padded shapes."""

    q_index: torch.Tensor  # [F, Tq] token index in the step; n_tokens = a zero pad row
    row_pos: torch.Tensor  # [F, Tq] absolute position of each query token (0 for pads)
    kv_blocks: torch.Tensor  # [F, Lp / page] block ids of keys [0, Lp), TRASH past the sequence
    key_len: int  # Lp: a multiple of KEY_CHUNK and of the page


@dataclasses.dataclass
class AttnBatch:
    """One step's attention layout, shared by every layer."""

    n_tokens: int
    positions: torch.Tensor  # [n_tokens] absolute positions
    cells: torch.Tensor  # [n_tokens] flat cell id (block * page + offset) each new K/V goes to
    groups: list[AttnGroup]


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def build_batch(feeds: list[tuple[list[int], int, int]], page: int, q_per_kv: int,
                device: str | torch.device = "cpu", max_group_elems: int = 1 << 24) -> AttnBatch:
    """The layout of a step. `feeds`: (block table, cells before the step,
    tokens fed) per feed, in step order (tokens are laid out feed after feed).
    Feeds are grouped by padded query length so a decode batch is one group
    and each long prefill its own; grouping never changes a result."""
    positions, cells = [], []
    spans = []
    at = 0
    for blocks, start, n in feeds:
        pos = range(start, start + n)
        positions.extend(pos)
        cells.extend(blocks[p // page] * page + p % page for p in pos)
        spans.append((at, n, start + n, blocks))
        at += n
    n_tokens = at
    # Rows per token are q_per_kv; pad the token count so rows are a multiple of 8.
    tq_unit = ROW_TILE // math.gcd(q_per_kv, ROW_TILE)
    key_unit = KEY_CHUNK * page // math.gcd(KEY_CHUNK, page)
    by_tq: dict[int, list] = {}
    for sp in spans:
        tq = _round_up(sp[1], tq_unit)
        tq = 1 << (tq - 1).bit_length() if tq > tq_unit else tq  # few distinct shapes
        by_tq.setdefault(_round_up(tq, tq_unit), []).append(sp)
    groups = []
    for tq, members in sorted(by_tq.items()):
        members.sort(key=lambda sp: sp[2])
        while members:
            # As many as fit the element budget, shortest sequences together.
            take = 1
            while take < len(members):
                lp = _round_up(members[take][2], key_unit)
                if (take + 1) * tq * q_per_kv * lp > max_group_elems:
                    break
                take += 1
            chunk, members = members[:take], members[take:]
            lp = _round_up(max(sp[2] for sp in chunk), key_unit)
            nb = lp // page
            q_index = torch.full((len(chunk), tq), n_tokens, dtype=torch.long)
            row_pos = torch.zeros((len(chunk), tq), dtype=torch.long)
            kv_blocks = torch.zeros((len(chunk), nb), dtype=torch.long)
            for i, (first, n, end, blocks) in enumerate(chunk):
                q_index[i, :n] = torch.arange(first, first + n)
                row_pos[i, :n] = torch.arange(end - n, end)
                used = min(len(blocks), nb)
                kv_blocks[i, :used] = torch.tensor(blocks[:used], dtype=torch.long)
            groups.append(AttnGroup(q_index.to(device), row_pos.to(device), kv_blocks.to(device), lp))
    return AttnBatch(n_tokens, torch.tensor(positions, dtype=torch.long, device=device),
                     torch.tensor(cells, dtype=torch.long, device=device), groups)


def attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttnBatch,
                    scale: float) -> torch.Tensor:
    """q [n_tokens, heads, head_dim] of one layer (the step's K/V already in
    the cache, [blocks, page, kv_heads, head_dim]) -> [n_tokens, heads,
    head_dim] (the reference; the CPU serving path)."""
    n, n_heads, d = q.shape
    _, page, n_kv, _ = k_cache.shape
    g = n_heads // n_kv
    out = q.new_empty(n + 1, n_heads, d)
    q_pad = torch.cat([q, q.new_zeros(1, n_heads, d)])
    for grp in batch.groups:
        f, tq = grp.q_index.shape
        lp, nc = grp.key_len, grp.key_len // KEY_CHUNK
        rows = tq * g
        # Rows of a KV head: (token, query head in the group), token-major.
        qg = q_pad[grp.q_index].view(f, tq, n_kv, g, d).permute(0, 2, 1, 3, 4).reshape(f, n_kv, rows, d)
        k = k_cache[grp.kv_blocks].view(f, lp, n_kv, d).permute(0, 2, 1, 3)
        v = v_cache[grp.kv_blocks].view(f, nc, KEY_CHUNK, n_kv, d).permute(0, 3, 1, 2, 4)
        s = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [f, kv, rows, lp]
        row_pos = grp.row_pos.repeat_interleave(g, dim=1).view(f, 1, rows, 1)
        key_pos = torch.arange(lp, device=q.device).view(1, 1, 1, lp)
        s = s.masked_fill(key_pos > row_pos, NEG_INF).view(f, n_kv, rows, nc, KEY_CHUNK)
        m = s.amax(-1)  # [f, kv, rows, nc]
        m_safe = m.masked_fill(m == NEG_INF, 0.0)
        p = torch.exp(s - m_safe.unsqueeze(-1))
        l_part = p.sum(-1)
        acc = torch.matmul(p.permute(0, 1, 3, 2, 4), v)  # [f, kv, nc, rows, d]
        m_all = m.amax(-1, keepdim=True)
        w = torch.exp(m - m_all.masked_fill(m_all == NEG_INF, 0.0)).transpose(-1, -2)  # [f, kv, nc, rows]
        # Sums over the chunk axis (an outer axis): chunk order, zeros for padding.
        num = (acc * w.unsqueeze(-1)).sum(2)
        den = (l_part.transpose(-1, -2) * w).sum(2)
        o = (num / den.unsqueeze(-1)).view(f, n_kv, tq, g, d).permute(0, 2, 1, 3, 4).reshape(f * tq, n_heads, d)
        out[grp.q_index.reshape(-1)] = o
    return out[:n]


def attention_plain(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttnBatch,
                    scale: float) -> torch.Tensor:
    """The same attention as one masked softmax per group, with no care for
    invariance: only to measure what invariance costs."""
    n, n_heads, d = q.shape
    _, page, n_kv, _ = k_cache.shape
    g = n_heads // n_kv
    out = q.new_empty(n + 1, n_heads, d)
    q_pad = torch.cat([q, q.new_zeros(1, n_heads, d)])
    for grp in batch.groups:
        f, tq = grp.q_index.shape
        lp = grp.key_len
        qg = q_pad[grp.q_index].transpose(1, 2)  # [f, heads, tq, d]
        k = k_cache[grp.kv_blocks].view(f, lp, n_kv, d).transpose(1, 2).repeat_interleave(g, dim=1)
        v = v_cache[grp.kv_blocks].view(f, lp, n_kv, d).transpose(1, 2).repeat_interleave(g, dim=1)
        mask = torch.arange(lp, device=q.device).view(1, 1, 1, lp) <= grp.row_pos.view(f, 1, tq, 1)
        o = torch.nn.functional.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
        out[grp.q_index.reshape(-1)] = o.transpose(1, 2).reshape(f * tq, n_heads, d)
    return out[:n]
