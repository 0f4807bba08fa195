"""Seeded lanes on the tiny real model (paged transformer, torch backend)
equal unseeded ones bitwise, greedy and sampled, on every path the runtime
takes: a copy (full blocks shared, the partial one copied), a whole-prompt
seed (the last token held back), an import from the host tier, and the
adoption of a sequence another executor exported. Negative control: a
seed of other tokens' cells changes the tokens, so the equality is not
vacuous. The reference planner, leasing for each turn of a chat, gives the
tokens it gives without leases."""

from __future__ import annotations

import msgpack
import pytest

from superfluid.abi import CacheClass, Determinism, OpStatus, Sampling
from superfluid.client.builder import PlanBuilder, sampling_params
from superfluid.engine import load
from superfluid.engine.tiny import write_tiny
from superfluid.executor.executor import Executor
from superfluid.testing.executor import BIG_BUDGET, emit_of, emitted, leased_chat, put, small_rings
from superfluid.testing.invariants import check_invariants

SPI = int(Determinism.SEED_PATH_INVARIANT)
SAMPLE = int(Sampling.GPU_SAMPLE)
SYSTEM = [(i * 37 + 11) % 250 + 3 for i in range(45)]  # 2 whole pages of 16 and 13 more


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-seeds")
    write_tiny(d, arch="llama", seed=13, tokenizer=False)
    return d


def runtime(model_dir, kv_cells=4096):
    return load(model_dir, "torch", kv_cells=kv_cells, max_batch=4)


class Run:
    def __init__(self, rt, **kw):
        self.ex = Executor(rt, small_rings(), **kw)
        self.seq = 0
        self.tag = 0

    def plan(self) -> PlanBuilder:
        self.seq += 1
        return PlanBuilder(self.seq, prefill_token_budget=BIG_BUDGET)

    def op(self, **msg):
        return self.ex.op({"op_id": 1, **msg})

    def request(self, prompt, *, seed=None, n=8, sampling=SAMPLE, publish=True, evict=False) -> list[int]:
        self.tag += 1
        b = self.plan()
        if evict:
            b.evictable_cache_classes, b.max_evict_bytes = int(CacheClass.RESIDENT_PREFIX_CLASS), 1 << 40
        value = seed.value if seed else 0
        b.admit(self.tag, put(self.ex, prompt), sampling=sampling, rng_counter_base=77,
                params=sampling_params(temperature=0.8, top_k=40, ignore_eos=True),
                seed_handle=seed.handle if seed else 0, determinism_class=SPI)
        if value < len(prompt):
            b.prefill(self.tag, value, len(prompt) - value)
        r = self.ex.tick(b.decode(self.tag, n).build())
        assert r.ok, r.message
        toks = emitted(self.ex, emit_of(r, self.tag))
        assert self.ex.tick(self.plan().retire(self.tag, publish_to_cache=publish).build()).ok
        check_invariants(self.ex)
        return toks

    def lease(self, tokens):
        done = self.op(op="LEASE_SEED", tokens=list(tokens), ttl_ticks=4)
        assert done.status == int(OpStatus.OK), done
        return done


def oracle(model_dir, prompt, **kw) -> list[int]:
    rt = runtime(model_dir)
    try:
        return Run(rt).request(prompt, **kw)
    finally:
        rt.close()


@pytest.mark.parametrize("sampling", [0, SAMPLE])
def test_copy_seed_equals_plain(model_dir, sampling):
    turn2 = SYSTEM + [5, 6, 7, 8, 9]
    want = oracle(model_dir, turn2, sampling=sampling)
    rt = runtime(model_dir)
    try:
        r = Run(rt)
        r.request(SYSTEM, sampling=sampling)
        seed = r.lease(turn2)
        assert seed.value == 32  # the system prompt's 2 whole pages (its third holds the answer's tokens)
        assert r.request(turn2, seed=seed, sampling=sampling) == want
        # the whole prompt leased: its last token is held back and decoded at once
        same = r.lease(SYSTEM)
        assert same.value == 32
        assert r.request(SYSTEM[:32], seed=same, sampling=sampling) == oracle(model_dir, SYSTEM[:32],
                                                                              sampling=sampling)
    finally:
        rt.close()


