"""Fault schedules (executor/faults.py, engine/fault_runtime.py) on every
runtime: each kind of fault fires when its rule says, is reported as the
real one is and marked injected, and changes nothing else; the same seed
gives the same faults (another seed, others); bad rules are BadRequest
naming the field; without fault injection the ops are refused. And the
numeric check itself: a row that is really NaN (a checkpoint with a NaN in
its LM head) faults its lane NUMERIC, not injected, and no token is drawn."""

from __future__ import annotations

import time

import msgpack
import pytest
import torch
from hypothesis import given, settings, strategies as st

from superfluid.abi import Fault, OpStatus, Status
from superfluid.client.builder import PlanBuilder
from superfluid.engine import load
from superfluid.engine.tiny import write_tiny
from superfluid.executor.faults import INJECTED
from superfluid.testing.executor import HOST, admit_and_prefill, emit_of, emitted, fake, make_executor

PROMPT = [5, 6, 7, 8, 9, 10]
TAG = 7


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults")
    return {"transformer": str(write_tiny(d / "llama", seed=2)), "mamba2": str(write_tiny(d / "m2", arch="mamba2"))}


def runtime(kind: str, checkpoints):
    if kind == "fake":
        return fake(eos_rate=0.0)
    return load(checkpoints[kind], kv_cells=512) if kind == "transformer" else load(checkpoints[kind])


RUNTIMES = ("fake", "transformer", "mamba2")


def run(rt, rules=None, seed=0, ticks=6, grant=2, injection=True):
    """A lane prefilled then decoded `grant` tokens a tick; every tick's result."""
    ex = make_executor(rt, fault_injection=injection)
    if rules is not None:
        done = ex.op({"op": "INSTALL_FAULTS", "rules": rules, "seed": seed})
        assert done.status == OpStatus.OK, msgpack.unpackb(done.payload)
        assert done.value == len(rules)
    out = [admit_and_prefill(ex, 1, TAG, PROMPT, decode=grant)]
    for s in range(2, ticks + 1):
        b = PlanBuilder(s)
        if TAG in ex.lanes:
            b.decode(TAG, grant)
        out.append(ex.tick(b.build()))
    return ex, out


def faults(out):
    """(tick index, code, injected) of every lane fault."""
    return [(i, Fault(f.code), bool(f.detail & INJECTED)) for i, r in enumerate(out) for f in r.events.faults]


def tokens(ex, out):
    return [t for r in out if r.ok for e in r.events.emits if e.lane_tag == TAG for t in emitted(ex, e)]


@pytest.mark.parametrize("kind", RUNTIMES)
def test_each_fault_on_every_runtime(kind, checkpoints):
    base_ex, base = run(runtime(kind, checkpoints))
    want = tokens(base_ex, base)
    assert len(want) == 12 and not faults(base)

    # A lane fault at the 4th token (tick 2's second): a faulted lane's tick emits nothing.
    ex, out = run(runtime(kind, checkpoints), [{"when": {"token": 4}, "what": {"fault": "INTERNAL"}}])
    assert faults(out) == [(1, Fault.INTERNAL, True)]
    assert tokens(ex, out) == want[:2]
    assert ex.faults_injected["lane_fault"] == 1

    # A NaN row for the 3rd token: the sampler faults the lane NUMERIC; no token comes of it.
    ex, out = run(runtime(kind, checkpoints), [{"when": {"token": 3, "lane": TAG}, "what": {"nan": True}}])
    assert faults(out) == [(1, Fault.NUMERIC, True)]
    assert tokens(ex, out) == want[:2]
    assert ex.faults_injected["nan"] == 1

    # A capacity failure at tick 3's decode: that step's lanes fault OOM_TENTATIVE.
    ex, out = run(runtime(kind, checkpoints), [{"when": {"tick": 3}, "what": {"capacity": "decode"}}])
    assert faults(out) == [(2, Fault.OOM_TENTATIVE, True)]
    assert tokens(ex, out) == want[:4]

    # A fatal error at tick 3's decode: the executor is dead (a worker exits 70).
    ex, out = run(runtime(kind, checkpoints), [{"when": {"tick": 3}, "what": {"fatal": "decode"}}])
    assert [r.status for r in out[:4]] == [Status.OK, Status.OK, Status.Fatal, Status.Fatal]
    assert "injected fatal error during decode" in ex.dead

    # A stall and a slowdown take their time and change no token.
    ex, out = run(runtime(kind, checkpoints), [{"when": {"tick": 2}, "what": {"stall_ms": 300, "during": "decode"}},
                                               {"when": {"tick": 4}, "what": {"slow_ms": 60, "ticks": 2}}])
    wall = [r.events.timings.wall_ns / 1e6 for r in out]
    assert wall[1] >= 300 and min(wall[3], wall[4]) >= 2 * 60, wall  # two decode steps a tick
    assert ex.fault_rt.slow_until == 5  # ticks 4 and 5 (a timed upper bound would be flaky here)
    assert tokens(ex, out) == want and not faults(out)


