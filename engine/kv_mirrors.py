"""Decode groups' K/V kept dense across steps, beside the paged pool (TransformerRuntime's)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from superfluid.engine.kv import KVPool, SeqState
from superfluid.engine.runtime import Feed
from superfluid.kernels.attention import KEY_CHUNK, DenseKV


class Mirror:
    __slots__ = ("k", "lengths", "seqs", "v", "versions")

    def __init__(self, seqs, versions, lengths, k, v):
        self.seqs, self.versions, self.lengths, self.k, self.v = seqs, versions, lengths, k, v


class DecodeMirrors:
    """Decode groups' cells kept dense across steps (kernels/attention.DenseKV).

    A steady decode batch would otherwise gather every cell of every lane
    from the pool at every layer of every step. A mirror is keyed by its
    sequences in group order and good while each sequence's version and
    length are what the mirror last saw; otherwise it is rebuilt from the
    pool (one gather). Only the newest few are kept, within a byte budget. A
    group whose mirror would be mostly padding (one long sequence among short
    ones: every row is as long as the longest) or would not fit the budget
    reads the pool instead."""

    KEEP = 4
    HEADROOM = 128  # cells of room past the longest sequence, so appends rarely rebuild

    def __init__(self, budget_bytes: int):
        self.entries: dict[tuple[int, ...], Mirror] = {}
        self.budget = budget_bytes

    @property
    def bytes(self) -> int:
        return sum(2 * m.k.numel() * m.k.element_size() for m in self.entries.values())

    def forget(self, seq: int) -> None:
        for key in [k for k in self.entries if seq in k]:
            del self.entries[key]

    def attach(self, pool: KVPool, batch, feeds: Sequence[Feed], states: list[SeqState]) -> list[Mirror]:
        used = []
        for grp in batch.groups:
            if grp.max_tokens != 1:
                continue
            key = tuple(feeds[i].seq for i in grp.feeds)
            members = [states[i] for i in grp.feeds]
            lengths = [s.length for s in members]
            versions = [s.version for s in members]
            m = self.entries.pop(key, None)
            if m is None or m.versions != versions or m.lengths != lengths or m.k.shape[3] <= max(lengths):
                # (first use, a member changed, or no room for this step's cells)
                cells = len(members) * self._cap(pool, max(lengths))
                if (cells > 2 * (sum(lengths) + len(members) * self.HEADROOM)
                        or cells * (pool.bytes_per_block // pool.page) > self.budget):
                    continue  # this group gathers from the pool each step
                m = self._build(pool, key, members, versions, lengths)
            self.entries[key] = m  # newest last
            while len(self.entries) > self.KEEP or self.bytes > self.budget:
                del self.entries[next(iter(self.entries))]
            first = grp.q_index[:, 0]
            grp.dense = DenseKV(m.k, m.v, grp.row_pos[:, 0], batch.cells[first])
            used.append(m)
        return used

    def _cap(self, pool: KVPool, longest: int) -> int:
        unit = KEY_CHUNK * pool.page // math.gcd(KEY_CHUNK, pool.page)
        return -(-(longest + self.HEADROOM) // unit) * unit

    def _build(self, pool: KVPool, key, members: list[SeqState], versions, lengths) -> Mirror:
        cap = self._cap(pool, max(lengths))
        nb = cap // pool.page
        table = torch.zeros((len(members), nb), dtype=torch.long)
        for i, s in enumerate(members):
            b = s.blocks[:nb]
            table[i, :len(b)] = torch.tensor(b, dtype=torch.long)
        flat = table.reshape(-1).to(pool.k.device)
        layers, kvh, f, d = pool.n_layers, pool.n_kv_heads, len(members), pool.head_dim
        k = pool.heads_k.index_select(2, flat).view(layers, kvh, f, cap, d)
        v = (pool.heads_v.index_select(2, flat).view(layers, kvh, f, cap // KEY_CHUNK, KEY_CHUNK, d)
             .permute(0, 3, 1, 2, 4, 5).contiguous())
        return Mirror(key, versions, list(lengths), k, v)