def test_negative_control_other_cells_change_the_tokens(model_dir):
    """The seeded equality is not vacuous: the same request over another
    prompt's cells (copied under the wrong key) decodes differently."""
    rt = runtime(model_dir)
    try:
        r = Run(rt)
        r.request([(t + 50) % 250 + 3 for t in SYSTEM], sampling=SAMPLE)
        (entry,) = list(r.ex.cache)
        r.ex.cache.remove(entry)  # re-keyed under SYSTEM: a lie the executor cannot see
        r.ex.cache.insert(entry.seq, tuple(SYSTEM) + entry.tokens[45:], 45, entry.bytes, 0)
        seed = r.lease(SYSTEM + [5])
        got = r.request(SYSTEM + [5], seed=seed)
        assert got != oracle(model_dir, SYSTEM + [5])
    finally:
        rt.close()


def test_import_from_the_host_tier_equals_plain(model_dir):
    turn2 = SYSTEM + [5, 6, 7]
    want = oracle(model_dir, turn2)
    rt = runtime(model_dir, kv_cells=96)  # 6 pages: the second request pushes the first out
    try:
        r = Run(rt, cache_max_bytes=None)
        r.request(SYSTEM, n=4)  # 49 cells kept: 3 pages, 4 with the block being filled
        r.request([9] * 60, n=4, evict=True)
        assert r.ex.cache.exported(), "the first entry went to host memory"
        seed = r.lease(turn2)
        assert seed.value == 32 and not r.ex.leases.get(seed.handle).entry.resident
        assert r.request(turn2, seed=seed, evict=True) == want
    finally:
        rt.close()


def test_adopting_an_exported_sequence_on_another_executor(model_dir):
    turn2 = SYSTEM + [5, 6, 7]
    want = oracle(model_dir, turn2)
    a_rt, b_rt = runtime(model_dir), runtime(model_dir)
    try:
        a, b = Run(a_rt), Run(b_rt)
        a.request(SYSTEM)
        blob = msgpack.unpackb(a.op(op="EXPORT_ENTRY", handle=a.lease(turn2).handle).payload)["blob"]
        imp = b.op(op="IMPORT_STATE", tokens=turn2[:32], blob=blob, ttl_ticks=3)
        assert imp.status == int(OpStatus.OK) and imp.value == 32, imp
        assert b.request(turn2, seed=imp) == want
        assert not list(b.ex.cache.all()) or all(not e.bare for e in b.ex.cache.all())
    finally:
        a_rt.close()
        b_rt.close()


def test_planner_with_leases_gives_the_tokens_it_gives_without(model_dir):
    """Three conversations over one system prompt, three turns each; every
    turn appends the answer and a new question."""
    plain, s0 = leased_chat(lambda: runtime(model_dir), SYSTEM, 3, use_leases=False)
    leased, s1 = leased_chat(lambda: runtime(model_dir), SYSTEM, 3, use_leases=True)
    assert leased == plain
    assert s0.seeded_tokens == 0 and s1.seeded_tokens >= 3 * 2 * 32, s1


@pytest.mark.parametrize("sampling", [0, SAMPLE])
def test_takeover_seed_equals_plain(model_dir, sampling):
    """The transformer shares blocks on copy, so it never asks for a
    takeover; described as preferring them, the next turn takes the entry's
    own sequence, cut back to the seed, and decodes what a plain run does."""
    import dataclasses

    from superfluid.abi import ShedReason

    turn2 = SYSTEM + [5, 6, 7]
    want = oracle(model_dir, turn2, sampling=sampling)
    rt = runtime(model_dir)
    rt.desc = dataclasses.replace(rt.desc, copy_shares_cells=False, takeover_preferred=True)
    try:
        r = Run(rt)
        r.request(SYSTEM, sampling=sampling)
        seed = r.lease(turn2)
        (entry,) = list(r.ex.cache)
        seq = entry.seq
        r.tag += 1
        b = r.plan().admit(r.tag, put(r.ex, turn2), sampling=sampling, rng_counter_base=77,
                           params=sampling_params(temperature=0.8, top_k=40, ignore_eos=True),
                           seed_handle=seed.handle, determinism_class=SPI)
        res = r.ex.tick(b.prefill(r.tag, 32, len(turn2) - 32).decode(r.tag, 8).build())
        assert res.ok, res.message
        assert [e.reason for e in res.events.shed.entries] == [int(ShedReason.TAKEOVER)]
        assert r.ex.lanes[r.tag].seq == seq and not list(r.ex.cache)  # the entry's own sequence
        assert emitted(r.ex, emit_of(res, r.tag)) == want
        check_invariants(r.ex)
    finally:
        rt.close()