def test_prefill_faults_and_a_lanes_first_token(checkpoints):
    ex, out = run(runtime("transformer", checkpoints), [{"when": {"tick": 1}, "what": {"capacity": "prefill"}}])
    assert faults(out) == [(0, Fault.OOM_TENTATIVE, True)]
    ex, out = run(runtime("transformer", checkpoints), [{"when": {"token": 1}, "what": {"nan": True}}])
    assert faults(out) == [(0, Fault.NUMERIC, True)] and not tokens(ex, out)


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 1 << 32), p=st.sampled_from([0.2, 0.5]))
def test_chance_rules_replay_from_their_seed(seed, p):
    """The same seed, the same faults; and the draw does depend on the seed."""
    rules = [{"when": {"chance": p}, "what": {"stall_ms": 1, "during": "decode"}},
             {"when": {"chance": p, "lane": TAG}, "what": {"fault": 2}, "times": 1}]

    def fired(s):
        ex, out = run(fake(eos_rate=0.0), rules, seed=s, ticks=12, grant=1)
        return faults(out), ex.faults_injected["stall"], ex.faults.listing()

    assert fired(seed) == fired(seed)
    listings = {str(fired(s)[2]) for s in range(seed, seed + 6)}
    assert len(listings) > 1, "six seeds drew the same faults"


def test_op_rules_list_and_clear():
    ex = make_executor(fake(), fault_injection=True)
    rules = [{"when": {"op": "DESCRIBE", "nth": 2}, "what": {"stall_ms": 200}},
             {"when": {"op": "LIST_LANES"}, "what": {"fatal": "now"}}]
    assert ex.op({"op": "INSTALL_FAULTS", "rules": rules}).value == 2
    t0 = time.monotonic()
    ex.op({"op": "DESCRIBE"})
    assert time.monotonic() - t0 < 0.15
    ex.op({"op": "DESCRIBE"})
    assert time.monotonic() - t0 >= 0.2
    listing = msgpack.unpackb(ex.op({"op": "LIST_FAULTS"}).payload)
    assert [r["fired"] for r in listing["rules"]] == [1, 0] and listing["rules"][0]["when"]["nth"] == 2
    done = ex.op({"op": "LIST_LANES"})
    assert done.status == OpStatus.Refused and "injected fatal error at LIST_LANES" in msgpack.unpackb(done.payload)[
        "error"]
    ex = make_executor(fake(), fault_injection=True)
    ex.op({"op": "INSTALL_FAULTS", "rules": [{"when": {"tick": 2}, "what": {"fault": 2}}]})
    assert ex.op({"op": "CLEAR_FAULTS"}).value == 1
    assert msgpack.unpackb(ex.op({"op": "LIST_FAULTS"}).payload)["rules"] == []
    admit_and_prefill(ex, 1, TAG, PROMPT, decode=2)
    assert not ex.tick(PlanBuilder(2).decode(TAG, 2).build()).events.faults  # cleared: nothing fires


def test_an_epoch_limited_rule_fires_only_there():
    for epoch, want in ((1, [(1, Fault.INTERNAL, True)]), (2, [])):
        ex = make_executor(fake(eos_rate=0.0), fault_injection=True, epoch=epoch)
        ex.op({"op": "INSTALL_FAULTS", "rules": [{"when": {"tick": 2, "epoch": 1}, "what": {"fault": 2}}]})
        out = [admit_and_prefill(ex, 1, TAG, PROMPT, decode=1), ex.tick(PlanBuilder(2).decode(TAG, 1).build())]
        assert faults(out) == want


BAD = [
    ({"rules": "x"}, "'rules'"),
    ({"rules": [{"when": {"token": 0}, "what": {"nan": True}}]}, "'rules[0].when.token'"),
    ({"rules": [{"when": {"tick": 1, "token": 2}, "what": {"nan": True}}]}, "'rules[0].when'"),
    ({"rules": [{"when": {"op": "NOPE"}, "what": {"fatal": "now"}}]}, "'rules[0].when.op'"),
    ({"rules": [{"when": {"op": "DESCRIBE"}, "what": {"nan": True}}]}, "'rules[0].what.nan'"),
    ({"rules": [{"when": {"tick": 1}, "what": {"stall_ms": 5}}]}, "'rules[0].what.during'"),
    ({"rules": [{"when": {"tick": 1}, "what": {"fatal": "now"}}]}, "'rules[0].what.fatal'"),
    ({"rules": [{"when": {"chance": 1.5}, "what": {"fault": 2}}]}, "'rules[0].when.chance'"),
    ({"rules": [{"when": {"tick": 1}, "what": {"fault": 99}}]}, "'rules[0].what.fault'"),
    ({"rules": [{"when": {"tick": 1}, "what": {"slow_ms": 5}}]}, "'rules[0].what.ticks'"),
    ({"rules": [{"when": {"tick": 1}, "what": {"fault": 2}, "times": 0}]}, "'rules[0].times'"),
    ({"rules": [], "seed": -1}, "'seed'"),
    ({"rules": [{"when": {"tick": 1}, "what": {"fault": "DETAIL_INJECTED"}}]}, "'rules[0].what.fault'"),
    ({"rules": [{"when": {"tick": 1}, "what": {"fault": 1 << 63}}]}, "'rules[0].what.fault'"),
]


