"""The prefix cache: sequences kept after their lane retired, keyed by tokens.

An entry owns its runtime sequence. Pins (seed leases) move an entry from
evictable to protected; eviction takes the least recently used unpinned
entries first and reports what left, so a tick's shed report reconciles
with the cache's counters (SPEC §6).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable


@dataclasses.dataclass
class CacheEntry:
    seq: int
    tokens: tuple[int, ...]  # the cells' tokens (whole pages, or exact on exact_only runtimes)
    prompt_len: int  # how much of the key was the lane's prompt
    bytes: int
    last_used: int  # tick of the last publish or use
    order: int  # insertion order: the LRU tie-break
    pins: int = 0
    seeded: int = 0


@dataclasses.dataclass(frozen=True)
class Eviction:
    """What one eviction freed, for a ShedEntry."""

    seq: int
    bytes: int
    tokens: int


class PrefixCache:
    def __init__(self) -> None:
        self.entries: dict[int, CacheEntry] = {}  # by seq
        self._order = 0

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return iter(self.entries.values())

    def get(self, seq: int) -> CacheEntry | None:
        return self.entries.get(seq)

    def find(self, tokens: tuple[int, ...]) -> CacheEntry | None:
        for e in self.entries.values():
            if e.tokens == tokens:
                return e
        return None

    def insert(self, seq: int, tokens: tuple[int, ...], prompt_len: int, nbytes: int, now: int) -> CacheEntry:
        self._order += 1
        e = CacheEntry(seq, tokens, prompt_len, nbytes, now, self._order)
        self.entries[seq] = e
        return e

    def remove(self, seq: int) -> CacheEntry:
        return self.entries.pop(seq)

    @property
    def resident_bytes(self) -> int:
        return sum(e.bytes for e in self.entries.values())

    @property
    def unpinned_bytes(self) -> int:
        return sum(e.bytes for e in self.entries.values() if e.pins == 0)

    def lru(self) -> list[CacheEntry]:
        """Unpinned entries, least recently used first."""
        return sorted((e for e in self.entries.values() if e.pins == 0), key=lambda e: (e.last_used, e.order))

    def plan_evict_until(self, cap_bytes: int, enough: Callable[[list[CacheEntry]], bool]
                         ) -> tuple[list[CacheEntry], bool]:
        """The LRU entries to evict, at most cap_bytes of them, until
        enough(picked) holds; (picked, whether enough was reached)."""
        picked: list[CacheEntry] = []
        if enough(picked):
            return picked, True
        spent = 0
        for e in self.lru():
            if spent + e.bytes > cap_bytes:
                break
            picked.append(e)
            spent += e.bytes
            if enough(picked):
                return picked, True
        return picked, False

    def seqs(self) -> Iterable[int]:
        return self.entries.keys()
