"""A model planner that drives an executor with random VALID plans (drawn
by hypothesis) and checks every tick against its own view of each lane."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import strategies as st

from superfluid.abi import (
    CacheClass,
    Determinism,
    Fault,
    Finish,
    OpStatus,
    PlanFlag,
    ShedKind,
    ShedReason,
    Status,
)
from superfluid.abi.records import RingRef, SamplingParams
from superfluid.client.builder import PlanBuilder, sampling_params
from superfluid.engine.fake import FakeRuntime
from superfluid.executor.executor import Executor, TickResult
from superfluid.executor.seeds import is_bare
from superfluid.kernels import reference_sampler as reference
from superfluid.testing.executor import BIG_BUDGET, GREEDY, HOST, SAMPLE, emitted, make_executor, put
from superfluid.testing.invariants import assert_unchanged, check_events, check_invariants, snapshot


@dataclasses.dataclass
class LaneModel:
    """The planner's view of one lane."""

    tag: int
    prompt: list[int]
    replay: int
    sampling: int
    params: SamplingParams
    base: int
    prefilled: int = 0
    finished: bool = False
    faulted: bool = False
    nonce: int | None = None  # a pending logits row's nonce (HOST)
    row: np.ndarray | None = None
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: int = 0  # want_logprobs
    seeded: int = 0  # prompt tokens a seed lease covered at admission

    @property
    def prefill_end(self) -> int:
        return max(len(self.prompt) - self.replay, self.seeded)


Draw = Callable[[Any], Any]


