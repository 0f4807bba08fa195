"""`LocalClient`: the planner's calls answered in-process, ops and partial
emits included (contract §1: in-process, PARTIAL_EMITS stream as tokens are sampled)."""

from __future__ import annotations

import dataclasses

import pytest

from superfluid.abi import OpStatus, PlanFlag
from superfluid.client import ClientError, Parallel
from superfluid.client.builder import PlanBuilder
from superfluid.client.describe import parallel_of
from superfluid.client.local import LocalClient
from superfluid.engine.fake import FakeRuntime
from superfluid.executor import Executor


def test_partial_emits_stream_in_process():
    client = LocalClient(Executor(FakeRuntime(vocab_size=64, eos_rate=0.0)))
    ref = client.write_prompt([1, 2, 3])
    b = PlanBuilder(0, prefill_token_budget=64, flags=int(PlanFlag.PARTIAL_EMITS))
    ev = client.tick(b.admit(7, ref).prefill(7, 0, 3).decode(7, 5))
    toks = client.tokens(ev.emits[0])
    parts = client.partial_emits()
    assert len(toks) == 5 and [(p.lane_tag, p.token_id, p.index) for p in parts] == [
        (7, t, i) for i, t in enumerate(toks)]
    assert all(p.plan_seq == ev.plan_seq for p in parts)
    assert client.partial_emits() == []  # drained
    # without the flag nothing streams
    client.tick(PlanBuilder(0).decode(7, 2))
    assert client.partial_emits() == []


def test_ops_run_at_once():
    client = LocalClient(Executor(FakeRuntime(vocab_size=64)))
    assert client.op("LEASE_SEED", tokens=[1, 2], ttl_ticks=1).status == int(OpStatus.NoMatch)
    assert client.describe()["runtime"]["vocab_size"] == 64


def test_parallel_layout_through_the_executor():
    assert LocalClient(Executor(FakeRuntime())).parallel() == Parallel(tp=1, nnodes=1)
    rt = FakeRuntime()
    rt.desc = dataclasses.replace(rt.desc, tp=2, nnodes=1)  # as a tensor-parallel runtime states it
    client = LocalClient(Executor(rt))
    assert client.parallel() == Parallel(tp=2, nnodes=1)
    assert client.describe()["parallel"] == {"tp": 2, "nnodes": 1}


def test_parallel_of_a_payload():
    assert parallel_of({}) == Parallel(1, 1)  # an older worker: no key
    assert parallel_of({"parallel": {"tp": 4, "nnodes": 2}}) == Parallel(4, 2)
    assert parallel_of({"parallel": {"tp": 4}}) == Parallel(4, 1)
    for bad, field in [({"tp": 0, "nnodes": 1}, "tp"), ({"tp": 2, "nnodes": 0}, "nnodes"),
                       ({"tp": 2, "nnodes": 3}, "nnodes"), ({"tp": True}, "tp"), ({"tp": "2"}, "tp"),
                       ([2, 1], "parallel")]:
        with pytest.raises(ClientError, match=field):
            parallel_of({"parallel": bad})
