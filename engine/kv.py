"""The paged KV pool: blocks of `page` cells with reference counts.

A sequence is a block table plus a length. Full blocks are shared between
sequences by reference (seq_copy); a partial block is copied, and a shared
block is copied before anything is written into it (a sequence truncated
into a block it shares, then fed). Block 0 is the trash block: padding in
gathered block tables points at it, nothing is ever kept there.
"""

from __future__ import annotations

import dataclasses

import torch

from superfluid.engine.runtime import CapacityError

TRASH = 0


@dataclasses.dataclass
class SeqState:
    blocks: list[int]
    length: int = 0
    # Bumped by every change but appending (truncate, copy into, import), so a
    # copy of its cells kept elsewhere knows it is stale.
    version: int = 0


class KVPool:
    """K and V of every layer, [layers, blocks, page, kv_heads, head_dim]."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_blocks: int, page: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", heads_major: bool = False):
        if n_blocks < 2:
            raise ValueError(f"a pool needs at least 2 blocks (one is the trash block), got {n_blocks}")
        if page < 1:
            raise ValueError(f"page must be >= 1, got {page}")
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.n_blocks, self.page = n_blocks, page
        # k/v are always seen as [layers, blocks, page, kv_heads, head_dim]; with
        # heads_major the memory underneath is [layers, kv_heads, blocks, page,
        # head_dim], so one head's cells of a block table gather contiguously.
        self.heads_major = heads_major
        if heads_major:
            shape = (n_layers, n_kv_heads, n_blocks, page, head_dim)
            self.k = torch.zeros(shape, dtype=dtype, device=device).permute(0, 2, 3, 1, 4)
            self.v = torch.zeros(shape, dtype=dtype, device=device).permute(0, 2, 3, 1, 4)
        else:
            shape = (n_layers, n_blocks, page, n_kv_heads, head_dim)
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.refs = [0] * n_blocks
        self.refs[TRASH] = 1  # never handed out, never freed
        self._free = list(range(n_blocks - 1, 0, -1))  # a stack: low ids first

    @property
    def heads_k(self) -> torch.Tensor:
        """K as stored when heads_major: [layers, kv_heads, blocks, page, head_dim]."""
        return self.k.permute(0, 3, 1, 2, 4)

    @property
    def heads_v(self) -> torch.Tensor:
        return self.v.permute(0, 3, 1, 2, 4)

    # ------------------------------------------------------------ blocks

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_used(self) -> int:
        return self.n_blocks - 1 - len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CapacityError(f"{n} KV blocks wanted, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self.refs[b] = 1
        # A block's cells past its new owner's length still go through the value
        # GEMM with weight 0, and 0 * inf is NaN: nothing a former owner left
        # there (an overflow, an imported inf) may reach another sequence.
        if out:
            self.v.index_fill_(1, torch.tensor(out, device=self.v.device), 0)
        return out

    def incref(self, blocks) -> None:
        for b in blocks:
            self.refs[b] += 1

    def decref(self, blocks) -> None:
        for b in blocks:
            r = self.refs[b] - 1
            self.refs[b] = r
            if r == 0:
                self._free.append(b)
            elif r < 0:  # a bookkeeping bug, never the caller's input
                raise AssertionError(f"block {b} released more often than taken")

    def copy_block(self, src: int, dst: int) -> None:
        self.k[:, dst].copy_(self.k[:, src])
        self.v[:, dst].copy_(self.v[:, src])

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.n_layers * self.page * self.n_kv_heads * self.head_dim * self.k.element_size()

    @property
    def allocated_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()  # numel of the view is the storage's

    # --------------------------------------------------------- sequences

    def blocks_for(self, length: int) -> int:
        return -(-length // self.page)

    def grow_cost(self, seq: SeqState, n: int) -> int:
        """New blocks that appending n cells to seq takes (copy-on-write of a
        shared partial last block included)."""
        if n <= 0:
            return 0
        return self.blocks_for(seq.length + n) - len(seq.blocks) + (self.cow_block(seq) is not None)

    def cow_block(self, seq: SeqState) -> int | None:
        """The shared partial last block that appending to seq must copy first."""
        if seq.length % self.page and self.refs[seq.blocks[-1]] > 1:
            return seq.blocks[-1]
        return None

    def grow(self, seq: SeqState, n: int) -> None:
        """Make room for n more cells: blocks allocated, a shared partial
        last block copied first. Call grow_cost first; this allocates."""
        if n <= 0:
            return
        if seq.length % self.page and self.refs[seq.blocks[-1]] > 1:
            (fresh,) = self.alloc(1)
            self.copy_block(seq.blocks[-1], fresh)
            self.decref([seq.blocks[-1]])
            seq.blocks[-1] = fresh
        extra = self.blocks_for(seq.length + n) - len(seq.blocks)
        if extra > 0:
            seq.blocks.extend(self.alloc(extra))

    def truncate(self, seq: SeqState, n: int) -> None:
        keep = self.blocks_for(n)
        self.decref(seq.blocks[keep:])
        del seq.blocks[keep:]
        seq.length = n
        seq.version += 1

    def copy_prefix(self, src: SeqState, n: int) -> SeqState:
        """A new sequence of the first n cells of src: full blocks shared,
        a partial last block copied."""
        full, rest = divmod(n, self.page)
        shared = src.blocks[:full]
        out = SeqState(blocks=list(shared), length=n)
        if rest:
            (fresh,) = self.alloc(1)
            self.copy_block(src.blocks[full], fresh)
            out.blocks.append(fresh)
        self.incref(shared)
        return out

    def release(self, seq: SeqState) -> None:
        self.decref(seq.blocks)
        seq.blocks = []
        seq.length = 0

    def released_by(self, seqs: list[SeqState]) -> int:
        """Blocks that dropping all of seqs would free."""
        drops: dict[int, int] = {}
        for s in seqs:
            for b in s.blocks:
                drops[b] = drops.get(b, 0) + 1
        return sum(1 for b, d in drops.items() if self.refs[b] == d)

    # ---------------------------------------------------- cells as bytes

    def _where(self, seq: SeqState, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block and offset of positions [start, stop)."""
        pos = torch.arange(start, stop)
        blocks = torch.tensor(seq.blocks, dtype=torch.long)[pos // self.page]
        return blocks.to(self.k.device), (pos % self.page).to(self.k.device)

    def read_cells(self, seq: SeqState) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the sequence's cells, [layers, length, kv_heads, head_dim]."""
        b, o = self._where(seq, 0, seq.length)
        return self.k[:, b, o], self.v[:, b, o]

    def write_cells(self, seq: SeqState, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write [layers, n, kv_heads, head_dim] cells at positions [start, start + n)."""
        b, o = self._where(seq, start, start + k.shape[1])
        self.k[:, b, o] = k.to(self.k.dtype)
        self.v[:, b, o] = v.to(self.v.dtype)
