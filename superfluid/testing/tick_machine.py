"""The tick machine: a hypothesis state machine that plays the model planner
(superfluid.testing.model_planner) against an executor on the fake runtime, over
a table of runtime configurations (a subclass per configuration)."""

from __future__ import annotations

from collections import Counter

import msgpack
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from superfluid.abi import Fault, OpStatus
from superfluid.engine.fake import FakeRuntime
from superfluid.executor.executor import Executor
from superfluid.testing.executor import small_rings
from superfluid.testing.invariants import check_invariants
from superfluid.testing.model_planner import Planner

CONFIGS = [
    # a small pool and few slots: NeedsReplan and evictions; prefill in steps of 4 (yields cut it)
    dict(vocab_size=32, max_seq_len=48, page=4, cells_total=160, max_seqs=8, prefill_step_tokens=4,
         eos_rate=0.05),
    # engine sampling (step_sampled) and an unlimited pool
    dict(vocab_size=32, max_seq_len=48, page=4, engine_sampling=True, engine_draws=True, eos_rate=0.05,
         prefill_step_tokens=3, seed=7),
    # a recurrent runtime: exact-length cache keys, no row from a prefill that completes
    dict(vocab_size=40, max_seq_len=40, page=4, exact_only=True, cells_total=200, eos_rate=0.03),
    # tiny pages in a tight pool: most publishes are kept, admits must evict them
    dict(vocab_size=32, max_seq_len=32, page=2, cells_total=64, eos_rate=0.03, seed=3),
    # short sequences (LENGTH finishes), big pages, a tiny pool
    dict(vocab_size=32, max_seq_len=20, page=8, cells_total=96, max_batch=3, eos_rate=0.0,
         prefill_step_tokens=5),
    # copies that cost their cells, seeds that take their entry over
    dict(vocab_size=32, max_seq_len=40, page=4, cells_total=128, copy_shares_cells=False,
         takeover_preferred=True, eos_rate=0.03, seed=5),
]

COVERAGE: Counter[str] = Counter()


class TickMachine(RuleBasedStateMachine):
    planner: Planner

    cfg: int = 0  # which of CONFIGS (a subclass per config, see test_tick_machine)

    @initialize(data=st.data(), cache_max_bytes=st.sampled_from([None, None, 4096]),
                host=st.sampled_from([1 << 20, 0, 2048]))
    def setup(self, data, cache_max_bytes, host):
        kw = CONFIGS[self.cfg]
        rt = FakeRuntime(**kw)
        ex = Executor(rt, small_rings(), fault_injection=True, cache_max_bytes=cache_max_bytes,
                      host_cache_bytes=host, max_leases=6)
        self.planner = Planner(ex, data.draw, solo_check=True, solo_kwargs=kw)
        self.op_id = 0

    @property
    def ex(self) -> Executor:
        return self.planner.ex

    @rule(data=st.data())
    def tick(self, data):
        p = self.planner
        p.draw = data.draw
        b, meta = p.random_plan()
        p.tick(b, meta, yield_=p.coin(0.15), as_bytes=p.coin(0.2))

    @rule(data=st.data())
    def tick_again(self, data):  # ticks are what matters: give them more weight
        self.tick(data)

    @rule(data=st.data())
    def pressure(self, data):
        """A long prompt admitted and prefilled at once, the cache evictable for it."""
        p = self.planner
        p.draw = data.draw
        if not len(self.ex.cache):
            p.publish_one()  # something to evict
        b, meta = p.random_plan(pressure=True)
        p.tick(b, meta)

    @precondition(lambda self: any(not m.faulted for m in self.planner.lanes.values()))
    @rule(data=st.data())
    def inject_runtime_fault(self, data):
        """The fake fails the next step that feeds this lane's sequence (and
        so every lane of that step)."""
        p = self.planner
        p.draw = data.draw
        m = p.pick(p.live())
        p.rt.inject_fault(self.ex.lanes[m.tag].seq, code=int(Fault.INTERNAL))
        p.rt_injected.add(m.tag)

    @precondition(lambda self: any(not m.faulted for m in self.planner.lanes.values()))
    @rule(data=st.data())
    def inject_fault_op(self, data):
        """Op INJECT_FAULT: the lane faults at its next decode."""
        p = self.planner
        p.draw = data.draw
        m = p.pick(p.live())
        self.op_id += 1
        done = self.ex.op({"op": "INJECT_FAULT", "op_id": self.op_id, "lane_tag": m.tag,
                           "code": int(Fault.INJECTED)})
        assert done.status == int(OpStatus.OK) and done.op_id == self.op_id
        p.op_injected[m.tag] = int(Fault.INJECTED)

    @rule(data=st.data())
    def lease_or_release(self, data):
        """A lease the planner may never use (it expires), or a release."""
        p = self.planner
        p.draw = data.draw
        if p.leases and p.coin(0.5):
            h = p.pick(sorted(p.leases))
            done = p.op(op="RELEASE_SEED", handle=h)
            assert done.status in (int(OpStatus.OK), int(OpStatus.UnknownHandle))  # it may have expired
            p.leases.pop(h)
            p.stats["release"] += 1
        else:
            prefix = p.cached_prefix()
            if prefix:
                p.lease(prefix)

    @rule(data=st.data())
    def export_import(self, data):
        """EXPORT_ENTRY of a lease, IMPORT_STATE of it back: a bare sequence
        a later admit may adopt."""
        p = self.planner
        p.draw = data.draw
        prefix = p.cached_prefix()
        h = p.lease(prefix) if prefix else None
        if h is None:
            return
        done = p.op(op="EXPORT_ENTRY", handle=h)
        assert done.status == int(OpStatus.OK), done
        blob = msgpack.unpackb(done.payload)["blob"]
        toks = list(p.leases[h][0])
        cut = toks[:len(toks) - p.i(0, len(toks) - 1)] if not self.ex.desc.exact_only else toks
        imp = p.op(op="IMPORT_STATE", tokens=cut, blob=blob, ttl_ticks=p.pick([2, 6]))
        if imp.status == int(OpStatus.OK):
            p.leases[imp.handle] = (tuple(cut[:imp.value]), True)
            p.stats["import"] += 1
        else:  # a full pool or lease table, or less than a page of tokens
            assert imp.status in (int(OpStatus.Capacity), int(OpStatus.BadRequest)), imp

    @rule(data=st.data())
    def cache_clear(self, data):
        self.planner.draw = data.draw
        if not self.planner.coin(0.3):
            return
        ex = self.ex
        n = len(ex.cache)
        self.op_id += 1
        done = ex.op({"op": "CACHE_CLEAR", "op_id": self.op_id})
        assert done.status == int(OpStatus.OK)
        assert all(e.pins for e in ex.cache.all())  # only what a lease holds stays
        self.planner.pending_clear = len(ex.pending.shed)
        if n:
            self.planner.stats["cache_clear"] += 1

    @invariant()
    def invariants(self):
        if hasattr(self, "planner"):
            check_invariants(self.ex)

    def teardown(self):
        if hasattr(self, "planner"):
            self.planner.teardown()
            COVERAGE.update(self.planner.stats)


# What a run must have met (hypothesis explores; these are what the machine is for).
