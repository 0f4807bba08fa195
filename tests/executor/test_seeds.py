"""Seed leases and seeded admission (contract §3 steps 3–4 and 9, §6, §7) on the
fake runtime: LEASE_SEED / RELEASE_SEED, every StaleSeed rule naming its
field, the copy, takeover, import and adoption paths each giving the tokens
an unseeded run gives, the memory check's exactness with seeds, eviction
that skips rather than stops, checkpoints that give their slots back, the
host tier, EXPORT_ENTRY / IMPORT_STATE between executors, and the trie
index (a hit compares the parent, not only the page)."""

from __future__ import annotations

import msgpack
import pytest

from superfluid.abi import CacheClass, Determinism, OpStatus, ShedKind, ShedReason, Status
from superfluid.executor.cache import PrefixCache
from superfluid.testing.executor import SAMPLE, emit_of, emitted, put
from superfluid.testing.invariants import assert_reject, check_invariants, snapshot
from superfluid.testing.seeds import SPI, LeaseDriver, exe

PROMPT = list(range(1, 23))  # 22 tokens: 5 whole pages of 4 and 2 more


def plain_tokens(prompt, n: int = 6, **kw) -> list[int]:
    """The oracle: the same request on a fresh executor, no seed."""
    return exe(**kw).serve(prompt, n=n)


# ------------------------------------------------------------------ the op


def test_lease_covers_whole_pages_of_the_longest_entry():
    d = exe()
    assert d.lease(PROMPT).status == int(OpStatus.NoMatch)
    d.serve(PROMPT)  # publishes 22 + 6 generated: 28 tokens (7 pages) kept
    done = d.lease(PROMPT + [60, 61])
    assert done.status == int(OpStatus.OK) and done.handle > 0
    assert done.value == 20  # the prompt's 5 whole pages: its 6th differs from what was generated
    assert d.lease(PROMPT[:3]).status == int(OpStatus.NoMatch)  # less than a page
    other = [9] + PROMPT[1:]
    assert d.lease(other).status == int(OpStatus.NoMatch)  # differs in the first page


@pytest.mark.parametrize("msg, field", [
    (dict(tokens=[]), "tokens"), (dict(tokens=[1, 64]), "tokens"), (dict(tokens="ab"), "tokens"),
    (dict(tokens=[1, 2, 3, 4]), "ttl_ticks"), (dict(tokens=[1, 2, 3, 4], ttl_ticks=0), "ttl_ticks"),
    (dict(tokens=[1, 2, 3, 4], ttl_ticks=2, determinism_class=9), "determinism_class"),
])
def test_lease_bad_fields_are_bad_requests(msg, field):
    d = exe()
    d.serve(PROMPT)
    before = snapshot(d.ex)
    done = d.op(op="LEASE_SEED", **msg)
    assert done.status == int(OpStatus.BadRequest)
    assert field in msgpack.unpackb(done.payload)["error"]
    assert snapshot(d.ex) == before


def test_lease_table_is_bounded_and_release_unpins():
    d = exe(max_leases=2)
    d.serve(PROMPT)
    a, b = d.lease(PROMPT), d.lease(PROMPT)
    assert a.status == b.status == int(OpStatus.OK)
    assert d.lease(PROMPT).status == int(OpStatus.Capacity)
    (entry,) = list(d.ex.cache)
    assert entry.pins == 2 and d.ex.cache.unpinned_bytes == 0
    assert d.op(op="RELEASE_SEED", handle=a.handle).status == int(OpStatus.OK)
    assert d.op(op="RELEASE_SEED", handle=a.handle).status == int(OpStatus.UnknownHandle)
    assert entry.pins == 1 and d.lease(PROMPT).status == int(OpStatus.OK)


def test_a_lease_lasts_ttl_accepted_ticks_and_pins_while_it_does():
    d = exe()
    d.serve(PROMPT)
    h = d.lease(PROMPT, ttl=2).handle
    assert d.ex.tick(d.plan().build()).ok  # 1 accepted tick
    assert d.ex.cache.unpinned_bytes == 0
    _tag, r = d.admit(PROMPT, seed=h, value=20)  # the 2nd: still good
    assert r.ok, r.message
    h2 = d.lease(PROMPT, ttl=1).handle
    assert d.ex.tick(d.plan().build()).ok
    r = d.admit(PROMPT, seed=h2, value=20)[1]
    assert r.status == Status.RejectStaleSeed and "expired" in r.message


# --------------------------------------------------------------- StaleSeed


def _stale(d, plan, field: str, words: str):
    r = assert_reject(d.ex, plan, Status.RejectStaleSeed, field)
    assert words in r.message, r.message


