"""Differential tests on a tiny real model (the paged transformer, torch
backend, CPU or GPU): a lane's tokens depend only on its prompt, params and
rng positions (contract §9, SEED_PATH_INVARIANT), not on what shares its
batches, how its prompt was chunked, or how its decode was split into
grants across ticks. Every lane of a randomly scheduled batched run equals
a SOLO run of it, bitwise: greedy lanes, engine-sampled lanes
(GPU_SAMPLE, on the device), host-sampled lanes of the executor (logprobs
asked) and HOST lanes whose client draws with engine.sampling at position
rng_counter_base + tokens sampled so far. Recovery (re-admit prompt +
generated with decode_replay and the advanced rng base) continues exactly
where the uninterrupted run went."""

from __future__ import annotations

import dataclasses
import random

import pytest

from superfluid.abi import Finish, Sampling, Status
from superfluid.abi.records import SamplingParams
from superfluid.client.builder import PlanBuilder, sampling_params
from superfluid.engine import load
from superfluid.engine.tiny import write_tiny
from superfluid.executor.executor import Executor
from superfluid.kernels import reference_sampler as reference
from superfluid.testing.executor import BIG_BUDGET, emit_of, emitted, put, small_rings
from superfluid.testing.invariants import check_invariants

GREEDY, SAMPLE, HOST = int(Sampling.GPU_GREEDY), int(Sampling.GPU_SAMPLE), int(Sampling.HOST)


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-diff")
    write_tiny(d, arch="llama", seed=11, tokenizer=False)
    runtime = load(d, "torch", kv_cells=8192, max_batch=4)
    yield runtime
    runtime.close()


@pytest.fixture
def clean(rt):
    """Every test leaves the shared runtime's pool empty."""
    yield rt
    m = rt.mem_counters()
    assert m.seqs == 0 and m.cells_used == 0, m


@dataclasses.dataclass
class Spec:
    prompt: list[int]
    n: int  # tokens wanted
    sampling: int
    params: SamplingParams
    base: int
    logprobs: int = 0  # want_logprobs: the executor samples this lane on the host


def solo(rt, s: Spec, *, sampling: int | None = None) -> tuple[list[int], int]:
    """The lane alone, on a fresh executor: one tick, whole prompt, whole grant."""
    ex = Executor(rt, small_rings())
    samp = s.sampling if sampling is None else sampling
    assert samp != HOST
    ref = put(ex, s.prompt)
    b = PlanBuilder(1, prefill_token_budget=BIG_BUDGET).admit(1, ref, sampling=samp, params=s.params,
                                                              rng_counter_base=s.base)
    r = ex.tick(b.prefill(1, 0, len(s.prompt)).decode(1, s.n).build())
    assert r.status == Status.OK, r.message
    e = emit_of(r, 1)
    toks = emitted(ex, e)
    assert ex.tick(PlanBuilder(2).retire(1).build()).ok
    return toks, e.finish


def client_pick(row, s: Spec, sampled: int) -> int:
    """What a HOST lane's client draws: the engine's generator at base + sampled."""
    p = s.params
    if p.temperature <= 0:
        return reference.greedy(row)
    return reference.sample(row, p.temperature, p.top_k, p.top_p, p.min_p, s.base + sampled)


@dataclasses.dataclass
class Run:
    spec: Spec
    tag: int
    admitted: bool = False
    prefilled: int = 0
    out: list[int] = dataclasses.field(default_factory=list)
    finish: int = 0
    nonce: int = 0
    row: object = None
    done: bool = False
    retired: bool = False


