"""sf_segment_open (abi/sf_ring.c), the open every language shares: the
checks rings/segment.py makes, and a retry while a daemon is still making
the file."""

from __future__ import annotations

import os
import threading
import time

import pytest

from superfluid.abi import ABI_VERSION, Connect, ffi, lib
from superfluid.rings.layout import SegmentConfig
from superfluid.rings.naming import segment_path
from superfluid.rings.segment import Segment

SMALL = SegmentConfig(plan_slots=2, plan_slot_bytes=1024, event_slots=2, event_slot_bytes=1024, op_slots=2,
                      op_slot_bytes=1024, stream_slots=2, stream_slot_bytes=64, prompt_tokens=16, emit_tokens=16,
                      logits_floats=16)


def _open(name: str, index: int = 0, timeout_s: float = 0.0):
    m = ffi.new("SegmentMap *")
    r = lib.sf_segment_open(name.encode(), index, int(timeout_s * 1e9), m)
    return r, m


@pytest.fixture
def made(seg_name):
    seg = Segment.create(seg_name, 2, SMALL)
    yield seg
    seg.close()
    seg.unlink()


def test_opens_maps_and_closes_a_segment(made, seg_name):
    r, m = _open(seg_name, 2)
    assert r == Connect.OK
    try:
        assert m.bytes == made.size and m.fd >= 0
        assert m.seg.abi_version == ABI_VERSION and ffi.string(m.seg.name).decode() == seg_name
        assert lib.sf_session_lock(m.fd) == 0
        made.yield_requested = True  # one mapping of one file
        assert m.seg.yield_requested == 1
    finally:
        lib.sf_segment_close(m)
    assert m.seg == ffi.NULL and m.fd == -1
    lib.sf_segment_close(m)  # closing again is harmless


def test_names_and_indexes_a_segment_cannot_have_are_refused(seg_name):
    for bad in ("", "a/b", "../x", "-x", "x" * 32, "sp ace"):
        r, m = _open(bad)
        assert r == Connect.NAME, bad
        assert m.seg == ffi.NULL and m.fd == -1
    assert _open(seg_name, 1 << 16)[0] == Connect.NAME


def test_a_missing_segment_is_waited_for_until_the_timeout(seg_name):
    t0 = time.monotonic()
    assert _open(seg_name, 0)[0] == Connect.MISSING
    assert _open(seg_name, 0, 0.1)[0] == Connect.MISSING
    assert time.monotonic() - t0 >= 0.1


def test_a_segment_made_while_waiting_is_opened(seg_name):
    made = []
    maker = threading.Timer(0.1, lambda: made.append(Segment.create(seg_name, 0, SMALL)))
    maker.start()
    try:
        r, m = _open(seg_name, 0, 10.0)
        assert r == Connect.OK
        lib.sf_segment_close(m)
    finally:
        maker.join()
        for seg in made:
            seg.close()
            seg.unlink()


def test_what_is_not_a_segment_of_this_user_is_refused(made, seg_name, tmp_path):
    path = made.path
    other = segment_path(seg_name, 5)
    os.symlink(path, other)
    try:
        assert _open(seg_name, 5)[0] == Connect.FILE  # O_NOFOLLOW
    finally:
        os.unlink(other)
    os.link(path, other)  # the same file under another index: the header says 2
    try:
        assert _open(seg_name, 5)[0] == Connect.NAME
    finally:
        os.unlink(other)
    os.chmod(path, 0o640)
    assert _open(seg_name, 2)[0] == Connect.FILE
    os.chmod(path, 0o600)
    made.header.abi_version = ABI_VERSION + 1
    assert _open(seg_name, 2)[0] == Connect.ABI
    made.header.abi_version = ABI_VERSION


def test_a_segment_still_being_made_is_retried_then_named(seg_name):
    path = segment_path(seg_name, 0)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        assert _open(seg_name, 0)[0] == Connect.SHORT  # created, not yet sized
        os.ftruncate(fd, 1 << 16)
        t0 = time.monotonic()
        assert _open(seg_name, 0, 0.05)[0] == Connect.MAGIC  # sized, magic not yet written
        assert time.monotonic() - t0 >= 0.05
    finally:
        os.close(fd)
        os.unlink(path)
