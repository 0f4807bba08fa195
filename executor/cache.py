"""The prefix cache: sequences kept after their lane retired, keyed by tokens.

An entry is resident (it owns a runtime sequence) or exported (its state is
a blob in host memory, the host tier). Pins (seed leases) protect an entry
from eviction. Lookup walks a trie of whole pages: a node is one page of
tokens under its parent, so a hit compares the page and, through the path,
every page before it; the longest usable prefix costs O(pages asked), not
O(entries) (contract §6).
"""

from __future__ import annotations

import builtins
import dataclasses
from collections.abc import Callable, Iterator, Sequence


@dataclasses.dataclass(eq=False)
class CacheEntry:
    eid: int
    seq: int | None  # the runtime sequence; None once exported to host memory
    tokens: tuple[int, ...]  # the cells' tokens (whole pages, or exact on exact_only runtimes)
    prompt_len: int  # how much of the key was the lane's prompt
    bytes: int  # what it holds in the pool while resident (cells x cell bytes)
    last_used: int  # tick of the last publish or seeding use
    order: int  # insertion order: the LRU tie-break
    pins: int = 0  # live seed leases on it
    seeded: int = 0  # admits that copied from it
    blob: builtins.bytes | None = None  # the exported state (host tier); `bytes` is the field above
    checkpoint: bool = False  # made by the executor on its own: given back whenever a plan needs room
    bare: bool = False  # an imported sequence its import lease may still adopt

    @property
    def resident(self) -> bool:
        return self.seq is not None

    def resident_seq(self) -> int:
        """The sequence of an entry the caller knows is resident."""
        assert self.seq is not None
        return self.seq

    def exported_blob(self) -> builtins.bytes:
        """The state of an entry the caller knows is exported."""
        assert self.blob is not None
        return self.blob


class _Node:
    __slots__ = ("children", "ends", "key", "parent", "through")

    def __init__(self, parent: _Node | None, key: tuple[int, ...]) -> None:
        self.children: dict[tuple[int, ...], _Node] = {}
        self.through: set[int] = set()  # entries holding every page down to here
        self.ends: set[int] = set()  # entries whose whole pages end here (their tail is shorter than a page)
        self.parent, self.key = parent, key


