"""Segments: made 0600 by their owner, refused when anything about them is
not what this build expects, and gone after a clean close + unlink."""

from __future__ import annotations

import os
import stat

import pytest

from superfluid.abi import ABI_VERSION, MAGIC, WorkerState, ffi
from superfluid.abi.records import RuntimeDesc
from superfluid.rings.errors import SegmentClosed, SegmentError
from superfluid.rings.layout import SegmentConfig
from superfluid.rings.naming import segment_path
from superfluid.rings.segment import Segment

SMALL = SegmentConfig(plan_slots=2, plan_slot_bytes=1024, event_slots=2, event_slot_bytes=1024, op_slots=2,
                      op_slot_bytes=1024, stream_slots=2, stream_slot_bytes=64, prompt_tokens=16, emit_tokens=16,
                      logits_floats=16)


@pytest.fixture
def made(seg_name):
    seg = Segment.create(seg_name, 3, SMALL)
    yield seg
    seg.close()
    seg.unlink()


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_created_with_mode_0600_and_opened_by_its_owner(made, seg_name):
    st = os.stat(made.path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    with Segment.open(seg_name, 3) as other:
        assert other.name == seg_name and other.index == 3
        assert other.header.magic == MAGIC and other.header.abi_version == ABI_VERSION
        assert other.prompt_ring.capacity == 16 and other.plan_queue.n_slots == 2


def test_header_fields_are_shared(made, seg_name):
    with Segment.open(seg_name, 3) as other:
        epoch = made.bump_epoch(WorkerState.READY)
        assert other.epoch == epoch == 1 and other.worker_state == WorkerState.READY
        other.yield_requested = True
        assert made.yield_requested and not made.latency_wanted
        desc = RuntimeDesc(b"tiny-llama", 256, 64, 2048, 128, 16, 512, 3)
        other.runtime = desc
        assert made.runtime == desc


def test_names_are_checked():
    for bad in ("", "a/b", "../x", "-x", "x" * 40, "sp ace"):
        with pytest.raises(SegmentError, match="name"):
            segment_path(bad, 0)


def test_a_second_create_is_refused(made, seg_name):
    with pytest.raises(SegmentError, match="exists"):
        Segment.create(seg_name, 3, SMALL)


def test_replace_removes_a_stale_segment(made, seg_name):
    fresh = Segment.create(seg_name, 3, SMALL, replace=True)
    try:
        assert fresh.epoch == 0 and fresh.path == made.path
    finally:
        fresh.close()


def test_missing_segment():
    with pytest.raises(SegmentError, match="no such segment"):
        Segment.open("nothing-here", 0)


def test_wrong_magic(made, seg_name):
    _patch(made.path, 0, b"NOTASEGM")
    with pytest.raises(SegmentError, match="magic"):
        Segment.open(seg_name, 3)


def test_wrong_version(made, seg_name):
    _patch(made.path, ffi.offsetof("SegmentHeader", "abi_version"), (ABI_VERSION + 1).to_bytes(4, "little"))
    with pytest.raises(SegmentError, match="ABI version"):
        Segment.open(seg_name, 3)


def test_wrong_size(made, seg_name):
    with open(made.path, "r+b") as f:
        f.truncate(made.size + 4096)
    with pytest.raises(SegmentError, match="bytes"):
        Segment.open(seg_name, 3)


def test_short_file(seg_name):
    path = segment_path(seg_name, 0)
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    os.write(fd, b"SFLUIDV1")
    os.close(fd)
    try:
        with pytest.raises(SegmentError, match="shorter"):
            Segment.open(seg_name, 0)
    finally:
        os.unlink(path)


def test_open_mode_refused(made, seg_name):
    os.chmod(made.path, 0o644)
    with pytest.raises(SegmentError, match="mode 0644"):
        Segment.open(seg_name, 3)


def test_symlink_refused(made, seg_name, tmp_path):
    link = segment_path(seg_name, 9)
    os.symlink(made.path, link)
    try:
        with pytest.raises(SegmentError):
            Segment.open(seg_name, 9)
    finally:
        os.unlink(link)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")
def test_segment_of_another_user_refused(made, seg_name):
    os.chown(made.path, 12345, -1)
    with pytest.raises(SegmentError, match="owned by uid 12345"):
        Segment.open(seg_name, 3)
    with pytest.raises(SegmentError, match="not replacing"):
        Segment.create(seg_name, 3, SMALL, replace=True)
    os.chown(made.path, os.geteuid(), -1)


def test_recorded_owner_must_match(made, seg_name):
    _patch(made.path, ffi.offsetof("SegmentHeader", "owner_uid"), (os.geteuid() + 1).to_bytes(4, "little"))
    with pytest.raises(SegmentError, match="made by uid"):
        Segment.open(seg_name, 3)


@pytest.mark.parametrize("field,value", [("plan_queue", 3), ("token_ring", 1 << 40), ("op_queue", 0)])
def test_layout_outside_the_segment(made, seg_name, field, value):
    at = ffi.offsetof("SegmentHeader", "layout") + ffi.offsetof("SegmentLayout", field)
    _patch(made.path, at, value.to_bytes(8, "little"))
    with pytest.raises(SegmentError, match=field):
        Segment.open(seg_name, 3)


def test_queue_geometry_that_does_not_fit(made, seg_name):
    at = made.header.layout.event_queue + ffi.offsetof("Queue", "n_slots")
    _patch(made.path, at, (1 << 20).to_bytes(4, "little"))
    with pytest.raises(SegmentError, match="event queue"):
        Segment.open(seg_name, 3)
    _patch(made.path, at, (3).to_bytes(4, "little"))  # not a power of two
    with pytest.raises(SegmentError, match="event queue"):
        Segment.open(seg_name, 3)


def test_ring_capacity_that_does_not_fit(made, seg_name):
    at = made.header.layout.logits_ring + ffi.offsetof("DataRing", "capacity")
    _patch(made.path, at, (1 << 40).to_bytes(8, "little"))
    with pytest.raises(SegmentError, match="ring"):
        Segment.open(seg_name, 3)


def test_geometry_is_read_once(made, seg_name):
    # What the other side writes into a queue header later cannot move an
    # index out of the mapping: the view keeps the geometry checked at attach.
    with Segment.open(seg_name, 3) as other:
        made.plan_queue._view.q.n_slots = 1 << 30
        made.plan_queue._view.q.head = 12345
        assert other.plan_queue.n_slots == 2
        assert other.plan_queue.try_reserve() is None  # a nonsense head reads as full, not as a wild slot


def test_closed_segment_refuses_use(seg_name):
    seg = Segment.create(seg_name, 0, SMALL)
    q, ring = seg.plan_queue, seg.prompt_ring
    seg.close()
    seg.unlink()
    seg.close()  # twice is fine
    with pytest.raises(SegmentClosed):
        q.try_reserve()
    with pytest.raises(SegmentClosed):
        ring.write([1])
    with pytest.raises(SegmentClosed):
        _ = seg.epoch
    assert not os.path.exists(seg.path)


def test_config_is_checked():
    with pytest.raises(SegmentError, match="power of two"):
        SegmentConfig(plan_slots=3).check()
    with pytest.raises(SegmentError, match="multiple of 64"):
        SegmentConfig(event_slot_bytes=1000).check()
    with pytest.raises(SegmentError, match="positive"):
        SegmentConfig(prompt_tokens=0).check()


def test_overlapping_regions_are_refused(made, seg_name):
    at = ffi.offsetof("SegmentHeader", "layout") + ffi.offsetof("SegmentLayout", "event_queue")
    _patch(made.path, at, int(made.header.layout.plan_queue).to_bytes(8, "little"))
    with pytest.raises(SegmentError, match="overlaps"):
        Segment.open(seg_name, 3)


def test_a_ring_in_another_rings_place_is_refused(made, seg_name):
    at = made.header.layout.prompt_ring + ffi.offsetof("DataRing", "ring_id")
    _patch(made.path, at, (3).to_bytes(4, "little"))  # the logits ring's id
    with pytest.raises(SegmentError, match="prompt ring"):
        Segment.open(seg_name, 3)


def test_a_queue_whose_tail_passed_its_head_opens_and_is_seen_and_reset(made, seg_name):
    # Impossible counters are the worker's to reset (and report), not a reason
    # to lock every later planner out.
    at = made.header.layout.plan_queue + ffi.offsetof("Queue", "tail")
    _patch(made.path, at, (5).to_bytes(8, "little"))
    with Segment.open(seg_name, 3) as seg:
        assert not seg.plan_queue.sane() and seg.event_queue.sane()
        assert seg.plan_queue.reset() == 0
        assert seg.plan_queue.sane() and seg.plan_queue.tail == seg.plan_queue.head == 0


def test_repair_rewrites_what_a_planner_scribbled(made, seg_name):
    q = made.header.layout.plan_queue
    _patch(made.path, q + ffi.offsetof("Queue", "n_slots"), (3).to_bytes(4, "little"))
    _patch(made.path, made.header.layout.event_queue + ffi.offsetof("Queue", "head"), (99).to_bytes(8, "little"))
    _patch(made.path, ffi.offsetof("SegmentHeader", "stop_requested"), (1).to_bytes(4, "little"))
    with pytest.raises(SegmentError, match="plan queue"):
        Segment.open(seg_name, 3)  # a planner refuses the bad geometry...
    fixed = made.repair()
    assert any("plan queue n_slots was 3" in f for f in fixed), fixed
    assert any("event queue counters head 99" in f for f in fixed), fixed
    assert any("stop_requested" in f for f in fixed), fixed
    with Segment.open(seg_name, 3) as seg:  # ...until the daemon repairs it
        assert seg.plan_queue.n_slots == made.config.plan_slots and seg.event_queue.sane()
    assert made.repair() == []  # negative control: nothing left to fix


def test_a_worker_opens_with_the_daemons_geometry_whatever_the_header_says(made, seg_name):
    q = made.header.layout.plan_queue
    _patch(made.path, q + ffi.offsetof("Queue", "n_slots"), (3).to_bytes(4, "little"))
    with Segment.open_path(made.path, config=made.config) as seg:
        assert seg.plan_queue.n_slots == made.config.plan_slots
    assert made.plan_queue.n_slots == made.config.plan_slots
    with Segment.open(seg_name, 3) as seg:  # the worker wrote it back
        assert seg.plan_queue.n_slots == made.config.plan_slots


def test_a_segment_under_another_name_is_refused(made, seg_name):
    other = segment_path(seg_name + "x", 5)
    os.link(made.path, other)
    try:
        with pytest.raises(SegmentError, match=f"not of '{seg_name}x' worker 5"):
            Segment.open(seg_name + "x", 5)
    finally:
        os.unlink(other)


def test_sizes_that_would_wrap_are_refused_and_nothing_is_left(seg_name):
    with pytest.raises(SegmentError, match="above the limit"):
        Segment.create(seg_name, 0, SegmentConfig(logits_floats=(1 << 62) + 5))
    assert not os.path.exists(segment_path(seg_name, 0))


def test_a_slot_held_across_close_refuses_use(seg_name):
    seg = Segment.create(seg_name, 0, SMALL)
    slot = seg.plan_queue.try_reserve()
    q = seg.plan_queue
    seg.close()
    seg.unlink()
    with pytest.raises(ValueError):
        slot[0] = 1  # not a write into unmapped memory
    for use in (q.publish, q.release, q.wake_all, q.discard_unread, lambda: len(q), lambda: q.head,
                lambda: seg.prompt_ring.head):
        with pytest.raises(SegmentClosed):
            use()


def test_a_segment_has_all_its_pages_when_made(segment):
    """posix_fallocate at creation: a tmpfs that fills later cannot SIGBUS a first touch."""
    st = os.stat(segment.path)
    assert st.st_blocks * 512 >= st.st_size > 0
