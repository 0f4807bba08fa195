"""The reference planner's second half (client/planner.py): folding an
accepted plan and its events back into its state — admitted lanes, how far
each prefill really got (shed chunks), faulted lanes to re-admit or end,
emitted tokens and finishes, host rows to sample. Go's planner_absorb.go
and Rust's absorb.rs are the same rules."""

from __future__ import annotations

import collections
from collections.abc import Callable

from superfluid.abi import Fault, Finish, Sampling, ShedKind, lib
from superfluid.abi.records import LaneEmit, TickEvents
from superfluid.client.client import Client
from superfluid.client.grammars import GrammarBook
from superfluid.client.planner_state import Draft, Lane, PlannerStats, Request
from superfluid.client.seeding import SeedBook

_U64 = (1 << 64) - 1  # rng positions wrap at 64 bits (planner.py uses it too)
_INJECTED = int(lib.SF_FAULT_DETAIL_INJECTED)  # LaneFault.detail's mark of an injected fault


class Absorbing:
    """Planner's absorb methods; the state they fold into is Planner's."""

    client: Client
    clock: Callable[[], float]
    eos: frozenset[int]
    tick_timeout: float
    max_fault_readmits: int
    seeds: SeedBook
    grammars: GrammarBook
    waiting: collections.deque[Request]
    lanes: dict[int, Lane]
    retire_next: set[int]
    stats: PlannerStats
    _admit_cap: int | None

    def _absorb(self, d: Draft, ev: TickEvents) -> None:
        """Fold an accepted plan and its events into the planner's state."""
        now = self.clock()
        self.stats.ticks += 1
        self.stats.tick_s += ev.timings.wall_ns * 1e-9
        for lane in d.admits:
            assert self.waiting[0] is lane.request  # admits came off the front, in order
            self.waiting.popleft()
            req = lane.request
            req.admissions += 1
            req.seed, req.no_seed = None, False  # a lease is spent by the admit that names it
            self.stats.seeded_tokens += d.seeded.get(lane.tag, 0)
            self.seeds.admitted(req.prompt + req.generated)
            self.lanes[lane.tag] = lane
        for tokens in d.published:
            self.seeds.published(tokens)
        self.stats.leases = self.seeds.leases
        for tag in d.retires:
            lane = self.lanes.pop(tag, None)
            self.retire_next.discard(tag)
            if lane is not None and lane.request.done and lane.request.grammar:
                self.grammars.release(lane.request.id, self.tick_timeout)
        if d.retires:
            self._admit_cap = None  # memory came back: admit as the limits allow again
        for tag, offer in d.prefills.items():
            self.lanes[tag].prefilled += offer  # less what was shed, below
        for tag, grant in d.decodes.items():
            lane = self.lanes[tag]
            lane.replay_left -= min(grant, lane.replay_left)  # replay rounds come first
        for tag in d.commits:
            self.lanes[tag].commit = None
        self._absorb_shed(ev)
        self._absorb_faults(ev, now)
        for emit in ev.emits:
            self._absorb_emit(emit, now)

    def _absorb_shed(self, ev: TickEvents) -> None:
        """A shed PREFILL_CHUNK says where the executor really stopped; the
        next chunk starts there."""
        for e in ev.shed.entries:
            if e.kind == ShedKind.PREFILL_CHUNK:
                lane = self.lanes.get(e.lane_tag)
                if lane is not None:
                    lane.prefilled -= e.tokens
                self.stats.prefill_chunks_shed += 1
                self.stats.prefill_tokens_shed += e.tokens
            elif e.kind == ShedKind.CACHE_EVICTION:
                self.stats.evictions += 1
                self.stats.bytes_evicted += e.bytes

    def _absorb_faults(self, ev: TickEvents, now: float) -> None:
        """A faulted lane's sequence is gone: retire its tag and re-admit the
        request from where it was, as after a restart. Not a fault that
        would come back: a non-finite row (NUMERIC) is the same bits on a
        re-admission, so that request ends "fault" with what it has; so does
        one that faulted more than max_fault_readmits times in a row (no
        token in between). Not counted: OOM_TENTATIVE (memory comes back)
        and injected faults (their detail's mark: the harness bounds them).
        A failed batched step faults every lane in it, so a lane that breaks
        every step it is in charges its batch-mates too, until it ends."""
        again, ended = [], []
        for f in ev.faults:
            self.stats.faults += 1
            self.retire_next.add(f.lane_tag)
            lane = self.lanes.pop(f.lane_tag, None)
            if lane is None or lane.request.done:
                continue
            req = lane.request
            if not f.detail & _INJECTED and f.code != Fault.OOM_TENTATIVE:
                req.faults += 1
                if f.code == Fault.NUMERIC or req.faults > self.max_fault_readmits:
                    req.finish, req.finished_at = "fault", now
                    ended.append(req)
                    continue
            again.append(req)
        self.waiting.extendleft(reversed(again))
        for req in ended:  # (after the queue: a worker gone meanwhile leaves nothing half done)
            self.grammars.release(req.id, self.tick_timeout)

    def _absorb_emit(self, emit: LaneEmit, now: float) -> None:
        lane = self.lanes.get(emit.lane_tag)
        if lane is None:
            return
        req = lane.request
        self.stats.draft_proposed += emit.spec.proposed
        self.stats.draft_accepted += emit.spec.accepted
        tokens = self._host_sample(lane, emit) if req.sampling == Sampling.HOST else self.client.tokens(emit)
        req.generated.extend(tokens)
        req.token_times.extend([now] * len(tokens))
        if tokens:
            req.faults = 0  # progress: the faults before it are not in a row
        reason = self._finish_reason(req, emit, tokens)
        if reason is not None:
            req.finish, req.finished_at = reason, now
            lane.retiring = True
        elif req.sampling == Sampling.HOST and tokens:
            lane.commit = self.client.commit(emit, tokens[0])

    def _host_sample(self, lane: Lane, emit: LaneEmit) -> list[int]:
        """A HOST lane's row (none while it replays): the planner draws the
        token at position rng_base + tokens sampled so far."""
        if not emit.logits_nonce:
            return []
        req = lane.request
        row = self.client.logits_row(emit)
        return [int(req.host_sampler(row, (req.rng_base + len(req.generated)) & _U64))]

    def _finish_reason(self, req: Request, emit: LaneEmit, tokens: list[int]) -> str | None:
        if emit.finish == Finish.EOS or (req.stop_at_eos and tokens and tokens[-1] in self.eos):
            return "eos"
        if emit.finish == Finish.GRAMMAR:
            return "grammar"  # the grammar is complete
        if emit.finish == Finish.LENGTH:
            return "length"
        if len(req.generated) >= req.max_new_tokens:
            return "max_tokens"
        return None