class Planner:
    """Drives an executor with random valid plans and checks every tick.

    `draw` is hypothesis' data.draw; the planner keeps its own view of every
    lane (what it admitted, how far prefill got, the pending rows it must
    commit) from the events alone, and compares it with the executor after
    each tick."""

    def __init__(self, ex: Executor, draw: Draw, *, solo_check: bool = False,
                 solo_kwargs: dict[str, Any] | None = None):
        self.ex = ex
        self.draw = draw
        self.seq = 0
        self.lanes: dict[int, LaneModel] = {}
        self.retired: set[int] = set()
        self.next_tag = 1
        self.stats: Counter[str] = Counter()
        self.op_injected: dict[int, int] = {}  # tag -> fault code, from op INJECT_FAULT
        self.rt_injected: set[int] = set()  # tags whose sequence has a fake fault pending
        self.pending_clear = 0  # CACHE_CLEAR evictions the next tick must report
        self.solo_check = solo_check
        self.solo_kwargs = solo_kwargs or {}
        self.replan = False
        self.leases: dict[int, tuple[tuple[int, ...], bool]] = {}  # handle -> (prefix, from an import)
        self.op_id = 1000
        self.seeds_used: set[int] = set()  # leases an admit of the plan being built uses
        self.taken: set[int] = set()
        self.partials: list[tuple[int, int, int, int]] = []
        ex.partial_sink = lambda seq, tag, tok, idx: self.partials.append((seq, tag, tok, idx))

    # ------------------------------------------------------------ helpers

    @property
    def rt(self) -> FakeRuntime:
        return self.ex.runtime  # type: ignore[return-value]

    def live(self) -> list[LaneModel]:
        return [m for m in self.lanes.values() if not m.faulted]

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def i(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi))

    def coin(self, p: float = 0.5, *, default: bool = False) -> bool:
        """True with probability ~p; `default` is what the simplest draw (0)
        gives, so a shrunk example does the ordinary thing."""
        x = self.draw(st.integers(0, 999))
        return x < int(p * 1000) if default else x >= 1000 - int(p * 1000)

    def pick(self, xs: list):
        return self.draw(st.sampled_from(xs))

    # ------------------------------------------------------------ plans

    def op(self, **msg):
        self.op_id += 1
        return self.ex.op({"op_id": self.op_id, **msg})

    def lease(self, tokens) -> int | None:
        """LEASE_SEED for `tokens`; the handle, or None (NoMatch)."""
        done = self.op(op="LEASE_SEED", tokens=[int(t) for t in tokens], ttl_ticks=self.pick([1, 3, 8]))
        if done.status == int(OpStatus.OK):
            entry = self.ex.leases.get(done.handle).entry
            chosen = [self.ex.leases.get(h) for h in self.seeds_used]
            if any(ls is not None and ls.adopt and ls.entry is entry for ls in chosen):
                # It would take away the bareness an admit of this plan adopts.
                assert self.op(op="RELEASE_SEED", handle=done.handle).status == int(OpStatus.OK)
                return None
            self.leases[done.handle] = (tuple(tokens[:done.value]), False)
            self.stats["lease"] += 1
            return done.handle
        assert done.status in (int(OpStatus.NoMatch), int(OpStatus.Capacity)), done
        return None

    def usable_lease(self, prompt: list[int], replay: int = 0) -> int | None:
        """A live lease (the planner sees the executor's tick count, as the
        op's ttl says) that seeds this prompt (on exact_only, short of the
        tokens decode feeds: the held-back one and the replayed ones)."""
        for h, (prefix, _imported) in sorted(self.leases.items(), key=lambda kv: (not kv[1][1], kv[0])):
            ls = self.ex.leases.get(h)
            if ls is None or ls.expires <= self.ex.counters.tick_count or h in self.seeds_used:
                continue
            if tuple(prompt[:len(prefix)]) != prefix or (self.ex.desc.exact_only and
                                                         len(prefix) > len(prompt) - replay - 1):
                continue
            if ls.adopt and not is_bare(ls):
                continue
            return h
        return None

    def cached_prefix(self) -> list[int]:
        """Some cached tokens to start a prompt with (so leases hit)."""
        imported = sorted(p for p, imp in self.leases.values() if imp)
        if imported and self.coin(0.5, default=True):
            return list(self.pick(imported))  # an import's bare sequence, to adopt
        entries = self.ex.cache.all()
        if not entries or not self.coin(0.6, default=True):
            return []
        e = self.pick(sorted(entries, key=lambda e: e.eid))
        return list(e.tokens[:len(e.tokens) - self.i(0, len(e.tokens) - 1)])  # the simplest draw: all of it

    def new_lane(self, *, long: bool = False) -> tuple[LaneModel, RingRef]:
        vocab, limit = self.ex.desc.vocab_size, self.ex.desc.max_seq_len
        n = self.i(limit * 2 // 3, limit) if long else self.i(1, min(24, limit))
        eos = self.rt.vocabulary().eos
        prompt = self.draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
        prompt = [t if t not in eos else 0 for t in prompt]  # EOS in a prompt is fine, but keep it plain
        if not long:
            start = self.cached_prefix()
            prompt = (start + prompt)[:limit]
            n = len(prompt)
        sampling = self.pick([GREEDY, SAMPLE, HOST])
        temp = self.pick([0.0, 0.7, 1.0, 1.5])  # GPU_GREEDY ignores it
        params = sampling_params(temperature=temp, top_k=self.pick([0, 5]), top_p=self.pick([0.0, 0.9]),
                                 min_p=self.pick([0.0, 0.05]), ignore_eos=self.coin(0.3))
        if self.coin(0.2):  # penalties: the executor samples the lane on the host, over its history
            params = params._replace(repeat_penalty=self.pick([1.0, 1.3]), presence_penalty=self.pick([0.0, 0.5]),
                                     freq_penalty=self.pick([0.0, 0.25]))
        replay = self.i(0, n - 1) if self.coin(0.3) else 0
        # Tags come back: a retired lane's, or a faulted lane's not yet retired (its
        # admit replaces it); else a fresh one.
        reuse = sorted(self.retired - set(self.lanes) - self.taken)
        faulted = sorted(m.tag for m in self.lanes.values() if m.faulted and m.tag not in self.taken)
        if reuse and self.coin(0.25):
            tag = self.pick(reuse)
        elif faulted and self.coin(0.2):
            tag = self.pick(faulted)
        else:
            tag, self.next_tag = self.next_tag, self.next_tag + 1
        self.taken.add(tag)
        m = LaneModel(tag, prompt, replay, sampling, params, base=self.i(0, 1 << 40))
        if sampling != HOST and self.coin(0.25):
            m.logprobs = self.pick([1, 2, 5])
        return m, put(self.ex, prompt)

    def random_plan(self, *, allow_admits: bool = True,
                    pressure: bool = False) -> tuple[PlanBuilder, dict[str, Any]]:
        """A random plan the executor must accept (or answer NeedsReplan).
        pressure: it also admits and prefills a long prompt, allowing the
        cache to be evicted for it (a full pool makes room that way)."""
        ex = self.ex
        desc = ex.desc
        budget = BIG_BUDGET if pressure or self.coin(0.6, default=True) else self.i(0, 12)
        evict = pressure or self.coin(0.5)
        cap = 1 << 40 if pressure else self.pick([1 << 40, self.i(0, 4096)]) if evict else 0
        quota = self.pick([0, 0, self.i(0, 4096)]) if evict and not pressure else 0
        b = PlanBuilder(self.next_seq(), prefill_token_budget=budget,
                        evictable_cache_classes=int(CacheClass.RESIDENT_PREFIX_CLASS) if evict else 0,
                        max_evict_bytes=cap, protected_quota_bytes=quota)
        meta: dict[str, Any] = dict(new={}, grants={}, prefill={}, replay_left={})
        used: set[int] = set()  # tags with a prefill, decode or commit: not retired in this plan
        self.taken = set()  # tags admitted in this plan
        # Retires first (their lanes then take part in nothing else): faulted and
        # finished lanes mostly, now and then one in the middle of its work.
        for m in list(self.lanes.values()):
            if self.coin(0.6 if m.faulted or m.finished else 0.4 if self.replan else 0.06):
                b.retire(m.tag, publish_to_cache=self.coin(0.5))
        self.replan = False
        retiring = {r.lane_tag for r in b.retires}
        # (A faulted tag retired here is not re-admitted in the same plan: the executor
        # refuses to prefill or decode a tag the plan also retires, even a new lane's.)
        self.taken = set(retiring)
        # Admits.
        self.seeds_used: set[int] = set()
        if allow_admits and len(self.lanes) < 10:
            for _ in range(self.pick([1, 0, 0, 1, 2])):
                m, ref = self.new_lane()
                seed = 0
                if self.coin(0.6, default=True):
                    asked = m.prompt[:max(0, len(m.prompt) - m.replay - 1)] if self.ex.desc.exact_only else m.prompt
                    if asked and self.coin(0.8, default=True):
                        self.lease(asked)
                    seed = self.usable_lease(m.prompt, m.replay) or 0
                if seed:
                    self.seeds_used.add(seed)
                    m.seeded = len(self.leases[seed][0])
                    m.prefilled = m.seeded
                    self.stats["seeded"] += 1
                    if not self.ex.leases.get(seed).entry.resident:
                        self.stats["seed_from_host"] += 1
                    if self.leases[seed][1]:
                        self.stats["seed_adopt"] += 1
                b.admit(m.tag, ref, sampling=m.sampling, params=m.params, rng_counter_base=m.base,
                        decode_replay=m.replay, want_logprobs=m.logprobs, seed_handle=seed,
                        determinism_class=int(Determinism.SEED_PATH_INVARIANT) if seed else 0)
                meta["new"][m.tag] = m
        if pressure:
            m, ref = self.new_lane(long=True)
            m.replay = 0
            b.admit(m.tag, ref, sampling=m.sampling, params=m.params, rng_counter_base=m.base,
                    want_logprobs=m.logprobs)
            b.prefill(m.tag, 0, len(m.prompt))
            meta["new"][m.tag] = m
            meta["prefill"][m.tag] = (0, len(m.prompt))
            used.add(m.tag)
        cands = [m for m in self.live() if m.tag not in retiring] + list(meta["new"].values())
        # Prefills, in a random order, each lane from where it is: often all of
        # the rest, sometimes a chunk.
        left = budget
        reached: dict[int, int] = {}
        order = [m for m in cands if m.prefilled < m.prefill_end and m.tag not in meta["prefill"]]
        if pressure:
            m = meta["new"][b.prefills[0].lane_tag]
            reached[m.tag] = left = min(len(m.prompt), budget)
            left = budget - left
        order = self.draw(st.permutations(order)) if order else []
        for m in order:
            if not self.coin(0.8, default=True):
                continue
            rest = m.prefill_end - m.prefilled
            count = rest if self.coin(0.5, default=True) else self.i(0, rest)
            b.prefill(m.tag, m.prefilled, count)
            take = min(count, left)
            left -= take
            reached[m.tag] = m.prefilled + take
            meta["prefill"][m.tag] = (m.prefilled, count)
            used.add(m.tag)
        # Commits: HOST lanes with a pending row.
        committing: set[int] = set()
        for m in cands:
            if m.sampling != HOST or m.nonce is None or m.finished:
                continue
            if self.coin(0.85, default=True):
                greedy = self.coin(0.5, default=True)
                tok = reference.greedy(m.row) if greedy else self.i(0, desc.vocab_size - 1)
                b.commit(m.tag, tok, m.nonce)
                committing.add(m.tag)
                used.add(m.tag)
        # Decodes: lanes whose prefill is complete by the end of this tick.
        for m in cands:
            if len(b.decodes) >= desc.max_batch or m.finished:
                continue
            if reached.get(m.tag, m.prefilled) != m.prefill_end:
                continue
            if m.sampling == HOST and m.nonce is not None and m.tag not in committing:
                continue
            if not self.coin(0.85, default=True):
                continue
            grant = 1 if m.sampling == HOST else self.pick([3, 0, 1, 2, 5, 8, 13])
            b.decode(m.tag, grant)
            meta["grants"][m.tag] = grant
            used.add(m.tag)
            lane = ex.lanes.get(m.tag)
            meta["replay_left"][m.tag] = len(m.prompt) - m.prefill_end if lane is None else max(
                0, len(lane.prompt) - max(len(lane.committed), lane.prefill_end))
        if self.coin(0.2) and b.decodes:
            b.max_decode_lanes = self.i(len(b.decodes), desc.max_batch)
        if not b.admits and self.coin(0.1):
            b.flags |= int(PlanFlag.DRAIN)
        if self.coin(0.3):
            b.flags |= int(PlanFlag.PARTIAL_EMITS)
        assert not (used & retiring)
        return b, meta

    def publish_one(self) -> None:
        """Retire the live lane holding the most cells, publishing it to the cache."""
        live = [m for m in self.live() if m.tag in self.ex.lanes]
        if not live:
            return
        m = max(live, key=lambda m: self.rt.seq_len(self.ex.lanes[m.tag].seq))
        self.tick(PlanBuilder(self.next_seq()).retire(m.tag, publish_to_cache=True))

    # ------------------------------------------------------------ ticking

    def tick(self, b: PlanBuilder, meta: dict[str, Any] | None = None, *, yield_: bool = False,
             as_bytes: bool = False) -> TickResult:
        """Tick a valid plan; check the events and the invariants; update the model."""
        ex = self.ex
        meta = meta or dict(new={}, grants={}, prefill={}, replay_left={})
        plan = b.build()
        ex.sweep_leases()  # what the check does first (contract §3 step 3): even a reject may sweep
        before = snapshot(ex)
        ex.rings.yield_flag = yield_
        self.partials = []
        try:
            r = ex.tick(b.encode() if as_bytes else plan)
        finally:
            ex.rings.yield_flag = False
        if r.status == Status.NeedsReplan:
            # The check is conservative; a plan that does not fit changes nothing.
            assert ex.runtime.mem_counters().cells_total or ex.desc.max_seqs, r.message
            assert_unchanged(before, snapshot(ex))
            self.stats["needs_replan"] += 1
            self.seq -= 1  # plan_seq did not move
            self.replan = True  # the next plan makes room, as a planner would
            return r
        assert r.status == Status.OK, f"a valid plan was refused: {r.message}"
        self.stats["ok"] += 1
        self.leases = {h: v for h, v in self.leases.items() if self.ex.leases.get(h) is not None}
        ev = r.events
        check_events(ex, plan, r)
        check_invariants(ex)
        if yield_:
            self.stats["yield"] += 1
        # Faults: only lanes with an injection pending, or their step's company.
        for f in ev.faults:
            assert f.code in (int(Fault.INTERNAL), int(Fault.INJECTED)), f"unexpected fault {f}"
            self.stats[f"fault_{f.code}"] += 1
        if ev.faults:
            fault_tags = {f.lane_tag for f in ev.faults}
            assert fault_tags & (self.rt_injected | set(self.op_injected)), (ev.faults, self.rt_injected)
        for tag in self.op_injected:
            if tag in meta["grants"] and tag not in {f.lane_tag for f in ev.faults}:
                raise AssertionError(f"lane {tag} decoded with an injected fault pending, and did not fault")
        # Shed report.
        shed_by_lane: Counter[int] = Counter()
        for s in ev.shed.entries:
            if s.kind == int(ShedKind.PREFILL_CHUNK):
                shed_by_lane[s.lane_tag] += s.tokens
                self.stats[f"shed_reason_{s.reason}"] += 1
            else:
                self.stats[f"evict_reason_{s.reason}"] += 1
        assert ev.shed.evictions_performed >= self.pending_clear
        self.pending_clear = 0
        # Budget shedding is exactly what the check computed: each chunk takes
        # what is left of prefill_token_budget, in plan order; the rest is one
        # PREFILL_CHUNK entry (BUDGET). Only a yield sheds more (YIELD).
        left, want_budget = plan.prefill_token_budget, {}
        for x in plan.prefills:
            take = min(x.token_count, left)
            left -= take
            if x.token_count > take:
                want_budget[x.lane_tag] = x.token_count - take
        got_budget = {s.lane_tag: s.tokens for s in ev.shed.entries
                      if s.kind == int(ShedKind.PREFILL_CHUNK) and s.reason == int(ShedReason.BUDGET)}
        assert got_budget == want_budget, (got_budget, want_budget)
        if not yield_:
            assert dict(shed_by_lane) == want_budget
        # Retires.
        for rr in plan.retires:
            m = self.lanes.pop(rr.lane_tag)
            self.retired.add(rr.lane_tag)
            self.op_injected.pop(rr.lane_tag, None)
            self.rt_injected.discard(rr.lane_tag)
            self.stats["retire_publish" if rr.publish_to_cache else "retire"] += 1
            if self.solo_check and not m.faulted:
                self.solo(m)
        # Commits.
        for c in plan.commits:
            m = self.lanes[c.lane_tag]
            m.nonce, m.row = None, None
            m.generated.append(c.token_id)
            self.stats["commit"] += 1
        # Admits.
        for tag, m in meta["new"].items():
            self.lanes[tag] = m
        # Prefill progress: what was planned less what was shed.
        for tag, (off, count) in meta["prefill"].items():
            m = self.lanes[tag]
            m.prefilled = off + count - shed_by_lane.get(tag, 0)
            assert m.prefilled >= off
        # Faults.
        for f in ev.faults:
            m = self.lanes[f.lane_tag]
            m.faulted = True
            m.nonce = m.row = None
            self.op_injected.pop(f.lane_tag, None)
            self.rt_injected.discard(f.lane_tag)
        # Emits.
        for e in ev.emits:
            m = self.lanes[e.lane_tag]
            grant = meta["grants"][e.lane_tag]
            replay_left = meta["replay_left"][e.lane_tag]
            expect = max(0, grant - replay_left)
            if m.sampling == HOST:
                if e.logits_row.ring_id:
                    m.nonce = e.logits_nonce
                    m.row = ex.rings.logits.read(e.logits_row)
                    self.stats["host_row"] += 1
                elif not yield_ and e.finish == int(Finish.NONE):
                    assert expect == 0, f"HOST lane {m.tag} got no row"
            else:
                toks = emitted(ex, e)
                m.generated.extend(toks)
                self.stats["tokens"] += len(toks)
                if not yield_ and e.finish == int(Finish.NONE):
                    assert len(toks) == expect, (m.tag, grant, replay_left, len(toks))
                else:
                    assert len(toks) <= expect
            if e.finish != int(Finish.NONE):
                m.finished = True
                self.stats[f"finish_{e.finish}"] += 1
        # Logprobs: one record per emitted token of a lane that asked, in order.
        by_lane: dict[int, list] = {}
        for lp in ev.logprobs:
            by_lane.setdefault(lp.lane_tag, []).append(lp)
        assert set(by_lane) <= {d.lane_tag for d in plan.decodes}
        for e in ev.emits:
            m = self.lanes[e.lane_tag]
            recs = by_lane.get(e.lane_tag, [])
            if not m.logprobs or m.sampling == HOST:
                assert not recs
                continue
            toks = emitted(ex, e)
            assert [(r.index, r.token_id) for r in recs] == list(enumerate(toks))
            for rec in recs:
                assert rec.logprob <= 0 and rec.n_top <= m.logprobs - 1
                assert rec.token_id not in rec.top_ids[:rec.n_top]
                self.stats["logprob"] += 1
        # Partial emits (PARTIAL_EMITS): each emitted token streamed once, in order, as sampled.
        streamed: dict[int, list[int]] = {}
        for seq_, tag, tok, idx in self.partials:
            assert seq_ == plan.plan_seq
            assert idx == len(streamed.setdefault(tag, []))
            streamed[tag].append(tok)
        if not plan.flags & PlanFlag.PARTIAL_EMITS:
            assert not streamed
        else:
            self.stats["partial"] += len(self.partials)
            for e in ev.emits:
                if self.lanes[e.lane_tag].sampling != HOST:
                    assert streamed.get(e.lane_tag, []) == emitted(ex, e)
        # The planner's view and the executor's agree.
        assert {m.tag for m in self.live()} == set(ex.lanes)
        assert {m.tag for m in self.lanes.values() if m.faulted} == ex.lanes.faulted
        for m in self.live():
            lane = ex.lanes[m.tag]
            assert lane.prefilled == m.prefilled, (m.tag, lane.prefilled, m.prefilled)
            assert lane.finished == m.finished
            assert (lane.pending_row.nonce if lane.pending_row else None) == m.nonce
            gen = lane.committed[len(lane.prompt):]
            assert gen == m.generated, (m.tag, gen, m.generated)
        return r

    def solo(self, m: LaneModel) -> None:
        """A non-HOST lane's tokens are those of the same lane run alone, in
        one tick, on a fresh runtime (sampled on the other path: engine
        sampling flipped), whatever batches, chunks and grants it went
        through."""
        if m.sampling == HOST or not m.generated:
            return
        kw = dict(self.solo_kwargs, cells_total=0, max_seqs=0, prefill_step_tokens=0)
        flip = not self.ex.desc.engine_sampling
        kw.update(engine_sampling=flip, engine_draws=flip)
        ex = make_executor(FakeRuntime(**kw))
        ref = put(ex, m.prompt)
        b = PlanBuilder(1, prefill_token_budget=BIG_BUDGET).admit(
            1, ref, sampling=m.sampling, params=m.params, rng_counter_base=m.base, decode_replay=m.replay)
        b.prefill(1, 0, len(m.prompt) - m.replay).decode(1, m.replay + len(m.generated))
        r = ex.tick(b.build())
        assert r.status == Status.OK, r.message
        assert emitted(ex, r.events.emits[0]) == m.generated, f"lane {m.tag} differs from its solo run"
        self.stats["solo"] += 1

    def teardown(self) -> None:
        """Retire everything, clear the cache: every cell is free."""
        ex = self.ex
        for publish in (True, False):  # publishing needs a cell for the held-back token
            b = PlanBuilder(self.next_seq())
            for m in self.lanes.values():
                b.retire(m.tag, publish_to_cache=publish and not m.faulted and self.coin(0.5))
            if not b.retires:
                self.seq -= 1
                break
            if self.tick(b).status == Status.OK:
                break
        assert not ex.lanes and not ex.lanes.faulted
        for ls in ex.leases:  # pinned entries stay through a clear
            assert self.op(op="RELEASE_SEED", handle=ls.handle).status == int(OpStatus.OK)
        done = ex.op({"op": "CACHE_CLEAR", "op_id": 99})
        assert done.status == 0
        n = len(ex.pending.shed)
        r = self.tick(PlanBuilder(self.next_seq()))
        assert r.events.shed.evictions_performed == n
        mem = ex.runtime.mem_counters()
        assert mem.cells_used == 0 and mem.seqs == 0, mem
        assert len(ex.cache) == 0
