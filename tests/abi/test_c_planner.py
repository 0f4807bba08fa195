"""A planner written in C against abi/superfluid.h and abi/sf_ring.c talks
to the Python side through a segment: the ABI is the header, not Python."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from superfluid import abi
from superfluid.abi import Connect, RingId, WorkerState, codec
from superfluid.abi.plan_codec import decode_plan, encode_events_into
from superfluid.abi.records import LaneEmit, RingRef, TickEvents
from superfluid.rings.errors import SegmentError
from superfluid.rings.segment import Segment

HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def planner_bin(tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.skip("gcc not installed")
    out = tmp_path_factory.mktemp("c") / "planner"
    abi_dir = os.path.dirname(abi.HEADER_PATH)
    subprocess.run(["gcc", "-std=c11", "-O1", "-Wall", "-Werror", "-I", abi_dir, os.path.join(HERE, "c", "planner.c"),
                    os.path.join(abi_dir, "sf_ring.c"), "-o", str(out)], check=True)
    return str(out)


def _ready(segment) -> int:
    """Stand in for a worker: READY, with this process's pid."""
    epoch = segment.bump_epoch(WorkerState.READY)
    segment.header.worker_pid = os.getpid()
    return epoch


def test_a_c_planner_and_the_python_executor_side(planner_bin, segment):
    epoch = _ready(segment)
    proc = subprocess.Popen([planner_bin, segment.path], stdout=subprocess.PIPE, text=True)
    try:
        slot = segment.plan_queue.peek(10)
        session = codec.session_of(slot)
        plan = decode_plan(slot)
        segment.plan_queue.release()
        assert session != 0 and session == segment.session_id  # it began a session and stamped its plan
        # Another session's reply first: the C planner must skip it.
        encode_events_into(segment.event_queue.reserve(1), TickEvents(plan_seq=plan.plan_seq, status=9,
                                                                      worker_epoch=epoch), session=session + 7)
        segment.event_queue.publish()
        (admit,) = plan.admits
        assert plan.plan_seq == 41 and admit.lane_tag == 7 and admit.prompt.ring_id == RingId.PROMPT
        assert plan.prefills[0].token_count == 4 and plan.decodes[0].max_new_tokens == 8
        assert segment.prompt_ring.read(admit.prompt).tolist() == [3, 1, 4, 1]
        emit = LaneEmit(lane_tag=7, token_ref=RingRef(RingId.TOKENS, 0, 0, 0))
        encode_events_into(segment.event_queue.reserve(1), TickEvents(plan_seq=plan.plan_seq, emits=(emit,),
                                                                      worker_epoch=epoch), session=session)
        segment.event_queue.publish()
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, proc.returncode
    assert out.split() == ["41", "0", "1", str(session)]


def test_a_c_planner_refuses_another_abi_version(planner_bin, segment):
    # What a planner built against another header sees: a clear refusal at connect.
    _ready(segment)
    segment.header.abi_version = 1
    r = subprocess.run([planner_bin, segment.path], capture_output=True, text=True, timeout=20)
    assert r.returncode == 4 and r.stdout.split() == ["connect", str(int(Connect.ABI))]
    with pytest.raises(SegmentError, match="ABI version 1, this build speaks 2"):
        Segment.open_path(segment.path)


def test_a_second_c_planner_finds_the_segment_taken(planner_bin, segment):
    import fcntl

    _ready(segment)
    with open(segment.path, "rb") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what sf_session_lock takes
        r = subprocess.run([planner_bin, segment.path], capture_output=True, text=True, timeout=20)
    assert r.returncode == 10