def test_every_stale_seed_rule_names_its_field():
    d = exe()
    d.serve(PROMPT)
    h = d.lease(PROMPT).handle

    def admit(b, tag, prompt=PROMPT, seed=h, det=SPI):
        return b.admit(tag, put(d.ex, prompt), seed_handle=seed, determinism_class=det)

    _stale(d, admit(d.plan(), 50, seed=999).build(), "admits[0].seed_handle", "no seed lease 999")
    _stale(d, admit(admit(d.plan(), 50), 51).build(), "admits[1].seed_handle", "used by admits[0]")
    _stale(d, admit(d.plan(), 50, det=int(Determinism.DISTRIBUTION_EXACT)).build(), "admits[0].determinism_class",
           "SEED_PATH_INVARIANT")
    _stale(d, admit(d.plan(), 50, prompt=[9] + PROMPT[1:]).build(), "admits[0].seed_handle", "not a prefix")
    _stale(d, admit(d.plan(), 50, prompt=PROMPT[:10]).build(), "admits[0].seed_handle", "not a prefix")
    d.seq -= 5  # the rejects moved nothing, plan_seq included
    # Expired: the table forgets the lease, the message still says why.
    h1 = d.lease(PROMPT, ttl=1).handle
    assert d.ex.tick(d.plan().build()).ok
    d.ex.sweep_leases()  # what the next check does first (contract §3 step 3): not the reject's change
    _stale(d, admit(d.plan(), 50, seed=h1).build(), "admits[0].seed_handle", "expired")
    d.seq -= 1
    # An import lease whose sequence another lease now holds is no longer bare.
    blob = msgpack.unpackb(d.op(op="EXPORT_ENTRY", handle=h).payload)["blob"]
    imp = d.op(op="IMPORT_STATE", tokens=PROMPT[:20], blob=blob, ttl_ticks=5)
    assert imp.status == int(OpStatus.OK) and imp.value == 20
    other = d.lease(PROMPT)
    assert other.status == int(OpStatus.OK)
    _stale(d, admit(d.plan(), 50, seed=imp.handle).build(), "admits[0].seed_handle", "no longer bare")
    d.seq -= 1
    assert d.op(op="RELEASE_SEED", handle=other.handle).status == int(OpStatus.OK)
    r = d.ex.tick(admit(d.plan(), 50, seed=imp.handle).prefill(50, 20, 2).build())
    assert r.ok, r.message  # bare again once the other lease let go


# --------------------------------------------------------------- the paths


@pytest.mark.parametrize("sampling", [0, SAMPLE])
@pytest.mark.parametrize("rt_kw, path", [
    (dict(), "copy"),  # full blocks shared
    (dict(copy_shares_cells=False), "copy"),
    (dict(copy_shares_cells=False, takeover_preferred=True), "takeover"),
])
def test_seeded_lane_equals_the_unseeded_one(rt_kw, path, sampling):
    want = plain_tokens(PROMPT + [40, 41, 42], **rt_kw)
    d = exe(**rt_kw)
    first = d.serve(PROMPT, sampling=sampling)
    assert first == plain_tokens(PROMPT, **rt_kw) if sampling else True
    nxt = PROMPT + [40, 41, 42]
    done = d.lease(nxt)
    assert done.value == 20
    tag, r = d.admit(nxt, seed=done.handle, value=done.value, sampling=SAMPLE)
    assert r.ok, r.message
    took = [e for e in r.events.shed.entries if e.reason == int(ShedReason.TAKEOVER)]
    assert bool(took) == (path == "takeover")
    if took:
        assert took[0].lane_tag == tag and took[0].kind == int(ShedKind.CACHE_EVICTION)
        assert len(d.ex.cache) == 0
    assert emitted(d.ex, emit_of(r, tag)) == want
    assert d.ex.counters.seeded_tokens == 20
    check_invariants(d.ex)


def test_a_lease_on_the_whole_prompt_decodes_at_once():
    d = exe()
    d.serve(PROMPT[:20])  # 20 prompt + 6 generated: 24 tokens kept (6 pages)
    h = d.lease(PROMPT[:20])
    assert h.value == 20
    tag, r = d.admit(PROMPT[:20], seed=h.handle, value=20)  # no prefill at all
    assert r.ok, r.message
    lane_toks = emitted(d.ex, emit_of(r, tag))
    assert lane_toks == plain_tokens(PROMPT[:20])
    lane = d.ex.lanes[tag]
    assert lane.prefilled == 20 and d.ex.runtime.seq_len(lane.seq) == 20 + 6 - 1


def test_first_prefill_of_a_seeded_lane_starts_at_value():
    d = exe()
    d.serve(PROMPT)
    h = d.lease(PROMPT).handle
    b = d.plan().admit(90, put(d.ex, PROMPT), seed_handle=h, determinism_class=SPI).prefill(90, 0, 22)
    assert_reject(d.ex, b.build(), Status.RejectIllegalCombination, "prefills[0].token_offset")
    d.seq -= 1
    b = d.plan().admit(90, put(d.ex, PROMPT), seed_handle=h, determinism_class=SPI).prefill(90, 20, 3)
    assert_reject(d.ex, b.build(), Status.RejectBounds, "prefills[0].token_count")


