"""Admission (contract §4): seed takeovers, then each admit, fresh or seeded
by the path the memory check chose (seeds.py says what each path does).
"""

from __future__ import annotations

from superfluid.abi import Determinism, ParamFlag, Sampling, ShedReason
from superfluid.abi.records import AdmitResult
from superfluid.engine.runtime import CapacityError, FatalError, Feed, RuntimeFailure
from superfluid.executor import host_sampling as hs
from superfluid.executor.check import admitted_span
from superfluid.executor.decode import lane_fault
from superfluid.executor.lanes import Lane
from superfluid.executor.seeds import SeedUse
from superfluid.executor.speculation import LaneSpec, drafts
from superfluid.executor.tick_state import TickState

_GREEDY, _HOST = int(Sampling.GPU_GREEDY), int(Sampling.HOST)
_IGNORE_EOS = int(ParamFlag.IGNORE_EOS)


def grant(asked: int, holds: int) -> int:
    """The class an admit is granted: what it asked, where what holds
    implies it; else what holds (SEED_PATH_INVARIANT implies DISTRIBUTION_EXACT)."""
    best, spi, dist = Determinism.BEST_EFFORT, Determinism.SEED_PATH_INVARIANT, Determinism.DISTRIBUTION_EXACT
    implied: dict[int, set[int]] = {spi: {best, spi, dist}, dist: {best, dist}}
    return asked if asked in implied.get(holds, {best}) else holds


class AdmitPhase(TickState):
    """The admission phases of a Tick (tick.py holds the rest)."""

    def takeovers(self) -> None:
        """Seeds that take their entry's own sequence, cut to the seed."""
        ex = self.ex
        for a in self.plan.admits:
            use = self.verdict.seeds.get(a.lane_tag)
            if use is None or use.path != "takeover":
                continue
            e = use.entry
            ex.cache.remove(e)
            ex.leases.consume(use.lease)  # its entry is the lane's now: nothing to unpin
            if len(e.tokens) > use.keep:
                try:
                    self.rt.seq_truncate(e.resident_seq(), use.keep)
                except RuntimeFailure as err:
                    raise ex.fatal("cutting a taken-over entry back", err) from err
            self._shed_entry(a.lane_tag, ShedReason.TAKEOVER, e.bytes, len(e.tokens))

    def admits(self) -> None:
        ex = self.ex
        desc = ex.desc
        for a in self.plan.admits:
            ex.lanes.faulted.discard(a.lane_tag)
            prompt = self.verdict.prompts[a.lane_tag]
            use = self.verdict.seeds.get(a.lane_tag)
            bias = ex.registry.biases.get(a.logit_bias_handle) if a.logit_bias_handle else None
            granted = grant(a.determinism_class, int(Determinism.SEED_PATH_INVARIANT))
            lane = Lane(
                tag=a.lane_tag, seq=0, sampling=a.sampling, params=a.params, rng_base=a.rng_counter_base,
                prompt=prompt, prefill_end=admitted_span(a, prompt, use)[0], bias=bias,
                logprobs_top=(a.want_logprobs - 1) if a.want_logprobs else None, granted_class=granted,
                session=ex.lanes.session)
            lane.greedy = a.sampling == _GREEDY or a.params.temperature <= 0
            lane.ignore_eos = bool(a.params.flags & _IGNORE_EOS)
            lane.engine_ok = (desc.engine_sampling and a.sampling != _HOST and (lane.greedy or desc.engine_draws)
                              and bias is None and not hs.penalizes(a.params) and lane.logprobs_top is None)
            cursor = self.verdict.cursors.get(a.lane_tag)
            if cursor is not None:  # the check replayed it; the lane borrows the grammar until its end
                ex.registry.grammars.borrow(a.grammar_handle, a.lane_tag)
                lane.grammar_handle, lane.grammar = a.grammar_handle, cursor
            # A lane that drafts gets its strategy's cert and keeps its class (speculation_decode.py
            # says why); one that cannot draft (HOST, grammar, bias, logprobs) gets cert 0.
            cert = 0
            if a.strategy_slot:
                st = ex.registry.strategies.get(a.strategy_slot)
                if drafts(a.sampling, a.grammar_handle, bias, a.want_logprobs):
                    assert st is not None  # the check refused an admit of an empty slot
                    lane.spec = LaneSpec(st)
                    cert = st.cert_id
            self.admit_results.append(AdmitResult(lane_tag=a.lane_tag, status=1, reject_code=0, cert_id=cert,
                                                  granted_class=granted))
            if use is None:
                lane.seq = self._create("creating a sequence the check made room for")
                ex.lanes[a.lane_tag] = lane
            else:
                self._seed(lane, use)

    def _create(self, during: str) -> int:
        try:
            return self.rt.seq_create()
        except RuntimeFailure as e:
            raise self.ex.fatal(during, e) from e

    def _seed(self, lane: Lane, use: SeedUse) -> None:
        """Put the lease's prefix in the lane's sequence by the path the check chose."""
        ex, rt, e = self.ex, self.rt, use.entry
        prefix = use.lease.prefix
        lane.committed = list(prefix)
        lane.prefilled = use.n
        lane.pending_input = prefix[-1] if use.full else None
        if use.path in ("takeover", "adopt"):
            lane.seq = e.resident_seq()
            if use.path == "adopt":
                ex.cache.remove(e)
                ex.leases.consume(use.lease)
                if use.full:
                    try:
                        rt.seq_truncate(e.resident_seq(), use.keep)
                    except RuntimeFailure as err:
                        raise ex.fatal("cutting an adopted sequence back", err) from err
            ex.lanes[lane.tag] = lane
            return
        lane.seq = self._create("creating a seeded sequence the check made room for")
        ex.lanes[lane.tag] = lane
        ex.leases.drop(use.lease)
        try:
            if use.path == "copy":
                rt.seq_copy(e.resident_seq(), lane.seq, use.keep)
            else:
                got = rt.seq_import(lane.seq, e.exported_blob())
                if got != len(e.tokens):
                    raise CapacityError(f"the import brought {got} cells back, the entry holds {len(e.tokens)}")
                if got > use.keep:
                    rt.seq_truncate(lane.seq, use.keep)
        except FatalError as err:
            raise ex.fatal(f"seeding a lane ({use.path})", err) from err
        except RuntimeFailure as err:
            if use.path == "copy":
                self.fault(lane.tag, lane_fault(err))
                return
            self._lost_import(lane, use)
            return
        e.seeded += 1
        e.last_used = ex.counters.tick_count

    def _lost_import(self, lane: Lane, use: SeedUse) -> None:
        """A failed import is state lost, not a request lost: the lane
        prefills its seed afresh, and the entry goes once unleased."""
        ex, e = self.ex, use.entry
        self.free(lane.seq, "a failed import")
        lane.seq = self._create("re-creating a sequence after a failed import")
        step = ex.desc.prefill_step_tokens or use.keep
        for at in range(0, use.keep, step):
            if self.step([Feed(lane.seq, list(use.lease.prefix[at:min(use.keep, at + step)]))], [lane.tag],
                         "prefilling a lost import's seed") is None:
                return
        if e.pins == 0 and ex.cache.get(e.eid) is not None:
            ex.cache.remove(e)
            self._shed_entry(lane.tag, ShedReason.LOST, 0, len(e.tokens))