def batched(rt, specs: list[Spec], rnd: random.Random) -> list[Run]:
    """Run every lane in one executor on a random schedule: staggered admits,
    prompts in random chunks under a random prefill budget (shed chunks
    continue from where the executor says), random decode grants, HOST
    lanes committed by their client."""
    ex = Executor(rt, small_rings())
    runs = [Run(s, tag=i + 1) for i, s in enumerate(specs)]
    seq = 0
    for _ in range(2000):
        if all(r.retired for r in runs):
            break
        seq += 1
        budget = BIG_BUDGET if rnd.random() < 0.4 else rnd.randint(1, 24)
        b = PlanBuilder(seq, prefill_token_budget=budget)
        used: set[int] = set()
        for r in runs:  # retire the lanes that are done (not in the same plan as anything else)
            if r.admitted and not r.retired and r.done and r.nonce == 0:
                b.retire(r.tag)
                used.add(r.tag)
        waiting = [r for r in runs if not r.admitted]
        for r in waiting[:rnd.choice([0, 1, 1, 2])]:
            s = r.spec
            b.admit(r.tag, put(ex, s.prompt), sampling=s.sampling, params=s.params, rng_counter_base=s.base,
                    want_logprobs=s.logprobs)
            r.admitted = True
        left, reached, planned = budget, {}, {}
        live = [r for r in runs if r.admitted and not r.retired and r.tag not in used]
        rnd.shuffle(live)
        for r in live:
            rest = len(r.spec.prompt) - r.prefilled
            if len(b.prefills) == rt.desc.max_batch:
                break  # see test_prefill_of_more_lanes_than_max_batch
            if rest and rnd.random() < 0.8:
                count = rest if rnd.random() < 0.4 else rnd.randint(1, rest)
                b.prefill(r.tag, r.prefilled, count)
                planned[r.tag] = (r.prefilled, count)
                take = min(count, left)
                left -= take
                reached[r.tag] = r.prefilled + take
        for r in live:
            if r.done or reached.get(r.tag, r.prefilled) != len(r.spec.prompt) or rnd.random() < 0.2:
                continue
            if len(b.decodes) == rt.desc.max_batch:
                break
            if r.spec.sampling == HOST:
                if r.nonce:
                    b.commit(r.tag, r.out[-1], r.nonce)
                    r.nonce = 0
                    if len(r.out) == r.spec.n or r.finish:
                        r.done = True
                        continue
                b.decode(r.tag, 1)
            else:
                b.decode(r.tag, rnd.randint(1, min(7, r.spec.n - len(r.out))))
        res = ex.tick(b.build())
        assert res.status == Status.OK, res.message
        check_invariants(ex)
        assert not res.events.faults
        for rr in b.retires:
            next(r for r in runs if r.tag == rr.lane_tag).retired = True
        shed = {}
        for e in res.events.shed.entries:
            shed[e.lane_tag] = shed.get(e.lane_tag, 0) + e.tokens
        for tag, (off, count) in planned.items():
            runs[tag - 1].prefilled = off + count - shed.get(tag, 0)
        for e in res.events.emits:
            r = runs[e.lane_tag - 1]
            if r.spec.sampling == HOST:
                if e.logits_row.ring_id:
                    row = ex.rings.logits.read(e.logits_row)
                    tok = client_pick(row, r.spec, len(r.out))
                    r.out.append(tok)
                    r.nonce = e.logits_nonce
                    if rt.is_eos(tok) and not r.spec.params.flags & 1:
                        r.finish = int(Finish.EOS)  # the client stops at EOS: commit it, then retire
            else:
                r.out += emitted(ex, e)
                if e.finish:
                    r.finish, r.done = e.finish, True
                if len(r.out) == r.spec.n:
                    r.done = True
    assert all(r.retired for r in runs)
    return runs


def random_spec(rnd: random.Random, sampling: int) -> Spec:
    prompt = [rnd.randrange(0, 256) for _ in range(rnd.randint(1, 40))]
    temp = 0.0 if sampling == GREEDY else rnd.choice([0.6, 1.0, 1.3])
    params = sampling_params(temperature=temp, top_k=rnd.choice([0, 0, 8, 40]), top_p=rnd.choice([0.0, 0.9]),
                             min_p=rnd.choice([0.0, 0.02]), ignore_eos=rnd.random() < 0.5)
    return Spec(prompt, rnd.randint(1, 24), sampling, params, base=rnd.randrange(1 << 48),
                logprobs=rnd.choice([0, 0, 1, 3]) if sampling != HOST else 0)


@pytest.mark.parametrize("seed", range(6))
def test_batched_lanes_equal_their_solo_runs(clean, seed):
    rnd = random.Random(seed)
    rt = clean
    specs = [random_spec(rnd, k) for k in (GREEDY, SAMPLE, HOST)]
    specs.append(dataclasses.replace(random_spec(rnd, SAMPLE), logprobs=2))  # sampled by the executor's host
    specs += [random_spec(rnd, rnd.choice([GREEDY, SAMPLE, SAMPLE, HOST])) for _ in range(rnd.randint(0, 4))]
    rnd.shuffle(specs)
    # two lanes with one prompt and params and different rng bases: sampled, they part ways
    twin = dataclasses.replace(random_spec(rnd, SAMPLE), n=20)
    twin = dataclasses.replace(twin, params=twin.params._replace(temperature=1.0, top_k=0, top_p=0.0,
                                                                 min_p=0.0))
    specs += [twin, dataclasses.replace(twin, base=twin.base + 1)]
    runs = batched(rt, specs, rnd)
    for r in runs:
        s = r.spec
        # a HOST lane's client drew as the engine would: it equals the engine-sampled lane
        ref, finish = solo(rt, s, sampling=(SAMPLE if s.params.temperature > 0 else GREEDY)
                           if s.sampling == HOST else None)
        assert r.out == ref, (r.tag, s, r.out, ref)
        if s.sampling != HOST:
            assert r.finish == finish
    assert runs[-1].out != runs[-2].out  # the rng position is the only difference between the twins