def test_granted_class_is_what_was_asked():
    d = exe()
    for det in Determinism:
        _tag, r = d.admit(PROMPT, det=int(det), n=1)
        assert r.ok and r.events.admit_results[0].granted_class == int(det)


# ------------------------------------------------------------- the memory


def test_resent_prompt_fits_a_pool_its_entry_fills():
    """The issue's case: a 32-token entry on a 64-cell pool; the same prompt
    again needs 36 cells. With a lease it fits (the copy shares pages);
    without one, a plan that allows eviction evicts the entry."""
    prompt = list(range(1, 33))
    d = exe(cells_total=64, cache_max_bytes=None)
    d.serve(prompt, n=4)
    h = d.lease(prompt)
    assert h.value == 32
    tag, r = d.admit(prompt, seed=h.handle, value=32, n=4)
    assert r.ok, r.message
    assert emitted(d.ex, emit_of(r, tag)) == plain_tokens(prompt, n=4)
    d2 = exe(cells_total=64, cache_max_bytes=None)
    d2.serve(prompt, n=4)
    assert d2.admit(prompt, n=4)[1].status == Status.NeedsReplan
    d2.seq -= 1
    assert d2.admit(prompt, n=4, evict=True)[1].ok


def test_eviction_skips_an_entry_too_big_for_the_cap():
    d = exe(cells_total=48, page=4, bytes_per_cell=128, cache_max_bytes=None)  # a page is 512 bytes
    d.serve(list(range(1, 33)), n=1)  # 32 cells kept: 4096 bytes, the older entry
    d.serve([50, 51, 52, 53, 54, 55, 56, 57], n=1)  # 8 cells: 1024 bytes
    mem = d.ex.runtime.mem_counters()
    assert mem.cells_used == 40
    b = d.plan()
    b.evictable_cache_classes, b.max_evict_bytes = int(CacheClass.RESIDENT_PREFIX_CLASS), 1024
    b.admit(77, put(d.ex, [3] * 12)).prefill(77, 0, 12)
    r = d.ex.tick(b.build())
    assert r.ok, r.message
    (ev,) = r.events.shed.entries
    assert ev.bytes == 1024 and ev.reason == int(ShedReason.MEMORY)


def test_a_checkpoint_gives_its_slot_back():
    d = exe(exact_only=True, max_seqs=2, max_seq_len=256)
    long_prompt = [i % 60 + 1 for i in range(130)]
    _tag, r = d.admit(long_prompt, n=0)  # prefill only: the prompt's checkpoint is taken
    assert r.ok and any(e.checkpoint for e in d.ex.cache)
    _tag2, r2 = d.admit([5, 6, 7], n=2)  # the second slot is the checkpoint's: it gives it back
    assert r2.ok, r2.message
    assert not any(e.checkpoint for e in d.ex.cache)


def test_exact_only_checkpoint_seeds_the_resent_prompt():
    long_prompt = [i % 60 + 1 for i in range(130)]
    want = plain_tokens(long_prompt, exact_only=True, max_seq_len=256)
    d = exe(exact_only=True, max_seq_len=256)
    tag, r = d.admit(long_prompt, n=0)
    assert r.ok and d.ex.tick(d.plan().retire(tag).build()).ok
    h = d.lease(long_prompt[:-1])
    assert h.status == int(OpStatus.OK) and h.value == 129
    whole = d.lease(long_prompt)
    assert whole.value == 129
    tag, r = d.admit(long_prompt, seed=h.handle, value=129)
    assert r.ok, r.message
    assert emitted(d.ex, emit_of(r, tag)) == want
    check_invariants(d.ex)


# ------------------------------------------------------------ the host tier


def _pushed_to_host(**kw) -> LeaseDriver:
    """PROMPT's entry (28 cells) evicted from a 48-cell pool by a second request."""
    d = exe(cells_total=48, **kw)
    d.serve(PROMPT)
    d.serve([30 + i for i in range(20)], n=2, evict=True)
    return d


def test_evicted_entry_goes_to_host_memory_and_comes_back():
    want = plain_tokens(PROMPT + [40])
    d = _pushed_to_host()
    assert len(d.ex.cache) in (0, 1) and d.ex.cache.exported()
    assert d.ex.tick(d.plan().build()).events.mem.host_retained_bytes > 0
    h = d.lease(PROMPT + [40])
    assert h.value == 20
    tag, r = d.admit(PROMPT + [40], seed=h.handle, value=20, evict=True)
    assert r.ok, r.message
    assert emitted(d.ex, emit_of(r, tag)) == want
    check_invariants(d.ex)


