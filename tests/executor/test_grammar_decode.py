"""Grammar lanes on the tiny model (issue 13): every sampled lane under a
JSON schema parses and validates, and without the grammar most do not;
regex, lark and choice outputs match; a lane re-admitted after a fault with
grammar_replay = generated continues as if uninterrupted; a matcher in
error faults its lane GRAMMAR_OVERFLOW while the others go on; and the
admit rules of contract §3 step 4 reject without changing anything."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from superfluid.abi import Fault, Finish, OpStatus, Sampling, Status
from superfluid.client.builder import PlanBuilder, sampling_params
from superfluid.client.local import LocalClient
from superfluid.client.planner import Planner
from superfluid.engine import load
from superfluid.engine.tiny import write_tiny
from superfluid.executor.executor import Executor
from superfluid.testing.executor import BIG_BUDGET, emit_of, put, small_rings
from superfluid.testing.invariants import assert_reject, assert_unchanged, snapshot

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "tag"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"type": "string", "maxLength": 6}}}
SAMPLED = sampling_params(1.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-grammar")
    write_tiny(d, arch="llama", seed=5)  # with its byte-level tokenizer.json
    return d


def executor(model_dir, **kw) -> Executor:
    return Executor(load(model_dir, "torch", kv_cells=1 << 14, max_batch=16), small_rings(), **kw)


def text(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def run(ex: Executor, reqs: list[dict], **planner_kw) -> list:
    p = Planner(LocalClient(ex), **planner_kw)
    ids = [p.submit(**r) for r in reqs]
    rep = p.run_until_done(600)
    return [rep.results[i] for i in ids]


def test_two_hundred_sampled_json_lanes_all_validate_and_without_the_grammar_most_do_not(model_dir):
    ex = executor(model_dir)
    grammar = ("json_schema", json.dumps(SCHEMA))
    reqs = [dict(prompt_tokens=[123, 34, 10 + i % 50], max_new_tokens=64, sampling=Sampling.GPU_SAMPLE,
                 params=SAMPLED, rng_base=1000 + i, grammar=grammar) for i in range(200)]
    got = run(ex, reqs)
    assert all(r.finish == "grammar" for r in got), {r.finish for r in got}
    for r in got:
        jsonschema.validate(json.loads(text(r.tokens)), SCHEMA)
    assert len({tuple(r.tokens) for r in got}) > 50  # sampled, not one answer 200 times
    assert not ex.registry.grammars.handles()  # every request's grammar released once it was done
    free = run(executor(model_dir), [{**r, "grammar": None} for r in reqs[:50]])
    valid = 0
    for r in free:
        try:
            jsonschema.validate(json.loads(text(r.tokens)), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    assert valid < 5  # the negative control: the model alone does not write this


@pytest.mark.parametrize("grammar, pattern", [
    (("regex", r"[a-f]{3}-[0-9]{2}"), r"[a-f]{3}-[0-9]{2}"),
    (("lark", 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/'), r"yes|no|maybe [0-9]"),
    (("choice", ["red", "green", "blue"]), r"red|green|blue"),
])
def test_regex_lark_and_choice(model_dir, grammar, pattern):
    ex = executor(model_dir)
    reqs = [dict(prompt_tokens=[5, 6, 7 + i], max_new_tokens=24, sampling=Sampling.GPU_SAMPLE, params=SAMPLED,
                 rng_base=i, grammar=grammar) for i in range(12)]
    reqs += [dict(prompt_tokens=[9, 9, 9], max_new_tokens=24, grammar=grammar)]  # greedy too
    for r in run(ex, reqs):
        assert r.finish == "grammar" and re.fullmatch(pattern, text(r.tokens)), (r.finish, text(r.tokens))


def test_a_faulted_grammar_lane_readmitted_with_its_replay_continues_bitwise(model_dir):
    grammar = ("json_schema", json.dumps(SCHEMA))
    reqs = [dict(prompt_tokens=[40, 41, 42 + i], max_new_tokens=64, sampling=Sampling.GPU_SAMPLE, params=SAMPLED,
                 rng_base=77 + i, grammar=grammar) for i in range(4)]
    plain = run(executor(model_dir), reqs, decode_grant=3)
    ex = executor(model_dir, fault_injection=True)
    p = Planner(LocalClient(ex), decode_grant=3)
    ids = [p.submit(**r) for r in reqs]
    hit = set()
    while p.busy():
        p.step()
        for lane in list(p.lanes.values()):  # fault each lane once, a few tokens in
            rid = lane.request.id
            if rid not in hit and len(lane.request.generated) >= 4 and not lane.retiring:
                assert ex.op({"op": "INJECT_FAULT", "op_id": 1, "lane_tag": lane.tag}).status == OpStatus.OK
                hit.add(rid)
    rep = p.report()
    assert hit == set(ids) and p.stats.faults == 4  # the negative control: each lane did fault
    assert all(rep.results[i].admissions == 2 for i in ids)
    assert [rep.results[i].tokens for i in ids] == [r.tokens for r in plain]


def test_a_matcher_in_error_faults_only_its_lane(model_dir):
    ex = executor(model_dir)
    h = ex.op({"op": "REGISTER_GRAMMAR", "op_id": 1, "kind": "regex", "text": "[a-z]{20}"}).handle
    h2 = ex.op({"op": "REGISTER_GRAMMAR", "op_id": 2, "kind": "regex", "text": "[a-z]{20}"}).handle
    b = PlanBuilder(1, prefill_token_budget=BIG_BUDGET)
    for tag, g in ((1, h), (2, h2)):
        b.admit(tag, put(ex, [3, 4, 5]), sampling=Sampling.GPU_SAMPLE, params=SAMPLED, grammar_handle=g)
        b.prefill(tag, 0, 3).decode(tag, 2)
    r = ex.tick(b.build())
    assert r.status == Status.OK and not r.events.faults
    ex.lanes[1].grammar._m.consume_token(ord("0"))  # llguidance's permanent error state, from outside
    b = PlanBuilder(2).decode(1, 2).decode(2, 2)
    r = ex.tick(b.build())
    assert [(f.lane_tag, f.code) for f in r.events.faults] == [(1, int(Fault.GRAMMAR_OVERFLOW))]
    assert emit_of(r, 2).n_tokens == 2 and 1 not in ex.lanes
    grammars = ex.registry.grammars
    assert grammars.available(h) and not grammars.available(h2)  # the fault gave its grammar back


def test_grammar_admit_rules_reject_and_change_nothing(model_dir):
    ex = executor(model_dir)
    h = ex.op({"op": "REGISTER_GRAMMAR", "op_id": 1, "kind": "regex", "text": "ab+c"}).handle

    def admit(tag, tokens=(97,), **kw):
        return PlanBuilder(ex.counters.last_plan_seq + 1 if ex.counters.last_plan_seq is not None else 1,
                           prefill_token_budget=BIG_BUDGET).admit(tag, put(ex, list(tokens)), **kw)

    def refused(b, field):
        assert_reject(ex, b.build(), Status.RejectIllegalCombination, field)

    refused(admit(1, grammar_handle=h + 100), "admits[0].grammar_handle")
    refused(admit(1, grammar_replay=1), "admits[0].grammar_replay")
    refused(admit(1, grammar_handle=h, sampling=Sampling.HOST), "admits[0].grammar_handle")
    refused(admit(1, grammar_handle=h).admit(2, put(ex, [97]), grammar_handle=h), "admits[1].grammar_handle")
    refused(admit(1, [97, 120], grammar_handle=h, grammar_replay=2), "admits[0].grammar_replay")
    refused(admit(1, [97], grammar_handle=h, grammar_replay=2), "admits[0].grammar_replay")
    # A replay the grammar takes: the lane's matcher goes on from it.
    r = ex.tick(admit(1, [3, 97, 98], grammar_handle=h, grammar_replay=2).prefill(1, 0, 3).decode(1, 8).build())
    assert r.status == Status.OK and emit_of(r, 1).finish in (int(Finish.GRAMMAR), int(Finish.NONE))
    # Borrowed by lane 1 now: a second lane may not take it, until lane 1 retires in the same plan.
    before = snapshot(ex)
    refused(admit(2, grammar_handle=h), "admits[0].grammar_handle")
    assert_unchanged(before, snapshot(ex))
    r = ex.tick(admit(2, grammar_handle=h).retire(1).prefill(2, 0, 1).build())
    assert r.status == Status.OK and ex.registry.grammars.borrower(h) == 2
