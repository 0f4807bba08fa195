"""Seed leases (contract §6, §7): a pin on the cache entry holding the longest
usable prefix of some tokens, for a number of accepted ticks; an admit that
names the lease starts from that prefix instead of prefilling it.

How an admit's prefix gets into its lane's sequence (chosen by the memory
check, contract §3 step 9):
- copy: a new sequence copies the entry's cells (full blocks shared where
  the runtime shares cells);
- takeover: the lane takes the entry's own sequence, cut to the seed, when
  nothing else holds it (preferred where the runtime says so and the seed
  continues the entry; else only when memory is short);
- import: the entry lives in host memory: its blob comes back into a new
  sequence, cut to the seed;
- adopt: an IMPORT_STATE lease takes the bare sequence it imported.
A lease that covers the whole prompt keeps its last token out of the
sequence: it is the lane's pending input, so the lane decodes at once.

Export blobs (EXPORT_ENTRY / IMPORT_STATE) wrap the runtime's own blob with
the runtime id and the tokens it holds, so a blob of another runtime, or an
import under tokens the state was not made from, is refused by name.
"""

from __future__ import annotations

import collections
import dataclasses
import struct
from collections.abc import Iterator, Sequence

from superfluid.executor.cache import CacheEntry, PrefixCache, best_of

# Leases live at once unless the executor is told otherwise.
DEFAULT_MAX_LEASES = 1024
_EXPIRED_REMEMBERED = 4096  # expired handles kept for a clear StaleSeed message

_ENVELOPE_MAGIC = b"SFEX"
_ENVELOPE_HEAD = struct.Struct("<4sIII")  # magic, version, runtime id bytes, tokens
_INNER_LEN = struct.Struct("<Q")


@dataclasses.dataclass(eq=False)
class SeedLease:
    handle: int
    entry: CacheEntry
    prefix: tuple[int, ...]  # the tokens it covers: the op's `value`
    determinism: int
    expires: int  # usable while the executor's accepted ticks are below this
    adopt: bool = False  # IMPORT_STATE's: may take its bare entry's sequence itself


@dataclasses.dataclass
class SeedUse:
    """One admit's use of a lease, as the check worked it out."""

    lease: SeedLease
    n: int  # prompt tokens the lease covers (the lane's prefilled count)
    keep: int  # cells the lane starts with: n, or n - 1 when the lease covers the whole prompt
    path: str = "copy"  # "copy", "import", "adopt" or "takeover"

    @property
    def full(self) -> bool:
        return self.keep < self.n

    @property
    def entry(self) -> CacheEntry:
        return self.lease.entry


class LeaseTable:
    """The seed leases by handle, and the recently expired ones' handles."""

    def __init__(self, cache: PrefixCache, capacity: int = DEFAULT_MAX_LEASES) -> None:
        if capacity < 1:
            raise ValueError(f"a lease table holds at least 1 lease, not {capacity}")
        self.capacity = capacity
        self.cache = cache  # the one whose entries the leases pin
        self.leases: dict[int, SeedLease] = {}
        self.expired: collections.OrderedDict[int, int] = collections.OrderedDict()  # handle -> expiry tick

    def __len__(self) -> int:
        return len(self.leases)

    def __iter__(self) -> Iterator[SeedLease]:
        return iter(list(self.leases.values()))

    def get(self, handle: int) -> SeedLease | None:
        return self.leases.get(handle)

    @property
    def full(self) -> bool:
        return len(self.leases) >= self.capacity

    def add(self, lease: SeedLease) -> None:
        self.cache.pin(lease.entry)
        self.leases[lease.handle] = lease

    def drop(self, lease: SeedLease) -> None:
        """The lease ends (released, expired or consumed by an admit that
        left the entry in the cache): its pin goes."""
        del self.leases[lease.handle]
        e = lease.entry
        self.cache.pin(e, -1)
        if lease.adopt:
            e.bare = False  # nobody adopts it now: an ordinary entry from here on

    def consume(self, lease: SeedLease) -> None:
        """An admit took the lease's entry itself (takeover, adoption): the
        entry left the cache, so there is no pin to drop."""
        del self.leases[lease.handle]

    def sweep(self, accepted_ticks: int) -> list[SeedLease]:
        """contract §3 step 3: leases whose ticks are up end."""
        if not self.leases:
            return []
        gone = [ls for ls in self.leases.values() if accepted_ticks >= ls.expires]
        for ls in gone:
            self.drop(ls)
            self.expired[ls.handle] = ls.expires
            if len(self.expired) > _EXPIRED_REMEMBERED:
                self.expired.popitem(last=False)
        return gone


def find_prefix(cache: PrefixCache, tokens: Sequence[int], exact_only: bool) -> tuple[CacheEntry, int] | None:
    """The entry with the longest usable prefix of tokens and its length:
    whole pages, or an exact_only entry's whole key; None when nothing shares one."""
    if exact_only:
        e = cache.longest_exact(tokens)
        return (e, len(e.tokens)) if e is not None else None
    pages, entries = cache.covering(tokens)
    if not pages:
        return None
    return best_of(entries), pages * cache.page


def is_bare(lease: SeedLease) -> bool:
    """An import lease's sequence is still only its own: no other lease pins
    it and no admit copied from it."""
    e = lease.entry
    return e.bare and e.resident and e.pins == 1 and e.seeded == 0


# ------------------------------------------------------------- envelopes


class EnvelopeError(ValueError):
    pass


def wrap(runtime_id: str, tokens: Sequence[int], inner: bytes) -> bytes:
    rid = runtime_id.encode()
    toks = struct.pack(f"<{len(tokens)}I", *tokens)
    return _ENVELOPE_HEAD.pack(_ENVELOPE_MAGIC, 1, len(rid), len(tokens)) + rid + toks + _INNER_LEN.pack(
        len(inner)) + inner


def unwrap(blob: bytes) -> tuple[str, tuple[int, ...], bytes]:
    """(runtime id, tokens, the runtime's blob); EnvelopeError naming what is wrong."""
    view = memoryview(blob)
    if len(view) < _ENVELOPE_HEAD.size:
        raise EnvelopeError(f"a blob of {len(view)} bytes is shorter than an export header")
    magic, version, rid_len, n = _ENVELOPE_HEAD.unpack_from(view)
    if magic != _ENVELOPE_MAGIC or version != 1:
        raise EnvelopeError(f"not an EXPORT_ENTRY blob (magic {bytes(magic)!r}, version {version})")
    at = _ENVELOPE_HEAD.size
    end = at + rid_len + 4 * n + _INNER_LEN.size
    if end > len(view):
        raise EnvelopeError(f"a truncated export blob ({len(view)} bytes, its header says more)")
    try:
        rid = bytes(view[at:at + rid_len]).decode()
    except UnicodeDecodeError:
        raise EnvelopeError("an export blob whose runtime id is not UTF-8") from None
    at += rid_len
    tokens = struct.unpack_from(f"<{n}I", view, at)
    at += 4 * n
    (inner_len,) = _INNER_LEN.unpack_from(view, at)
    at += _INNER_LEN.size
    if at + inner_len != len(view):
        raise EnvelopeError(f"an export blob of {len(view)} bytes, its header says {at + inner_len}")
    return rid, tokens, bytes(view[at:])
