"""`LocalClient`: the planner's calls answered in-process, ops and partial
emits included (contract §1: in-process, PARTIAL_EMITS stream as tokens are sampled)."""

from __future__ import annotations

from superfluid.abi import OpStatus, PlanFlag
from superfluid.client.builder import PlanBuilder
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