class PrefixCache:
    """The entries, and the limits the executor keeps them within: max_bytes
    for resident entries (None: no limit), host_max_bytes for exported ones
    (0: no host tier)."""

    def __init__(self, page: int, max_bytes: int | None = None, host_max_bytes: int = 0) -> None:
        self.page = max(1, page)
        self.max_bytes = max_bytes
        self.host_max_bytes = max(0, host_max_bytes)
        self.entries: dict[int, CacheEntry] = {}  # by eid
        self._by_seq: dict[int, CacheEntry] = {}
        self._root = _Node(None, ())
        self._next = 0
        # Totals kept as entries come, go and move to the host tier: read every tick.
        self._resident_bytes = 0
        self._host_bytes = 0
        self._unpinned_bytes = 0  # resident entries no lease pins: what an eviction could give back

    # ------------------------------------------------------------ reading

    def __len__(self) -> int:
        """Resident entries (each holds a runtime sequence)."""
        return len(self._by_seq)

    def __iter__(self) -> Iterator[CacheEntry]:
        """Resident entries."""
        return iter(list(self._by_seq.values()))

    def all(self) -> list[CacheEntry]:
        return list(self.entries.values())

    def exported(self) -> list[CacheEntry]:
        return [e for e in self.entries.values() if not e.resident]

    def get(self, eid: int) -> CacheEntry | None:
        return self.entries.get(eid)

    def by_seq(self, seq: int) -> CacheEntry | None:
        return self._by_seq.get(seq)

    @property
    def resident_bytes(self) -> int:
        return self._resident_bytes

    @property
    def host_bytes(self) -> int:
        return self._host_bytes

    @staticmethod
    def _host_size(e: CacheEntry) -> int:
        return len(e.blob) if not e.resident and e.blob is not None else 0

    @property
    def unpinned_bytes(self) -> int:
        return self._unpinned_bytes

    def lru(self, *, resident: bool = True) -> list[CacheEntry]:
        """Unpinned entries (resident, or exported), least recently used first."""
        return sorted((e for e in self.entries.values() if e.pins == 0 and e.resident == resident),
                      key=lambda e: (e.last_used, e.order))

    # ------------------------------------------------------------ lookup

    def _walk(self, tokens: Sequence[int], pages: int) -> list[_Node]:
        """The trie path of tokens' first `pages` whole pages (root first),
        as deep as it exists."""
        p = self.page
        node: _Node | None = self._root
        path = [self._root]
        for k in range(pages):
            assert node is not None
            node = node.children.get(tuple(tokens[k * p:(k + 1) * p]))
            if node is None:
                break
            path.append(node)
        return path

    def covering(self, tokens: Sequence[int]) -> tuple[int, list[CacheEntry]]:
        """The longest whole-page prefix of `tokens` that entries hold, and
        those entries: (pages, entries); (0, []) when none shares a page."""
        path = self._walk(tokens, len(tokens) // self.page)
        if len(path) == 1:
            return 0, []
        return len(path) - 1, [self.entries[i] for i in path[-1].through]

    def longest_exact(self, tokens: Sequence[int]) -> CacheEntry | None:
        """exact_only: the longest entry whose whole key is a prefix of tokens."""
        p = self.page
        best: CacheEntry | None = None
        for depth, node in enumerate(self._walk(tokens, len(tokens) // p)):
            for i in node.ends:
                e = self.entries[i]
                n = len(e.tokens)
                if n <= len(tokens) and e.tokens[depth * p:] == tuple(tokens[depth * p:n]):
                    if best is None or n > len(best.tokens) or (n == len(best.tokens) and _better(e, best)):
                        best = e
        return best

    def page_prefixes(self, tokens: Sequence[int]) -> list[CacheEntry]:
        """Entries whose whole key is a shorter whole-page prefix of tokens (one walk)."""
        out = []
        for depth, node in enumerate(self._walk(tokens, len(tokens) // self.page)):
            for i in node.ends:
                e = self.entries[i]
                if 0 < len(e.tokens) == depth * self.page < len(tokens):
                    out.append(e)
        return out

    def find(self, tokens: tuple[int, ...]) -> CacheEntry | None:
        """An entry keyed exactly by tokens."""
        for e in self.containing(tokens):
            if len(e.tokens) == len(tokens):
                return e
        return None

    def containing(self, tokens: tuple[int, ...]) -> list[CacheEntry]:
        """Entries whose key starts with all of `tokens`."""
        p = self.page
        full = len(tokens) // p
        path = self._walk(tokens, full)
        if len(path) - 1 < full:
            return []
        node = path[-1]
        out = []
        for i in node.through | node.ends if full else set(self.entries):
            e = self.entries[i]
            if len(e.tokens) >= len(tokens) and e.tokens[full * p:len(tokens)] == tuple(tokens[full * p:]):
                out.append(e)
        return out

    # ---------------------------------------------------------- changing

    def insert(self, seq: int | None, tokens: tuple[int, ...], prompt_len: int, nbytes: int, now: int, *,
               checkpoint: bool = False, bare: bool = False, blob: bytes | None = None) -> CacheEntry:
        self._next += 1
        e = CacheEntry(self._next, seq, tuple(tokens), prompt_len, nbytes, now, self._next, checkpoint=checkpoint,
                       bare=bare, blob=blob)
        self.entries[e.eid] = e
        if seq is not None:
            self._by_seq[seq] = e
            self._resident_bytes += e.bytes
            self._unpinned_bytes += e.bytes
        self._host_bytes += self._host_size(e)
        p = self.page
        node = self._root
        for k in range(len(e.tokens) // p):
            key = e.tokens[k * p:(k + 1) * p]
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(node, key)
            node = child
            node.through.add(e.eid)
        node.ends.add(e.eid)
        return e

    def remove(self, e: CacheEntry) -> None:
        del self.entries[e.eid]
        if e.seq is not None:
            del self._by_seq[e.seq]
            self._resident_bytes -= e.bytes
            if not e.pins:
                self._unpinned_bytes -= e.bytes
        self._host_bytes -= self._host_size(e)
        path = self._walk(e.tokens, len(e.tokens) // self.page)
        path[-1].ends.discard(e.eid)
        for node in path[1:]:
            node.through.discard(e.eid)
        for node in reversed(path[1:]):  # prune what no entry passes through any more
            if node.through or node.ends or node.children:
                break
            parent = node.parent
            assert parent is not None  # path[1:] holds no root
            del parent.children[node.key]

    def set_exported(self, e: CacheEntry, blob: bytes) -> None:
        """The entry's state left the pool for host memory."""
        del self._by_seq[e.resident_seq()]
        self._resident_bytes -= e.bytes
        if not e.pins:
            self._unpinned_bytes -= e.bytes
        e.seq, e.blob, e.checkpoint = None, blob, False
        self._host_bytes += self._host_size(e)

    def pin(self, e: CacheEntry, by: int = 1) -> None:
        """A lease starts (by=1) or ends (by=-1) on e: pins change only here,
        so unpinned_bytes stays the sum it stands for."""
        was = e.pins
        e.pins = was + by
        if e.seq is not None and self._by_seq.get(e.seq) is e and (was == 0) != (e.pins == 0):
            self._unpinned_bytes += e.bytes if e.pins == 0 else -e.bytes

    def plan_evict(self, cap_bytes: int, enough: Callable[[list[CacheEntry]], bool],
                   candidates: list[CacheEntry] | None = None) -> tuple[list[CacheEntry], bool]:
        """Resident unpinned entries to evict, least recently used first, at
        most cap_bytes of them, until enough(picked) holds: (picked, whether
        enough was reached). An entry larger than what the cap has left is
        skipped, not a stop: a smaller, newer one may still fit."""
        picked: list[CacheEntry] = []
        if enough(picked):
            return picked, True
        spent = 0
        for e in self.lru() if candidates is None else candidates:
            if spent + e.bytes > cap_bytes:
                continue
            picked.append(e)
            spent += e.bytes
            if enough(picked):
                return picked, True
        return picked, False


def _better(a: CacheEntry, b: CacheEntry) -> bool:
    """Of two entries holding the same prefix, the one a lease should take:
    resident before exported, then the most recently used."""
    return (a.resident, a.last_used, a.order) > (b.resident, b.last_used, b.order)


def best_of(entries: list[CacheEntry]) -> CacheEntry:
    best = entries[0]
    for e in entries[1:]:
        if _better(e, best):
            best = e
    return best
