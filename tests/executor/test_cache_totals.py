"""The prefix cache keeps its byte totals as entries come, go and move to the
host tier (they are read every tick); they equal the sums over its entries."""

from __future__ import annotations

from superfluid.executor.cache import PrefixCache


def _sums(c: PrefixCache) -> tuple[int, int]:
    resident = sum(e.bytes for e in c.all() if e.resident)
    host = sum(len(e.blob) for e in c.all() if not e.resident and e.blob is not None)
    return resident, host


def test_byte_totals_follow_inserts_exports_and_removes():
    c = PrefixCache(4)
    a = c.insert(1, tuple(range(8)), 8, 800, 0)
    b = c.insert(2, tuple(range(4)), 4, 400, 0)
    d = c.insert(None, tuple(range(12)), 12, 1200, 0, blob=b"x" * 50)  # an import kept on the host
    assert (c.resident_bytes, c.host_bytes) == _sums(c) == (1200, 50)
    c.set_exported(a, b"y" * 30)
    assert (c.resident_bytes, c.host_bytes) == _sums(c) == (400, 80)
    c.remove(a)
    c.remove(d)
    assert (c.resident_bytes, c.host_bytes) == _sums(c) == (400, 0)
    c.remove(b)
    assert (c.resident_bytes, c.host_bytes) == (0, 0) and len(c) == 0


def _unpinned(c: PrefixCache) -> int:
    return sum(e.bytes for e in c.all() if e.resident and e.pins == 0)


def test_unpinned_bytes_follow_pins_exports_and_removes():
    c = PrefixCache(4)
    a = c.insert(1, tuple(range(8)), 8, 800, 0)
    b = c.insert(2, tuple(range(4)), 4, 400, 0)
    h = c.insert(None, tuple(range(12)), 12, 1200, 0, blob=b"x" * 50)
    assert c.unpinned_bytes == _unpinned(c) == 1200
    c.pin(a)
    c.pin(a)  # two leases on one entry
    c.pin(h)  # a host entry holds nothing in the pool, pinned or not
    assert c.unpinned_bytes == _unpinned(c) == 400
    c.pin(a, -1)
    assert c.unpinned_bytes == _unpinned(c) == 400  # one lease left
    c.pin(a, -1)
    assert c.unpinned_bytes == _unpinned(c) == 1200
    c.pin(b)
    c.remove(b)  # a pinned entry leaving (an admit took it over) was not counted
    c.pin(b, -1)  # nor is it when its lease goes after
    assert c.unpinned_bytes == _unpinned(c) == 800
    c.set_exported(a, b"y" * 30)
    c.pin(h, -1)
    assert c.unpinned_bytes == _unpinned(c) == 0
