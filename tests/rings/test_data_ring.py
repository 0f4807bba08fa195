"""Data rings: writes never split, generations count wraps, and a reference
is readable exactly while its elements are still in the ring."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from superfluid.abi import RingId, Status, ffi
from superfluid.abi.records import RingRef
from superfluid.rings.errors import RefError


def _status(ring, ref):
    st_ = ring.check(ref)
    try:
        ring.read(ref)
        read = Status.OK
    except RefError as e:
        read = e.status
    assert st_ == read
    return st_


def test_write_then_read(segment):
    ring = segment.prompt_ring
    ref = ring.write([5, 6, 7])
    assert ref == RingRef(RingId.PROMPT, 0, 0, 3)
    assert ring.read(ref).tolist() == [5, 6, 7]
    assert segment.logits_ring.read(segment.logits_ring.write(np.float32([1.5, -2]))).tolist() == [1.5, -2.0]


def test_a_write_that_reaches_the_end_exactly_stays_in_its_generation(segment):
    ring = segment.prompt_ring  # capacity 64
    a = ring.write(np.arange(60))
    b = ring.write(np.arange(4))
    assert (b.generation, b.offset) == (0, 60)
    assert ring.read(a).tolist() == list(range(60)) and ring.read(b).tolist() == [0, 1, 2, 3]
    c = ring.write([9])  # the next write starts generation 1
    assert (c.generation, c.offset) == (1, 0)
    assert _status(ring, a) == Status.RejectBadRefGeneration  # its first element is gone
    assert _status(ring, b) == Status.OK


def test_a_write_that_does_not_fit_the_tail_skips_it(segment):
    ring = segment.prompt_ring
    a = ring.write(np.arange(40))
    b = ring.write(np.arange(30))  # 40 + 30 > 64: starts generation 1 at 0
    assert (b.generation, b.offset, b.len) == (1, 0, 30)
    assert ring.head == 64 + 30
    assert _status(ring, a) == Status.RejectBadRefGeneration
    tail = RingRef(RingId.PROMPT, 0, 40, 10)  # the skipped tail is still "in" the ring, unwritten data or not
    assert _status(ring, tail) == Status.OK


def test_future_references_are_bad_generations(segment):
    ring = segment.prompt_ring
    ring.write([1, 2])
    assert _status(ring, RingRef(RingId.PROMPT, 0, 0, 3)) == Status.RejectBadRefGeneration  # not written yet
    assert _status(ring, RingRef(RingId.PROMPT, 1, 0, 1)) == Status.RejectBadRefGeneration
    assert _status(ring, RingRef(RingId.PROMPT, 7, 0, 1)) == Status.RejectBadRefGeneration
    assert _status(ring, RingRef(RingId.PROMPT, 0xFFFFFFFF, 0, 1)) == Status.RejectBadRefGeneration


def test_references_outside_the_ring_are_bounds(segment):
    ring = segment.prompt_ring
    ring.write(np.arange(10))
    for ref in (RingRef(RingId.PROMPT, 0, 64, 0), RingRef(RingId.PROMPT, 0, 60, 5),
                RingRef(RingId.PROMPT, 0, 0, 65), RingRef(RingId.PROMPT, 0, (1 << 64) - 1, 2),
                RingRef(RingId.PROMPT, 0, 2, (1 << 64) - 1)):
        assert _status(ring, ref) == Status.RejectBounds, ref


def test_unknown_or_other_rings_are_bounds(segment):
    ref = segment.prompt_ring.write([1])
    assert _status(segment.token_ring, ref) == Status.RejectBounds
    for rid in (0, 4, 99):
        assert _status(segment.prompt_ring, ref._replace(ring_id=rid)) == Status.RejectBounds


def test_fields_wider_than_their_width_are_bounds(segment):
    assert _status(segment.prompt_ring, RingRef(RingId.PROMPT, 1 << 33, 0, 1)) == Status.RejectBounds
    assert _status(segment.prompt_ring, RingRef(-1, 0, 0, 1)) == Status.RejectBounds


def test_empty_references(segment):
    ring = segment.prompt_ring
    ref = ring.write([])
    assert ref.len == 0 and ring.read(ref).size == 0


def test_a_write_longer_than_the_ring_is_refused(segment):
    ring = segment.prompt_ring
    with pytest.raises(RefError) as e:
        ring.write(np.arange(65))
    assert e.value.status == Status.RejectBounds
    assert ring.head == 0  # nothing moved


def test_generation_wraps_at_32_bits(segment):
    ring = segment.prompt_ring
    cap = ring.capacity
    # Put the ring just before its 2**32-th wrap (the counters are shared
    # memory; this is what a long-lived writer reaches).
    start = ((1 << 32) - 1) * cap + cap - 8
    r = ring._view.r
    r.head = start
    r.reserve = start
    a = ring.write(np.arange(8))
    assert (a.generation, a.offset) == (0xFFFFFFFF, cap - 8)
    b = ring.write(np.arange(3))
    assert (b.generation, b.offset) == (0, 0)  # generation 2**32 seen as 0
    assert ring.read(a).tolist() == list(range(8)) and ring.read(b).tolist() == [0, 1, 2]
    assert _status(ring, a._replace(generation=0xFFFFFFFE)) == Status.RejectBadRefGeneration


@settings(max_examples=80)
@given(st.lists(st.integers(0, 64), min_size=1, max_size=40), st.data())
def test_readable_exactly_while_not_overwritten(sizes, data):
    """Model: absolute positions; a reference is good iff it was written and
    none of its elements has been written over since."""
    import os

    from superfluid.rings.layout import SegmentConfig
    from superfluid.rings.segment import Segment
    name = f"h{os.getpid()}-{data.draw(st.integers(0, 1 << 30))}"
    seg = Segment.create(name, 0, SegmentConfig(prompt_tokens=64, plan_slot_bytes=1024, event_slot_bytes=1024,
                                                op_slot_bytes=1024, stream_slots=2, emit_tokens=16,
                                                logits_floats=16), replace=True)
    try:
        ring, cap = seg.prompt_ring, 64
        written = []  # (ref, absolute start, values)
        counter = 0
        for n in sizes:
            vals = np.arange(counter, counter + n, dtype=np.uint32)
            counter += n
            ref = ring.write(vals)
            written.append((ref, ref.generation * cap + ref.offset, vals))
            head = ring.head
            for r, start, v in written:
                alive = start + cap >= head
                if alive:
                    assert ring.read(r).tolist() == v.tolist()
                else:
                    assert _status(ring, r) == Status.RejectBadRefGeneration
    finally:
        seg.close()
        seg.unlink()


def _race_writer(name: str, stop_at: int) -> None:
    from superfluid.rings.segment import Segment

    seg = Segment.open(name, 0)
    ring = seg.prompt_ring
    pos = ring.head
    while pos < stop_at:
        ring.write(np.arange(pos, pos + 8, dtype=np.uint64).astype(np.uint32))  # element = its position
        pos += 8
    seg.close()


def test_reads_racing_a_writer_are_whole_or_refused(seg_name):
    """A writer in another process laps the ring while this one reads just
    behind it: every read that succeeds holds exactly what was written there
    (never a torn mix); the others are refused as bad generations."""
    import multiprocessing as mp

    from superfluid.rings.layout import SegmentConfig
    from superfluid.rings.segment import Segment

    seg = Segment.create(seg_name, 0, SegmentConfig(prompt_tokens=64, plan_slot_bytes=1024,
                                                    event_slot_bytes=1024, op_slot_bytes=1024, stream_slots=2,
                                                    emit_tokens=16, logits_floats=16))
    ring = seg.prompt_ring
    proc = mp.get_context("fork").Process(target=_race_writer, args=(seg_name, 3_000_000))
    proc.start()
    ok = refused = 0
    rng = np.random.default_rng(0)
    try:
        while proc.is_alive() or ok + refused == 0:
            head = ring.head
            if head < 64:
                continue
            start = head - 64 + int(rng.integers(0, 8)) * 8  # the oldest elements: the writer's next target
            ref = RingRef(RingId.PROMPT, (start // 64) & 0xFFFFFFFF, start % 64, 8)
            try:
                got = ring.read(ref)
            except RefError as e:
                assert e.status == Status.RejectBadRefGeneration
                refused += 1
                continue
            assert got.tolist() == [(start + i) & 0xFFFFFFFF for i in range(8)]
            ok += 1
    finally:
        proc.join(30)
        seg.close()
        seg.unlink()
    assert proc.exitcode == 0
    assert ok > 0 and refused > 0, (ok, refused)


def test_a_writer_that_died_mid_write_leaves_its_cells_refused(segment):
    # A writer killed between begin and commit: its reservation stands, so the
    # cells it half-wrote stay refused after the next writer's write.
    from superfluid.abi import lib

    ring = segment.token_ring
    cap = ring.capacity
    ref = ring.write(np.arange(cap // 2, dtype=np.uint32))
    out = ffi.new("RingRef *")
    dst = lib.sf_ring_begin(ring._view, cap // 2 + 1, out)  # wraps over ref's cells ...
    assert dst != ffi.NULL  # ... and dies here, before sf_ring_commit
    assert ring.check(ref) == Status.RejectBadRefGeneration
    ring.write([7])
    assert ring.check(ref) == Status.RejectBadRefGeneration
    # negative control: a write that completes leaves its own ref readable
    assert ring.read(ring.write([1, 2, 3])).tolist() == [1, 2, 3]