def test_the_rng_base_is_the_sampled_lanes_only_key(clean):
    """The negative control: a different rng_counter_base gives another
    sequence, the same base the same one, greedy ignores it."""
    rt = clean
    params = sampling_params(temperature=1.0, ignore_eos=True)
    s = Spec(list(range(20, 50)), 24, SAMPLE, params, base=1000)
    a, _ = solo(rt, s)
    assert solo(rt, s)[0] == a
    assert solo(rt, dataclasses.replace(s, base=1001))[0] != a
    assert solo(rt, dataclasses.replace(s, base=1000 + (1 << 40)))[0] != a
    g = dataclasses.replace(s, sampling=GREEDY)
    assert solo(rt, g)[0] == solo(rt, dataclasses.replace(g, base=7))[0]
    assert solo(rt, g)[0] != a


@pytest.mark.parametrize("sampling, n, m", [(SAMPLE, 9, 12), (GREEDY, 5, 10), (SAMPLE, 1, 6),
                                            (SAMPLE, 17, 1)])
def test_recovery_continues_exactly(clean, sampling, n, m):
    """contract §9: a lane run N tokens, then re-admitted fresh with prompt +
    generated, decode_replay = N, rng_counter_base = base + N, continues
    with exactly the tokens the uninterrupted run produced — whatever its
    replay grants."""
    rt = clean
    params = sampling_params(temperature=1.0 if sampling == SAMPLE else 0.0, top_k=50, top_p=0.95,
                             ignore_eos=True)
    s = Spec([7, 3, 99, 250, 31, 8, 14, 200, 5], n + m, sampling, params, base=123456789)
    whole, _ = solo(rt, s)
    assert len(whole) == n + m
    first, _ = solo(rt, dataclasses.replace(s, n=n))
    assert first == whole[:n]
    for grants in ([n + m], [1] * (n + m), [n, m], [max(1, n - 1), 2, m]):
        ex = Executor(rt, small_rings())
        prompt = s.prompt + first
        b = PlanBuilder(1, prefill_token_budget=BIG_BUDGET).admit(
            1, put(ex, prompt), sampling=sampling, params=params, rng_counter_base=s.base + n,
            decode_replay=n)
        assert ex.tick(b.prefill(1, 0, len(s.prompt)).build()).ok
        got, seq, left = [], 1, n + m
        for g in grants:
            g = min(g, left)
            if g == 0:
                break
            seq += 1
            r = ex.tick(PlanBuilder(seq).decode(1, g).build())
            assert r.ok, r.message
            got += emitted(ex, emit_of(r, 1))
            left -= g
            check_invariants(ex)
        assert got == whole[n:], (grants, got, whole[n:])
        assert ex.tick(PlanBuilder(seq + 1).retire(1).build()).ok


def test_recovery_of_a_host_lane(clean):
    """A HOST lane re-admitted after N client-drawn tokens continues with the
    client drawing at base + N: the same tokens as without the restart."""
    rt = clean
    params = sampling_params(temperature=0.9, top_k=30, ignore_eos=True)
    s = Spec([1, 2, 3, 4, 5, 6], 10, HOST, params, base=555)
    whole, _ = solo(rt, s, sampling=SAMPLE)
    n = 4
    ex = Executor(rt, small_rings())
    spec2 = dataclasses.replace(s, prompt=s.prompt + whole[:n], base=s.base + n)
    b = PlanBuilder(1, prefill_token_budget=BIG_BUDGET).admit(
        1, put(ex, spec2.prompt), sampling=HOST, params=params, rng_counter_base=spec2.base, decode_replay=n)
    assert ex.tick(b.prefill(1, 0, len(s.prompt)).build()).ok
    got, seq, nonce = [], 1, 0
    while len(got) < s.n - n:
        seq += 1
        b = PlanBuilder(seq)
        if nonce:
            b.commit(1, got[-1], nonce)
        r = ex.tick(b.decode(1, 1).build())
        assert r.ok, r.message
        e = emit_of(r, 1)
        nonce = e.logits_nonce if e.logits_row.ring_id else 0
        if nonce:  # replay rounds (one a tick for a HOST lane) give no row
            got.append(client_pick(ex.rings.logits.read(e.logits_row), spec2, len(got)))
    assert seq == 1 + n + (s.n - n)  # n replay ticks, then one row a tick
    assert got == whole[n:]
    assert ex.tick(PlanBuilder(seq + 1).retire(1).build()).ok


def test_prefill_of_more_lanes_than_max_batch(clean):
    rt = clean
    ex = Executor(rt, small_rings())
    b = PlanBuilder(1, prefill_token_budget=BIG_BUDGET)
    for tag in range(1, rt.desc.max_batch + 2):
        b.admit(tag, put(ex, [tag, 2, 3])).prefill(tag, 0, 3)
    r = ex.tick(b.build())
    try:
        assert r.ok and not r.events.faults, r.events.faults
    finally:
        retire = PlanBuilder(2)
        for tag in list(ex.lanes) + sorted(ex.lanes.faulted):
            retire.retire(tag)
        assert ex.tick(retire.build()).ok
