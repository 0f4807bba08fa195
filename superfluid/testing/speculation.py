"""Speculation in tests: a fake whose continuations cycle (so prompt lookup's
drafts hit), installing a strategy by op, and a driver that admits requests
and decodes them tick by tick, checking each emit's promises."""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING

import numpy as np

from superfluid.abi import Finish, OpStatus, PlanFlag
from superfluid.client.builder import PlanBuilder, sampling_params
from superfluid.engine.fake import FakeRuntime
from superfluid.executor.tick_rings import LocalRings
from superfluid.testing.executor import BIG_BUDGET, GREEDY, emit_of, emitted, put
from superfluid.testing.invariants import check_invariants

if TYPE_CHECKING:
    from superfluid.executor.executor import Executor


class Cycler(FakeRuntime):
    """A fake whose rows favour the token after the fed one (mod `period`):
    its continuations cycle, so prompt lookup's drafts hit. Rows still
    depend only on the history, so they stay batch- and chunk-invariant."""

    def __init__(self, period: int = 5, boost: float = 40.0, **kw):
        super().__init__(**kw)
        self.period, self.boost = period, np.float32(boost)

    def step(self, feeds):
        rows = super().step(feeds)
        for f, r in zip([f for f in feeds if f.wants_row], rows):
            r[(f.tokens[-1] + 1) % self.period] += self.boost
        return rows

    def step_rows(self, feeds):
        out = super().step_rows(feeds)
        for f, rows in zip(feeds, out or ()):
            for i, t in enumerate(f.tokens):
                rows[i, (t + 1) % self.period] += self.boost
        return out

    def step_sampled(self, feeds, specs, masks=None):
        return None  # its rows are not the fake's: the host samples them


def install(ex: Executor, slot: int = 1, *, max_draft: int = 8, ngram_min: int = 1, ngram_max: int = 4,
            kind: str = "prompt_lookup") -> int:
    done = ex.op({"op": "INSTALL_STRATEGY", "op_id": 7, "slot": slot, "kind": kind, "max_draft": max_draft,
                  "ngram_min": ngram_min, "ngram_max": ngram_max})
    assert done.status == int(OpStatus.OK), done
    return done.value


@dataclasses.dataclass
class Req:
    prompt: list[int]
    sampling: int = GREEDY
    params: object = dataclasses.field(default_factory=lambda: sampling_params(ignore_eos=True))
    base: int = 0
    slot: int = 0


class Driver:
    """Admits requests into one executor and decodes them tick by tick."""

    def __init__(self, ex: Executor):
        self.ex = ex
        self.seq = 0
        self.out: dict[int, list[int]] = {}
        self.finish: dict[int, int] = {}
        self.spec: dict[int, list[tuple]] = {}  # each tick's SpecStats
        self.counts: dict[int, list[int]] = {}  # each tick's tokens

    def plan(self, **kw) -> PlanBuilder:
        self.seq += 1
        return PlanBuilder(self.seq, prefill_token_budget=BIG_BUDGET, **kw)

    def admit(self, reqs: dict[int, Req], determinism: int = 0):
        b = self.plan()
        for tag, r in reqs.items():
            b.admit(tag, put(self.ex, r.prompt), sampling=r.sampling, params=r.params, rng_counter_base=r.base,
                    strategy_slot=r.slot, determinism_class=determinism)
            b.prefill(tag, 0, len(r.prompt))
            self.out[tag], self.spec[tag], self.counts[tag] = [], [], []
        res = self.ex.tick(b.build())
        assert res.ok, res.message
        return res

    def decode(self, grants: dict[int, tuple[int, int]], *, yield_: bool = False, partial: bool = False):
        """One tick decoding each lane (max_new_tokens, overshoot); its events, checked."""
        ex = self.ex
        b = self.plan(flags=int(PlanFlag.PARTIAL_EMITS) if partial else 0)
        for tag, (n, over) in grants.items():
            b.decode(tag, n, over)
        streamed: list[tuple[int, int]] = []
        ex.partial_sink = lambda seq, tag, tok, idx: streamed.append((tag, tok))
        rings = ex.rings
        assert isinstance(rings, LocalRings)  # the in-process rings carry the yield flag
        rings.yield_flag = yield_
        try:
            res = ex.tick(b.build())
        finally:
            rings.yield_flag = False
        assert res.ok, res.message
        assert not res.events.faults, res.events.faults
        check_invariants(ex)
        for tag, (n, over) in grants.items():
            e = emit_of(res, tag)
            toks = emitted(ex, e)
            s = e.spec
            assert s.accepted <= s.proposed
            # Past max_new_tokens only by taken drafts, and never past the overshoot.
            assert len(toks) <= n + min(over, s.accepted), (len(toks), n, over, s)
            if not yield_ and e.finish == int(Finish.NONE):
                assert len(toks) >= n
            if partial:
                assert [t for g, t in streamed if g == tag] == toks
            self.out[tag] += toks
            self.spec[tag].append(tuple(s))
            self.counts[tag].append(len(toks))
            if e.finish:
                self.finish[tag] = e.finish
        return res


def clock():
    """A deterministic executor clock (the gate's figures, and so its decisions, replay)."""
    return itertools.count(0, 1000).__next__
