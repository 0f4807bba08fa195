"""The tick machine (test_tick_machine.py) with strategies installed: most
admits name a strategy slot, strategies are reinstalled mid-run and the gate
is forced on, off or left to its (deterministic) measure. Everything the
machine checks still holds after every tick (cells conserved, forward-once,
the planner's view equals the executor's, a plan that does not fit changes
nothing), and every retired lane's tokens equal its solo run without a
strategy: drafting changes no token, whatever batches, pools and faults it
met."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import initialize, rule, run_state_machine_as_test

from superfluid.abi import OpStatus
from superfluid.engine.fake import FakeRuntime
from superfluid.executor.executor import Executor
from superfluid.testing.executor import small_rings
from superfluid.testing.model_planner import Planner
from superfluid.testing.speculation import clock
from superfluid.testing.tick_machine import CONFIGS, TickMachine

# A tight pool; engine sampling; LENGTH finishes. Small vocabularies, so that the fake's random
# continuations match their drafts now and then.
SPEC_CONFIGS = [dict(CONFIGS[0], vocab_size=6), dict(CONFIGS[1], vocab_size=8), dict(CONFIGS[4], vocab_size=6)]
SEEN: Counter[str] = Counter()


class SpecPlanner(Planner):
    """Names a strategy slot in most admits (overshoot stays 0: the
    planner's checks hold every emit to its max_new_tokens)."""

    def random_plan(self, **kw):
        b, meta = super().random_plan(**kw)
        for i, a in enumerate(b.admits):
            if self.coin(0.75, default=True):
                b.admits[i] = a._replace(strategy_slot=self.pick([1, 2]))
        return b, meta

    def tick(self, b, meta=None, **kw):
        r = super().tick(b, meta, **kw)
        for e in r.events.emits:
            self.stats["spec_proposed"] += e.spec.proposed
            self.stats["spec_accepted"] += e.spec.accepted
        return r


def strategy(p: Planner, slot: int) -> dict:
    lo = p.i(1, 3)
    return {"op": "INSTALL_STRATEGY", "op_id": 5, "slot": slot, "kind": "prompt_lookup",
            "max_draft": p.pick([4, 1, 2, 8, 16]), "ngram_min": lo, "ngram_max": lo + p.i(0, 2)}


class SpecMachine(TickMachine):
    @initialize(data=st.data(), cache_max_bytes=st.sampled_from([None, 4096]), host=st.sampled_from([1 << 20, 0]))
    def setup(self, data, cache_max_bytes, host):
        kw = SPEC_CONFIGS[self.cfg]
        ex = Executor(FakeRuntime(**kw), small_rings(), fault_injection=True, cache_max_bytes=cache_max_bytes,
                      host_cache_bytes=host, max_leases=6, clock=clock())
        self.planner = SpecPlanner(ex, data.draw, solo_check=True, solo_kwargs=kw)
        self.op_id = 0
        for slot in (1, 2):
            assert ex.op(strategy(self.planner, slot)).status == int(OpStatus.OK)
        ex.registry.spec_gate.force = True

    @rule(data=st.data())
    def reinstall(self, data):
        p = self.planner
        p.draw = data.draw
        done = self.ex.op(strategy(p, p.pick([1, 2])))
        assert done.status == int(OpStatus.OK) and done.value == self.ex.registry.strategies.next_cert - 1
        p.stats["reinstall"] += 1

    @rule(force=st.sampled_from([True, None, False]))
    def gate(self, force):
        self.ex.registry.spec_gate.force = force

    def teardown(self):
        if hasattr(self, "planner"):
            self.planner.teardown()
            SEEN.update(self.planner.stats)


def test_the_tick_machine_with_drafting_lanes():
    SEEN.clear()
    for cfg in range(len(SPEC_CONFIGS)):
        machine = type(f"SpecMachine{cfg}", (SpecMachine,), {"cfg": cfg})
        run_state_machine_as_test(machine, settings=settings(
            max_examples=8, stateful_step_count=25, deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    for what in ("ok", "tokens", "solo", "spec_proposed", "spec_accepted", "reinstall", "needs_replan", "yield"):
        assert SEEN[what] > 0, (what, SEEN)
