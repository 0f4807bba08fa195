"""Seed leases in tests: a driver that numbers one executor's plans, leases
prefixes by op, and serves whole requests (admit, decode, retire)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from superfluid.abi import CacheClass, Determinism
from superfluid.client.builder import PlanBuilder, sampling_params
from superfluid.testing.executor import BIG_BUDGET, SAMPLE, emit_of, emitted, fake, make_executor, put
from superfluid.testing.invariants import check_invariants

if TYPE_CHECKING:
    from superfluid.executor.executor import Executor

SPI = int(Determinism.SEED_PATH_INVARIANT)


class LeaseDriver:
    """Plans for one executor, numbered in order."""

    def __init__(self, ex: Executor):
        self.ex = ex
        self.seq = 0
        self.tag = 0

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def op(self, **msg):
        return self.ex.op({"op_id": 7, **msg})

    def lease(self, tokens, ttl: int = 4, **kw):
        return self.op(op="LEASE_SEED", tokens=list(tokens), ttl_ticks=ttl, **kw)

    def plan(self, **kw) -> PlanBuilder:
        return PlanBuilder(self.next_seq(), prefill_token_budget=BIG_BUDGET, **kw)

    def admit(self, prompt, *, seed: int = 0, value: int = 0, n: int = 6, sampling: int = SAMPLE,
              params=None, evict: bool = False, det: int = SPI):
        """Admit, prefill from `value`, decode n: (tag, result)."""
        self.tag += 1
        b = self.plan()
        if evict:
            b.evictable_cache_classes, b.max_evict_bytes = int(CacheClass.RESIDENT_PREFIX_CLASS), 1 << 40
        b.admit(self.tag, put(self.ex, prompt), sampling=sampling,
                params=params or sampling_params(temperature=0.9, top_k=20), rng_counter_base=100,
                seed_handle=seed, determinism_class=det)
        if value < len(prompt):
            b.prefill(self.tag, value, len(prompt) - value)
        if n:
            b.decode(self.tag, n)
        return self.tag, self.ex.tick(b.build())

    def serve(self, prompt, *, publish: bool = True, **kw) -> list[int]:
        """A whole request: admit, decode, retire (publishing): its tokens."""
        tag, r = self.admit(prompt, **kw)
        assert r.ok, r.message
        toks = emitted(self.ex, emit_of(r, tag))
        r2 = self.ex.tick(self.plan().retire(tag, publish_to_cache=publish).build())
        assert r2.ok, r2.message
        check_invariants(self.ex)
        return toks


def exe(**kw):
    ex_kw = {k: kw.pop(k) for k in ("host_cache_bytes", "cache_max_bytes", "max_leases", "state_dir") if k in kw}
    return LeaseDriver(make_executor(fake(eos_rate=0.0, **kw), **ex_kw))