@pytest.mark.parametrize("fields,named", BAD)
def test_bad_rules_name_their_field_and_change_nothing(fields, named):
    ex = make_executor(fake(), fault_injection=True)
    ex.op({"op": "INSTALL_FAULTS", "rules": [{"when": {"tick": 9}, "what": {"fault": 2}}]})
    done = ex.op({"op": "INSTALL_FAULTS", **fields})
    assert done.status == OpStatus.BadRequest
    assert named in msgpack.unpackb(done.payload)["error"]
    assert len(ex.faults) == 1  # the schedule before stays


def test_refused_without_fault_injection():
    ex = make_executor(fake())
    for name in ("INSTALL_FAULTS", "LIST_FAULTS", "CLEAR_FAULTS"):
        done = ex.op({"op": name, "rules": []})
        assert done.status == OpStatus.Refused and "--fault-injection" in msgpack.unpackb(done.payload)["error"]


def test_a_really_nan_row_faults_its_lane_and_no_token_is_drawn(tmp_path):
    """Not injected: a checkpoint whose LM head has a NaN row gives NaN logits
    for every token; engine-sampled and host-sampled lanes fault NUMERIC
    (detail 0), where before a token was drawn from garbage."""
    path = write_tiny(tmp_path / "nan", seed=2)
    from safetensors.torch import load_file, save_file

    f = next(path.glob("*.safetensors"))
    sd = load_file(f)
    sd["lm_head.weight"][3, 0] = float("nan")
    save_file(sd, f)
    for admit in ({}, {"sampling": HOST}):  # sampled on the device; a row for the planner
        ex = make_executor(load(str(path), kv_cells=256))
        r = admit_and_prefill(ex, 1, TAG, PROMPT, decode=1, **admit)
        assert [(f.lane_tag, Fault(f.code), f.detail) for f in r.events.faults] == [(TAG, Fault.NUMERIC, 0)]
        assert not [e for e in r.events.emits if e.lane_tag == TAG]
    assert torch.isnan(sd["lm_head.weight"]).any()


def test_emits_carry_on_after_an_injected_fault(checkpoints):
    """The schedule changes only the lane it hits: a second lane decodes on."""
    ex = make_executor(runtime("transformer", checkpoints), fault_injection=True)
    ex.op({"op": "INSTALL_FAULTS", "rules": [{"when": {"token": 2, "lane": TAG}, "what": {"nan": True}}]})
    admit_and_prefill(ex, 1, TAG, PROMPT, decode=3)
    r = admit_and_prefill(ex, 2, 9, PROMPT, decode=3)
    assert emit_of(r, 9).n_tokens == 3


def test_inject_fault_takes_only_fault_codes():
    """The detail's injected bit is not a code (it would not fit LaneFault.code)."""
    ex = make_executor(fake(eos_rate=0.0), fault_injection=True)
    admit_and_prefill(ex, 1, TAG, PROMPT, decode=1)
    done = ex.op({"op": "INJECT_FAULT", "lane_tag": TAG, "code": INJECTED})
    assert done.status == OpStatus.BadRequest and "'code'" in msgpack.unpackb(done.payload)["error"]


def test_a_nan_armed_for_a_retired_lane_stays_with_it():
    """A publishing retire keeps the lane's cells as a cache entry: a NaN
    armed for the lane's next row must not poison the entry's sequence."""
    ex = make_executor(fake(eos_rate=0.0), fault_injection=True)
    ex.op({"op": "INSTALL_FAULTS", "rules": [{"when": {"token": 3, "lane": TAG}, "what": {"nan": True}}]})
    admit_and_prefill(ex, 1, TAG, PROMPT, decode=2)  # token 2 taken: token 3's row is armed
    assert ex.fault_rt.nan_seqs
    assert ex.tick(PlanBuilder(2).retire(TAG, publish_to_cache=True).build()).ok
    assert not ex.fault_rt.nan_seqs and ex.faults.listing()["rules"][0]["fired"] == 0