def test_a_failed_import_is_state_lost_not_a_request_lost():
    want = plain_tokens(PROMPT + [40])
    d = _pushed_to_host()
    h = d.lease(PROMPT + [40])
    d.ex.runtime.inject_capacity_fault(on="import")
    tag, r = d.admit(PROMPT + [40], seed=h.handle, value=20, evict=True)
    assert r.ok and not r.events.faults, r.message
    lost = [e for e in r.events.shed.entries if e.reason == int(ShedReason.LOST)]
    assert len(lost) == 1 and lost[0].lane_tag == tag
    assert emitted(d.ex, emit_of(r, tag)) == want
    assert not [e for e in d.ex.cache.all() if e.tokens[:4] == tuple(PROMPT[:4])]


def test_host_tier_off_drops_evicted_entries():
    d = _pushed_to_host(host_cache_bytes=0)
    assert not d.ex.cache.exported() and d.lease(PROMPT).status == int(OpStatus.NoMatch)


# --------------------------------------------------------- export / import


def test_export_and_import_move_a_prefix_between_workers(tmp_path):
    nxt = PROMPT + [40, 41]
    want = plain_tokens(nxt)
    a, b = exe(state_dir=tmp_path), exe(state_dir=tmp_path)
    a.serve(PROMPT)
    h = a.lease(PROMPT).handle
    path = tmp_path / "entry.bin"
    done = a.op(op="EXPORT_ENTRY", handle=h, path=str(path))  # absolute, inside the state dir
    assert done.status == int(OpStatus.OK) and done.value == path.stat().st_size
    assert path.stat().st_mode & 0o777 == 0o600
    imp = b.op(op="IMPORT_STATE", tokens=PROMPT[:20], path="entry.bin", ttl_ticks=3)  # relative to it
    assert imp.status == int(OpStatus.OK), imp.payload
    tag, r = b.admit(nxt, seed=imp.handle, value=20)  # adopts the imported sequence
    assert r.ok, r.message
    assert emitted(b.ex, emit_of(r, tag)) == want
    assert len(b.ex.cache) == 0  # adopted: the lane owns it
    check_invariants(b.ex)


def test_import_refuses_other_runtimes_and_wrong_tokens():
    a = exe()
    a.serve(PROMPT)
    blob = msgpack.unpackb(a.op(op="EXPORT_ENTRY", handle=a.lease(PROMPT).handle).payload)["blob"]
    other = exe(seed=5)  # another model: its rows differ
    cases = [
        (other, dict(tokens=PROMPT[:20], blob=blob), "blob"),
        (exe(), dict(tokens=[9] + PROMPT[1:20], blob=blob), "tokens"),
        (exe(), dict(tokens=PROMPT[:20], blob=blob[:-3]), "blob"),
        (exe(), dict(tokens=PROMPT[:20], blob=b"SFEX" + bytes(40)), "blob"),
        (exe(), dict(tokens=PROMPT[:20], blob=blob[:30] + b"x" + blob[31:]), "blob"),
        (exe(), dict(tokens=PROMPT[:20]), "blob"),
    ]
    for d, msg, field in cases:
        before = d.ex.state_digest()
        done = d.op(op="IMPORT_STATE", ttl_ticks=2, **msg)
        assert done.status == int(OpStatus.BadRequest), (msg.keys(), done)
        assert field in msgpack.unpackb(done.payload)["error"]
        assert d.ex.state_digest() == before
    assert other.ex.runtime.mem_counters().seqs == 0


# ------------------------------------------------------------------- index


def test_trie_hit_compares_the_parent_page():
    c = PrefixCache(page=2)
    c.insert(1, (1, 2, 3, 4), 4, 0, 0)
    assert c.covering((9, 9, 3, 4))[0] == 0  # page 2 equal, page 1 not: no hit
    assert c.covering((1, 2, 3, 5))[0] == 1
    assert c.covering((1, 2, 3, 4, 5))[0] == 2
    e2 = c.insert(2, (1, 2, 7, 8), 4, 0, 1)
    pages, got = c.covering((1, 2, 7, 8))
    assert pages == 2 and got == [e2]
    c.remove(e2)
    assert c.covering((1, 2, 7, 8))[0] == 1 and not c._root.children[(1, 2)].children.get((7, 8))


def test_publishing_an_extension_merges_the_shorter_entry():
    d = exe()
    d.serve(PROMPT[:8], n=1)  # 8 tokens kept
    h = d.lease(PROMPT)
    d.serve(PROMPT, seed=h.handle, value=8)
    keys = sorted(len(e.tokens) for e in d.ex.cache)
    assert keys == [28], keys  # the 8-token entry is inside the new one
