"""A planner written in C against abi/superfluid.h and abi/sf_ring.c talks
to the Python side through a segment: the ABI is the header, not Python."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from superfluid import abi
from superfluid.abi import RingId
from superfluid.abi.records import LaneEmit, RingRef, TickEvents
from superfluid.engine.plan import decode_plan, encode_events_into

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


def test_a_c_planner_and_the_python_executor_side(planner_bin, segment):
    proc = subprocess.Popen([planner_bin, segment.path], stdout=subprocess.PIPE, text=True)
    try:
        plan = decode_plan(segment.plan_queue.peek(10))
        segment.plan_queue.release()
        (admit,) = plan.admits
        assert plan.plan_seq == 41 and admit.lane_tag == 7 and admit.prompt.ring_id == RingId.PROMPT
        assert plan.prefills[0].token_count == 4 and plan.decodes[0].max_new_tokens == 8
        assert segment.prompt_ring.read(admit.prompt).tolist() == [3, 1, 4, 1]
        emit = LaneEmit(lane_tag=7, token_ref=RingRef(RingId.TOKENS, 0, 0, 0))
        encode_events_into(segment.event_queue.reserve(1), TickEvents(plan_seq=plan.plan_seq, emits=(emit,)))
        segment.event_queue.publish()
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, proc.returncode
    assert out.split() == ["41", "0", "1"]
