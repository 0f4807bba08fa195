"""The paged KV pool: blocks of `page` cells with reference counts.

A sequence is a block table plus a length. Full blocks are shared between
sequences by reference (seq_copy); a partial block is copied, and a shared
block is copied before anything is written into it (a sequence truncated
into a block it shares, then fed). Block 0 is the trash block: padding in
gathered block tables points at it, nothing is ever kept there. Which
block goes where is engine/blocks.py's; this adds the cells.
"""

from __future__ import annotations

import dataclasses

import torch

from superfluid.engine.blocks import BlockPool, Holder


@dataclasses.dataclass
class SeqState:
    blocks: list[int]
    length: int = 0
    # Bumped by every change but appending (truncate, copy into, import), so a
    # copy of its cells kept elsewhere knows it is stale.
    version: int = 0


class KVPool(BlockPool):
    """K and V of every layer, [layers, blocks, page, kv_heads, head_dim]."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_blocks: int, page: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", heads_major: bool = False):
        if n_blocks < 2:
            raise ValueError(f"a pool needs at least 2 blocks (one is the trash block), got {n_blocks}")
        super().__init__(n_blocks, page, what="KV blocks")
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
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

    @property
    def heads_k(self) -> torch.Tensor:
        """K as stored when heads_major: [layers, kv_heads, blocks, page, head_dim]."""
        return self.k.permute(0, 3, 1, 2, 4)

    @property
    def heads_v(self) -> torch.Tensor:
        return self.v.permute(0, 3, 1, 2, 4)

    # ------------------------------------------------------------ blocks

    def alloc(self, n: int) -> list[int]:
        out = super().alloc(n)
        # A block's cells past its new owner's length still go through the value
        # GEMM with weight 0, and 0 * inf is NaN: nothing a former owner left
        # there (an overflow, an imported inf) may reach another sequence.
        if out:
            self.v.index_fill_(1, torch.tensor(out, device=self.v.device), 0)
        return out

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

    def grow(self, seq: Holder, n: int) -> tuple[int, int] | None:
        """BlockPool.grow, the shared partial block's cells copied into its fresh one."""
        if (moved := super().grow(seq, n)) is not None:
            self.copy_block(*moved)
        return moved

    def truncate(self, seq: SeqState, n: int) -> None:
        self.cut(seq, n)
        seq.length = n
        seq.version += 1

    def copy_prefix(self, src: SeqState, n: int) -> SeqState:
        """A new sequence of the first n cells of src: full blocks shared,
        a partial last block copied."""
        full, rest = divmod(n, self.page)
        out = SeqState(blocks=self.prefix(src, n), length=n)
        if rest:
            self.copy_block(src.blocks[full], out.blocks[-1])
        return out

    def release(self, seq: SeqState) -> None:
        self.decref(seq.blocks)
        seq.blocks = []
        seq.length = 0

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
