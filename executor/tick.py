"""Running an accepted plan (contract §4), phase by phase, in the contract's order:
evictions the check planned, retires (publish or free), cache settling,
commits, then (admit.py) seed takeovers and admits, seeded or fresh, then
prefill; decode and the events are in decode.py, decode_replay in replay.py, drafting in
speculation_decode.py.
Nothing here can reject: the check has made sure that everything fits, so a
runtime failure is a lane's fault or fatal. The retires and the cache's
upkeep (RetirePhase) also run op RETIRE_LANES.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import numpy as np

from superfluid.abi import PlanFlag, ShedKind, ShedReason
from superfluid.abi.records import LaneFault as LaneFaultRecord, ShedEntry, TickPlan
from superfluid.engine.fault_runtime import InjectedCapacity
from superfluid.engine.runtime import CapacityError, FatalError, Feed, RuntimeFailure
from superfluid.executor.admit import AdmitPhase
from superfluid.executor.cache import CacheEntry
from superfluid.executor.check import Verdict
from superfluid.executor.decode import DecodePhase, lane_fault_code
from superfluid.executor.fault_phase import FaultPhase
from superfluid.executor.faults import INJECTED
from superfluid.executor.lanes import Lane
from superfluid.executor.replay import ReplayPhase
from superfluid.executor.speculation_decode import SpecPhase
from superfluid.executor.tick_state import TickState

if TYPE_CHECKING:
    from superfluid.executor.executor import Executor

# A prompt shorter than this is not checkpointed on an exact_only runtime: it is cheap to run again.
CHECKPOINT_MIN_TOKENS = 128
# While latency-sensitive requests wait, a prefill step is about this much work,
# so a yield asked for mid-tick is answered within it.
LATENCY_STEP_SECS = 0.3
LATENCY_STEP_UNIT = 128
_PARTIAL_EMITS = int(PlanFlag.PARTIAL_EMITS)  # `int & IntFlag` builds a flag object: compare plain ints


class RetirePhase(TickState):
    """Retires and the cache's upkeep: a plan's retire phase and op
    RETIRE_LANES (between ticks) run this one code. Evictions become entries
    of `shed`; `now` is the tick that a publish stamps (an op's: the next)."""

    def __init__(self, ex: Executor, shed: list[ShedEntry], now: int) -> None:
        self.ex = ex
        self.rt = ex.runtime
        self.shed = shed
        self.now = now
        self.evictions = 0
        self.bytes_evicted = 0

    def free(self, seq: int, during: str) -> None:
        """Free a sequence; only a fatal error matters (any other means the
        runtime holds nothing more of it that we could free)."""
        try:
            self.rt.seq_free(seq)
        except FatalError as e:
            raise self.ex.fatal(during, e) from e
        except RuntimeFailure:
            pass

    def _shed_entry(self, tag: int, reason: int, nbytes: int, tokens: int) -> None:
        self.shed.append(ShedEntry(lane_tag=tag, kind=int(ShedKind.CACHE_EVICTION), reason=int(reason),
                                   bytes=nbytes, tokens=tokens))
        self.evictions += 1
        self.bytes_evicted += nbytes

    def evict(self, e: CacheEntry, reason: int) -> None:
        """The entry leaves the pool: to host memory where it can go, else gone."""
        ex = self.ex
        seq = e.resident_seq()
        if not ex.to_host(e):
            ex.cache.remove(e)
        self.free(seq, "evicting a cache entry")
        self._shed_entry(0, reason, e.bytes, len(e.tokens))

    def settle_cache(self) -> None:
        """Keep the cache within its byte limit: least recently used first."""
        limit = self.ex.cache.max_bytes
        if limit is None:
            return
        over = self.ex.cache.resident_bytes - limit
        if over <= 0:
            return  # (lru() sorts every entry)
        for e in self.ex.cache.lru():
            if over <= 0:
                break
            over -= e.bytes
            self.evict(e, ShedReason.PRESSURE)

    def publish(self, lane: Lane) -> bool:
        """Keep a retiring lane's sequence as a cache entry; False when it
        is not kept (the caller frees it)."""
        ex = self.ex
        if lane.pending_input is not None:
            # Forward-once held the last token back: feed it so the entry keys every
            # committed token. Out of cells, the step changed nothing: publish what is
            # held. A lane fault says the sequence itself is suspect: keep none of it.
            try:
                self.rt.step([Feed(lane.seq, [lane.pending_input], decode=True)])
                lane.pending_input = None
            except CapacityError:
                pass
            except FatalError as e:
                raise ex.fatal("a publishing retire", e) from e
            except RuntimeFailure:
                return False
        if ex.exact_only:
            # The entry seeds lanes that may decode at once: it must hold what a
            # fresh prefill of its tokens holds, not what decode feeds left.
            try:
                self.rt.seq_settle(lane.seq)
            except FatalError as e:
                raise ex.fatal("a publishing retire", e) from e
            except RuntimeFailure:
                return False
        ingested = lane.ingested
        key_len = ingested if ex.exact_only else ingested // ex.page * ex.page
        if key_len < 1:
            return False
        key = tuple(lane.committed[:key_len])
        cover = [c for c in ex.cache.containing(key) if c.resident and (len(c.tokens) == key_len or not ex.exact_only)]
        if cover:
            for c in cover:
                c.last_used = self.now  # the same cells are cached already
            return False
        if key_len < self.rt.seq_len(lane.seq):
            try:
                self.rt.seq_truncate(lane.seq, key_len)
            except RuntimeFailure:
                return False
        if not ex.exact_only:
            # An entry the new one extends serves no lease the new one cannot: merge it
            # (on a runtime that shares cells, the two hold the same blocks anyway).
            for old in ex.cache.page_prefixes(key):
                if old.resident and old.pins == 0 and not old.bare:
                    ex.cache.remove(old)
                    self.free(old.resident_seq(), "merging a cache entry")
        ex.cache.insert(lane.seq, key, len(lane.prompt), ex.entry_bytes(key_len), self.now)
        return True

    def retire(self, retires: list[tuple[int, bool]], unpublish: Collection[int] = ()) -> None:
        """Retire (tag, publish) pairs, each a live or a faulted lane's;
        `unpublish`: publishing retires the memory check evicted before they
        were kept."""
        ex = self.ex
        publishing = []
        # Frees first: the memory check counted their cells as free for the
        # publishes' pending feeds, whatever the plan's order.
        for tag, publish in retires:
            if tag in ex.lanes.faulted:
                ex.lanes.faulted.discard(tag)
                continue
            lane = ex.lanes.pop(tag)
            ex.lanes.injected.pop(tag, None)
            if ex.fault_rt is not None:  # a NaN armed for its next row stays with the lane, not its cells
                ex.fault_rt.disarm(lane.seq)
            if lane.grammar_handle:
                ex.registry.grammars.give_back(lane.grammar_handle, tag)
            if publish and tag in unpublish:
                # Evicted before it was kept, to make room for this plan.
                self._shed_entry(0, ShedReason.MEMORY, ex.entry_bytes(lane.ingested), lane.ingested)
                self.free(lane.seq, "a retire")
            elif publish:
                publishing.append(lane)
            else:
                self.free(lane.seq, "a retire")
        for lane in publishing:
            if not self.publish(lane):
                self.free(lane.seq, "a retire")


class Tick(AdmitPhase, DecodePhase, ReplayPhase, SpecPhase, FaultPhase, RetirePhase):
    """One applied plan's working state."""

    def __init__(self, ex: Executor, v: Verdict) -> None:
        plan: TickPlan = v.plan
        # Evictions ops made since the last tick are reported in this one.
        pending = ex.pending.shed
        if pending:
            ex.pending.shed = []  # the list is this tick's shed now
        RetirePhase.__init__(self, ex, pending or [], ex.counters.tick_count)
        self.plan = plan
        self.verdict = v
        self.admit_results = []
        self.faults = []
        self.faulted_now = set()
        self.chunks_dropped = 0
        if pending:
            self.evictions = len(pending)
            self.bytes_evicted = sum(e.bytes for e in pending)
        self.logprobs = []
        self.rows = {}
        self.out_tokens = {d.lane_tag: [] for d in plan.decodes} if plan.decodes else {}
        self.finishes = {}
        self.partial = bool(plan.flags & _PARTIAL_EMITS) and ex.partial_sink is not None
        self.yielded = False
        self.cells_after = v.cells_after  # the check's bound on each lane's cells at the end
        # Drafting (speculation_decode.py), filled only where a lane of an installed strategy decodes.
        self.spec_over = {}  # drafting lanes: overshoot left
        self.spec_stats = {}  # lanes of a strategy: [proposed, accepted, cert in effect]
        self.spec_rows = {}  # a round's verified feeds: tag -> (rows, draft)
        self.spec_decisions = {}  # Strategy -> whether its lanes draft this tick
        self.spec_lanes = 0  # non-HOST lanes decoding (the gate's bucket)
        self.spec_free_rows = 0

    # ----------------------------------------------------------- faults

    def fault(self, tag: int, code: int, detail: int = 0) -> None:
        if tag in self.faulted_now:
            return
        self.faulted_now.add(tag)
        self.faults.append(LaneFaultRecord(lane_tag=tag, code=int(code), detail=detail))
        self.ex.lanes.last_fault = (tag, int(code))
        lane = self.ex.lanes.pop(tag, None)
        if lane is not None:
            if lane.grammar_handle:
                self.ex.registry.grammars.give_back(lane.grammar_handle, tag)
            self.free(lane.seq, "freeing a faulted lane")
            self.ex.lanes.faulted.keep(lane)  # its tag, and what LIST_LANES shows of it
        self.ex.lanes.injected.pop(tag, None)
        self.rows.pop(tag, None)

    def step(self, feeds: list[Feed], tags: list[int], during: str) -> list[np.ndarray] | None:
        """One runtime step; on a lane error its lanes fault and None returns."""
        try:
            return self.rt.step(feeds)
        except RuntimeFailure as e:
            self.step_failed(e, tags, during)
            return None

    def step_failed(self, e: RuntimeFailure, tags: list[int], during: str,
                    remaining: dict[int, int] | None = None) -> None:
        """A step of these lanes failed: they fault (and decode no more), or
        the worker does where the error is no lane's."""
        code = lane_fault_code(e)
        if code is None:
            raise self.ex.fatal(during, e) from e
        detail = INJECTED if isinstance(e, InjectedCapacity) else 0
        for tag in tags:
            self.fault(tag, code, detail)
            if remaining is not None:
                remaining.pop(tag, None)

    # ----------------------------------------------------------- phases

    def retires(self) -> None:
        pairs = [(r.lane_tag, bool(r.publish_to_cache)) for r in self.plan.retires]
        self.retire(pairs, self.verdict.unpublish)

    def commits(self) -> None:
        ex = self.ex
        nan = ex.faults is not None and ex.faults.tokens and ex.fault_rt is not None
        for c in self.plan.commits:
            lane = ex.lanes[c.lane_tag]
            lane.committed.append(c.token_id)
            lane.pending_input = c.token_id
            lane.pending_row = None
            lane.rng_counter += 1
            if nan:  # a HOST lane's token K-1 came now: a nan rule for its K-th row arms
                assert ex.faults is not None and ex.fault_rt is not None
                ex.faults.arm_nan(ex, lane, ex.fault_rt)

    def _shed_chunk(self, tag: int, tokens: int, reason: int) -> None:
        self.chunks_dropped += 1
        self.shed.append(ShedEntry(lane_tag=tag, kind=int(ShedKind.PREFILL_CHUNK), reason=int(reason), bytes=0,
                                   tokens=tokens))

    def _step_cap(self) -> int:
        ex = self.ex
        n = ex.desc.prefill_step_tokens
        if n == 0:
            return 1 << 62
        spt = ex.counters.prefill_secs_per_token
        if spt and spt > 0 and ex.rings.latency_wanted():
            fits = int(LATENCY_STEP_SECS / spt) // LATENCY_STEP_UNIT * LATENCY_STEP_UNIT
            return min(max(fits, LATENCY_STEP_UNIT), max(n, LATENCY_STEP_UNIT))
        return n

    def prefill(self) -> None:
        ex, plan = self.ex, self.plan
        decoding = {d.lane_tag for d in plan.decodes if d.max_new_tokens > 0}
        budget = plan.prefill_token_budget
        work: list[list[int]] = []  # [tag, next prompt index, end]
        for p in plan.prefills:
            take = min(p.token_count, budget)
            budget -= take
            if p.token_count > take:
                self._shed_chunk(p.lane_tag, p.token_count - take, ShedReason.BUDGET)
            if take:
                work.append([p.lane_tag, p.token_offset, p.token_offset + take])
        cap = self._step_cap()
        max_feeds = max(1, ex.desc.max_batch)  # the runtime refuses larger steps
        ran = 0
        stepped = False
        checkpoints: list[int] = []
        t0 = ex.clock()
        while any(w[1] < w[2] for w in work):
            if stepped and ex.rings.yield_requested():
                for tag, nxt, end in work:
                    if nxt < end:
                        self._shed_chunk(tag, end - nxt, ShedReason.YIELD)
                self.yielded = True
                break
            stepped = True
            feeds: list[Feed] = []
            tags: list[int] = []
            wants: list[bool] = []
            left = cap
            for w in work:
                tag, nxt, end = w
                if nxt >= end or left == 0 or len(feeds) == max_feeds:
                    continue
                lane = ex.lanes.get(tag)
                if lane is None:  # faulted in an earlier step of this tick
                    w[1] = end
                    continue
                take = min(end - nxt, left)
                left -= take
                ran += take
                w[1] = nxt + take
                chunk = lane.prompt[nxt:nxt + take]
                completes = nxt + take == len(lane.prompt)
                feed = [lane.pending_input] if lane.pending_input is not None else []
                lane.pending_input = None
                # On an exact_only runtime the last token prefill reaches is always held
                # back, so that decode feeds it (Feed.decode) on every path: a first run,
                # a replay after a restart (whose prefill ends before the prompt does)
                # and a seeded turn alike.
                held = ex.exact_only and nxt + take == lane.prefill_end
                if completes and ex.exact_only and len(lane.prompt) >= 2:
                    checkpoints.append(tag)
                want = completes and tag in decoding and not ex.exact_only
                if (completes and not want) or held:
                    feed.extend(chunk[:-1])
                    lane.pending_input = chunk[-1]
                else:
                    feed.extend(chunk)
                lane.committed.extend(chunk)
                lane.prefilled += take
                if feed:
                    feeds.append(Feed(lane.seq, feed, want))
                    tags.append(tag)
                    wants.append(want)
            if not feeds:
                continue
            got = self.step(feeds, tags, "a prefill step")
            if got is None:
                checkpoints.clear()
                continue
            it = iter(got)
            for tag, want in zip(tags, wants):
                if want:
                    self.rows[tag] = next(it)
            for tag in checkpoints:
                self._checkpoint(tag)
            checkpoints.clear()
        if ran >= LATENCY_STEP_UNIT:
            sample = (ex.clock() - t0) / 1e9 / ran
            spt = ex.counters.prefill_secs_per_token
            ex.counters.prefill_secs_per_token = sample if spt is None else 0.7 * spt + 0.3 * sample

    def _checkpoint(self, tag: int) -> None:
        """On an exact_only runtime: a copy of a lane whose prompt of >= 128
        tokens just ended, one token short (the held-back one), kept in the
        cache for a resent prompt or the next turn. The memory check did not
        count it, so it takes only cells and slots the rest of the tick
        cannot need, and any later plan that needs them takes them back."""
        ex = self.ex
        lane = ex.lanes.get(tag)
        if lane is None or len(lane.prompt) < CHECKPOINT_MIN_TOKENS:
            return
        n = lane.ingested
        key = tuple(lane.committed[:n])
        if ex.cache.find(key) is not None:
            return
        mem = self.rt.mem_counters()
        if ex.desc.max_seqs and mem.seqs >= ex.desc.max_seqs:
            return
        if mem.cells_total:
            promised = sum(max(0, ex.pages(after) - ex.pages(self.rt.seq_len(ex.lanes[t].seq)))
                           for t, after in self.cells_after.items() if t in ex.lanes) * ex.page
            if mem.cells_total - mem.cells_used - promised < ex.pages(n) * ex.page:
                return
        dst = None
        try:
            dst = self.rt.seq_create()
            self.rt.seq_copy(lane.seq, dst, n)
        except FatalError as e:
            raise ex.fatal("a checkpoint", e) from e
        except RuntimeFailure:
            if dst is not None:
                self.free(dst, "a failed checkpoint")
            return
        ex.cache.insert(dst, key, n, ex.entry_bytes(n), ex.counters.tick_count, checkpoint=True)
