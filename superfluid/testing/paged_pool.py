"""The exact model of a paged pool's cell accounting that the conformance
checks hold a runtime to when its factory opts in (paged_model)."""

from __future__ import annotations

import collections
from collections.abc import Sequence

from superfluid.testing.runtime_harness import pages


class PagedPool:
    """Reference cell accounting of a paged pool, which the fakes follow
    exactly: a sequence holds ceil(len/page) blocks; a copy shares the full
    blocks of its source (when sharing) and takes a fresh block for the
    partial one; the first write into a partial block another sequence still
    holds copies it (one block); cells_used counts each block once."""

    def __init__(self, page: int, cells_total: int, shares: bool):
        self.page, self.total, self.shares = page, cells_total // page, shares
        self.rc: dict[int, int] = {}
        self.blocks: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self._next = 0

    def used(self) -> int:
        return len(self.rc) * self.page

    def fits(self, more_blocks: int) -> bool:
        return self.total == 0 or len(self.rc) + more_blocks <= self.total

    def _new(self) -> int:
        self._next += 1
        self.rc[self._next] = 1
        return self._next

    def _drop(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self.rc[b] -= 1
            if not self.rc[b]:
                del self.rc[b]

    def add(self, seq: int) -> None:
        self.blocks[seq], self.lens[seq] = [], 0

    def _cow(self, seq: int) -> bool:
        return self.lens[seq] % self.page != 0 and self.rc[self.blocks[seq][-1]] > 1

    def feed_need(self, feeds: Sequence[tuple[int, int]]) -> int:
        return sum(pages(self.lens[s] + k, self.page) - len(self.blocks[s]) + self._cow(s) for s, k in feeds)

    def feed(self, seq: int, k: int) -> None:
        if self._cow(seq):
            self._drop(self.blocks[seq][-1:])
            self.blocks[seq][-1] = self._new()
        self.lens[seq] += k
        while len(self.blocks[seq]) < pages(self.lens[seq], self.page):
            self.blocks[seq].append(self._new())

    def copy_need(self, src: int, dst: int, n: int) -> int:
        shared = n // self.page if self.shares else 0
        delta = collections.Counter(self.blocks[src][:shared])
        delta.subtract(self.blocks[dst])
        freed = sum(1 for b, k in delta.items() if self.rc[b] + k == 0)
        return pages(n, self.page) - shared - freed

    def copy(self, src: int, dst: int, n: int) -> None:
        shared = n // self.page if self.shares else 0
        kept = self.blocks[src][:shared]
        for b in kept:
            self.rc[b] += 1
        kept = kept + [self._new() for _ in range(pages(n, self.page) - shared)]
        self._drop(self.blocks[dst])
        self.blocks[dst], self.lens[dst] = kept, n

    def truncate(self, seq: int, n: int) -> None:
        keep = pages(n, self.page)
        self._drop(self.blocks[seq][keep:])
        del self.blocks[seq][keep:]
        self.lens[seq] = n

    def import_(self, seq: int, n: int) -> None:
        self.blocks[seq] = [self._new() for _ in range(pages(n, self.page))]
        self.lens[seq] = n

    def free(self, seq: int) -> None:
        self._drop(self.blocks.pop(seq))
        del self.lens[seq]

    def released(self, seqs: Sequence[int]) -> int:
        held = collections.Counter(b for s in set(seqs) for b in self.blocks[s])
        return self.page * sum(1 for b, k in held.items() if k == self.rc[b])
