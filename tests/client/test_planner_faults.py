"""The reference planner's faults that would come back (client/planner.py,
_absorb_faults): a lane whose row is not finite because the model makes it
so (a checkpoint with a poisoned embedding row, nothing injected) ends
"fault" after one fault, not re-admitted to fault again forever; a fault
every admission meets (a HOST row bigger than the logits ring) ends it after
max_fault_readmits re-admissions in a row; injected faults (NUMERIC ones
included) are re-admitted however many; the other requests of the run get
the tokens they get alone. Go's planner_faults_test.go checks the counting
(OOM_TENTATIVE and progress) rule by itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from superfluid.abi import Fault, OpStatus
from superfluid.client import GPU_GREEDY, HOST, Planner
from superfluid.client.local import LocalClient
from superfluid.engine import load
from superfluid.executor.executor import Executor
from superfluid.executor.tick_rings import LocalRings
from superfluid.testing.checkpoints import poisoned_tiny
from superfluid.testing.executor import fake, make_executor, small_rings

POISON = 7  # the token whose embedding row is made +inf


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    return poisoned_tiny(tmp_path_factory.mktemp("poisoned") / "m", POISON)


def _run(ex: Executor, reqs: list[dict], **kw):
    p = Planner(LocalClient(ex), **kw)
    ids = [p.submit(**r) for r in reqs]
    rep = p.run_until_done(120)
    return p, [rep.results[i] for i in ids]


def test_a_row_the_model_makes_non_finite_ends_its_request_after_one_fault(poisoned):
    rt = load(poisoned, "torch", kv_cells=4096, max_batch=8, dtype=torch.float32)
    reqs = [dict(prompt_tokens=[3, 4, 5], max_new_tokens=6, stop_at_eos=False),
            dict(prompt_tokens=[9, POISON, 2], max_new_tokens=6, stop_at_eos=False),
            dict(prompt_tokens=[11, 12], max_new_tokens=6, stop_at_eos=False)]
    p, got = _run(Executor(rt, small_rings()), reqs)
    bad = got[1]
    assert p.stats.faults == 1 and (bad.finish, bad.tokens, bad.admissions) == ("fault", [], 1)
    for req, res in ((reqs[0], got[0]), (reqs[2], got[2])):
        _, (alone,) = _run(Executor(rt, small_rings()), [req])
        assert (res.finish, res.tokens) == ("max_tokens", alone.tokens) and len(res.tokens) == 6
    rt.close()


def test_a_fault_every_admission_meets_ends_after_max_fault_readmits():
    # A HOST row (vocab 64 floats) never fits a 32-float logits ring: REF_SPAN_OOB each time.
    rings = LocalRings(prompt_tokens=1 << 12, emit_tokens=1 << 12, logits_floats=32)
    reqs = [dict(prompt_tokens=[1, 2, 3], max_new_tokens=5, sampling=HOST,
                 host_sampler=lambda row, pos: int(np.argmax(row))),
            dict(prompt_tokens=[4, 5], max_new_tokens=5, sampling=GPU_GREEDY, stop_at_eos=False)]
    p, (host, greedy) = _run(make_executor(fake(), rings=rings), reqs, max_fault_readmits=2)
    assert p.stats.faults == 3 and (host.finish, host.admissions) == ("fault", 3)
    _, (alone,) = _run(make_executor(fake()), [reqs[1]])
    assert greedy.tokens == alone.tokens and len(greedy.tokens) == 5
    with pytest.raises(ValueError, match="max_fault_readmits"):
        Planner(LocalClient(make_executor(fake())), max_fault_readmits=-1)


def test_injected_faults_are_re_admitted_however_many():
    ex = make_executor(fake(), fault_injection=True)
    p = Planner(LocalClient(ex), decode_grant=1, max_fault_readmits=0)
    rid = p.submit([1, 2, 3], max_new_tokens=6, stop_at_eos=False)
    hits = 0
    while p.busy():
        p.step()
        for lane in list(p.lanes.values()):  # fault the lane at each of its first 3 tokens
            if hits < 3 and len(lane.request.generated) == hits + 1 and not lane.retiring:
                code = Fault.NUMERIC if hits % 2 else Fault.INTERNAL  # an injected NUMERIC does not end it
                assert ex.op({"op": "INJECT_FAULT", "op_id": hits + 1, "lane_tag": lane.tag,
                              "code": int(code)}).status == OpStatus.OK
                hits += 1
    res = p.report().results[rid]
    _, (alone,) = _run(make_executor(fake()), [dict(prompt_tokens=[1, 2, 3], max_new_tokens=6,
                                                     stop_at_eos=False)])
    assert p.stats.faults == 3 and res.admissions == 4  # the negative control: each injection did fault
    assert (res.finish, res.tokens) == ("max_tokens", alone.tokens)
