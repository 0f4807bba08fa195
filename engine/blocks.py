"""Block allocation without tensors: a refcounted pool of block ids.

Blocks are handed out from a free stack, the lowest id first; a block whose
last holder lets go goes back on top and is the next one out. With `trash`,
block 0 is never handed out nor freed (padding in gathered block tables
points at it). `n_blocks` None: no limit.

A holder is anything with a block table (`blocks`) and a length in cells
(`length`); the page arithmetic here (how many blocks a length takes, which
shared partial block an append copies first, what dropping holders frees)
is the same for every paged runtime, whatever its blocks hold.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Protocol

from superfluid.engine.runtime import CapacityError

TRASH = 0


class Holder(Protocol):
    blocks: list[int]

    @property
    def length(self) -> int: ...


class BlockPool:
    """`n_blocks` blocks of `page` cells (the trash block among them); `what`
    names them in a CapacityError."""

    def __init__(self, n_blocks: int | None, page: int = 1, *, trash: bool = True, what: str = "blocks"):
        if page < 1:
            raise ValueError(f"page must be >= 1, got {page}")
        self.n_blocks, self.page = n_blocks, page
        self._what = what
        self._first = 1 if trash else 0
        self.refs: list[int] = [1] if trash else []  # the trash block: never handed out, never freed
        self._free: list[int] = []  # released blocks; ids past len(refs) were never handed out

    @property
    def n_used(self) -> int:
        return len(self.refs) - self._first - len(self._free)

    @property
    def n_free(self) -> int:
        """Blocks alloc can hand out (sys.maxsize without a limit)."""
        if self.n_blocks is None:
            return sys.maxsize
        return self.n_blocks - self._first - self.n_used

    def fits(self, n: int) -> bool:
        return n <= self.n_free

    def alloc(self, n: int) -> list[int]:
        if n > self.n_free:
            raise CapacityError(f"{n} {self._what} wanted, {self.n_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b = len(self.refs)
                self.refs.append(0)
            self.refs[b] = 1
            out.append(b)
        return out

    def incref(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            self.refs[b] += 1

    def decref(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            r = self.refs[b] - 1
            self.refs[b] = r
            if r == 0:
                self._free.append(b)
            elif r < 0:  # a bookkeeping bug, never the caller's input
                raise AssertionError(f"block {b} released more often than taken")

    # ------------------------------------------------------------ holders

    def blocks_for(self, length: int) -> int:
        return -(-length // self.page)

    def cow_block(self, h: Holder) -> int | None:
        """The shared partial last block that appending to h must copy first."""
        if h.length % self.page and self.refs[h.blocks[-1]] > 1:
            return h.blocks[-1]
        return None

    def grow_cost(self, h: Holder, n: int) -> int:
        """New blocks that appending n cells to h takes (copy-on-write of a
        shared partial last block included)."""
        if n <= 0:
            return 0
        return self.blocks_for(h.length + n) - len(h.blocks) + (self.cow_block(h) is not None)

    def grow(self, h: Holder, n: int) -> tuple[int, int] | None:
        """Blocks for n more cells after h's length: a shared partial last
        block swapped for a fresh one first, returned as (shared, fresh) so its
        contents can be copied. Check grow_cost first; this allocates."""
        if n <= 0:
            return None
        old = self.cow_block(h)
        # Everything is allocated before h changes: a CapacityError leaves h as it was.
        fresh = self.alloc((old is not None) + max(0, self.blocks_for(h.length + n) - len(h.blocks)))
        moved = None
        if old is not None:
            self.decref([old])  # still held elsewhere (shared), so not freed
            h.blocks[-1] = fresh[0]
            moved = (old, fresh.pop(0))
        h.blocks.extend(fresh)
        return moved

    def cut(self, h: Holder, n: int) -> None:
        """Let go of h's blocks past the first n cells (h's length is the caller's)."""
        keep = self.blocks_for(n)
        self.decref(h.blocks[keep:])
        del h.blocks[keep:]

    def prefix(self, src: Holder, n: int, share: bool = True) -> list[int]:
        """A block table for the first n cells of src: its full blocks shared
        (with share), fresh blocks for the rest, contents the caller's."""
        shared = src.blocks[:n // self.page] if share else []
        fresh = self.alloc(self.blocks_for(n) - len(shared))
        self.incref(shared)
        return shared + fresh

    def released_by(self, holders: Iterable[Holder]) -> int:
        """Blocks that dropping all of holders would free."""
        drops: dict[int, int] = {}
        for h in holders:
            for b in h.blocks:
                drops[b] = drops.get(b, 0) + 1
        return sum(1 for b, d in drops.items() if self.refs[b] == d)
