"""The reference planner: continuous batching over one worker.

Read this first if you are writing a scheduler in another language: it uses
only the records of abi/superfluid.h and the client's queue calls. A tick:

  1. plan   — from the planner's own state: retire finished and faulted lanes,
              commit host-sampled tokens, give prefilling lanes their next
              chunk under the prefill budget, admit waiting requests while the
              limits allow, grant decoding lanes their tokens;
  2. send   — `client.tick(plan)` and wait for its events;
  3. replan — NeedsReplan means the plan changed nothing: let the prefix
              cache be evicted, then admit fewer, then preempt a lane, and
              send again;
  4. absorb — fold the events back in: admitted lanes, how far each prefill
              really got (shed chunks), emitted tokens and finishes, host rows
              to sample, faulted lanes to re-admit (or end: see _absorb_faults).

Recovery (contract §9): when the worker dies, every wait raises WorkerRestarted.
The planner reconnects and re-admits each unfinished request with its prompt
plus what it has generated so far; decode replays the generated tail
(`decode_replay`) and draws resume at `rng_counter_base = base + sampled`,
so the request goes on exactly where it was. A faulted or preempted lane is
re-admitted the same way.

State is plain: a Request is what the user asked and what came back; a Lane
is a request's current admission on the worker, named by a lane tag that is
never reused (so nothing a dead worker or an old plan did can be mistaken
for the new admission).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

import numpy as np

from superfluid.abi import CacheClass, ParamFlag, Sampling, Status
from superfluid.abi.records import SamplingParams, TickEvents
from superfluid.client.builder import PlanBuilder
from superfluid.client.client import Client
from superfluid.client.grammars import GrammarBook, GrammarSpec, fields as grammar_fields
from superfluid.client.planner_absorb import _U64, Absorbing
from superfluid.client.planner_state import Draft, HostSampler, Lane, PlannerStats, Report, Request, RequestResult
from superfluid.client.seeding import SPI, SeedBook
from superfluid.client.session import ClientTimeout, WorkerRestarted
from superfluid.client.strategies import Strategy, StrategyBook

GPU_GREEDY, GPU_SAMPLE, HOST = Sampling.GPU_GREEDY, Sampling.GPU_SAMPLE, Sampling.HOST

_U16 = (1 << 16) - 1
_EVICT_ALL = 1 << 62  # max_evict_bytes when the planner lets the cache go


class PlannerError(Exception):
    """The worker refused a plan for a reason a correct planner never causes."""

    def __init__(self, events: TickEvents):
        super().__init__(f"plan {events.plan_seq} rejected: {Status(events.status).name}: "
                         f"{events.message.decode(errors='replace')}")
        self.events = events


def _percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(np.ceil(q / 100 * len(s))) - 1))]


# ---------------------------------------------------------------- planner


class Planner(Absorbing):
    """Continuous batching over one worker (see the module docstring).

    prefill_token_budget: prompt tokens per tick, over all lanes.
    prefill_chunk: tokens offered to one lane per tick; None = what the budget
        has left (nothing is shed). Above the budget, the executor takes what
        the budget allows and sheds the rest; the planner resumes from there.
    decode_grant: tokens a GPU-sampled lane may decode per tick (HOST: 1).
    max_lanes: lanes live at once (at most the runtime's max_batch).
    max_admits_per_tick: new lanes per tick (None: as the limits allow).
    use_leases: lease the longest cached prefix for each admission whose
        prompt may share pages with what this planner had published.
    max_fault_readmits: how many times in a row (no token between) a
        faulted request is re-admitted; its next fault ends it "fault". A
        NUMERIC fault ends it at once (the same row would come back);
        injected and OOM_TENTATIVE faults never count (_absorb_faults).
    strategy: a speculation strategy (client.strategies.Strategy) installed on
        the worker and named by every request's admission unless it opts out;
        a drafting lane may emit more than decode_grant tokens a tick
        (overshoot), never past its max_new_tokens.
    """

    def __init__(self, client: Client, *, prefill_token_budget: int = 512, prefill_chunk: int | None = None,
                 decode_grant: int = 4, max_lanes: int | None = None, max_admits_per_tick: int | None = None,
                 tick_timeout: float = 30.0, reconnect_timeout: float = 60.0, use_leases: bool = True,
                 strategy: Strategy | None = None, max_fault_readmits: int = 8,
                 clock: Callable[[], float] = time.monotonic):
        if prefill_token_budget < 1 or decode_grant < 1 or (prefill_chunk is not None and prefill_chunk < 1):
            raise ValueError("prefill_token_budget, prefill_chunk and decode_grant are at least 1")
        if max_fault_readmits < 0:
            raise ValueError(f"max_fault_readmits is at least 0, not {max_fault_readmits}")
        self.max_fault_readmits = max_fault_readmits
        self.client = client
        self.prefill_token_budget = prefill_token_budget
        self.prefill_chunk = prefill_chunk
        self.decode_grant = min(decode_grant, _U16)
        self.max_admits_per_tick = max_admits_per_tick
        self.tick_timeout = tick_timeout
        self.reconnect_timeout = reconnect_timeout
        self.clock = clock
        desc = client.describe()
        self.eos = frozenset(desc["eos"])
        max_batch = int(desc["runtime"]["max_batch"])
        self.max_lanes = min(max_lanes or max_batch, max_batch)
        rt = desc["runtime"]
        self.use_leases = use_leases
        self.seeds = SeedBook(client, int(rt.get("page", 16)), bool(rt.get("exact_only", False)))
        self.grammars = GrammarBook(client)
        self.strategies = StrategyBook(client, strategy)
        self.strategies.slot(tick_timeout)  # a strategy the worker refuses fails here, not mid-run
        self.requests: dict[int, Request] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.lanes: dict[int, Lane] = {}  # by tag, in admission order (prefill runs in this order)
        self.retire_next: set[int] = set()  # faulted, preempted or orphaned tags: retire, don't publish
        self.stats = PlannerStats()
        self._next_id = 1
        self._evict = False  # set by the first NeedsReplan: the prefix cache may be evicted from then on
        self._admit_cap: int | None = None  # admits per tick while memory is short (until a lane retires)

    # --------------------------------------------------------------- requests

    def submit(self, prompt_tokens, max_new_tokens: int, sampling: Sampling = GPU_GREEDY, *,
               params: SamplingParams | None = None, rng_base: int = 0, publish: bool = True,
               host_sampler: HostSampler | None = None, stop_at_eos: bool = True,
               grammar: GrammarSpec | None = None, speculate: bool = True) -> int:
        """Queue a request; its id. HOST requests need `host_sampler`; the
        draw of generated token k is at rng position `rng_base + k`.
        grammar: (kind, text) — json_schema, regex, lark, gbnf — or
        ("choice", [strings]); the output follows it (not with HOST). The
        worker compiles it now: a grammar it refuses raises GrammarRefused.
        speculate: admit it with the planner's strategy (if it has one)."""
        prompt = [int(t) for t in prompt_tokens]
        if not prompt or max_new_tokens < 1:
            raise ValueError("a request needs a prompt and max_new_tokens >= 1")
        if sampling == HOST and host_sampler is None:
            raise ValueError("a HOST request needs a host_sampler(row, position) -> token")
        if grammar is not None:
            grammar_fields(grammar)  # a ValueError for a malformed spec
            if sampling == HOST:
                raise ValueError("a grammar constrains the engine's sampling: not with HOST")
        params = params or SamplingParams()
        if not stop_at_eos:
            params = params._replace(flags=params.flags | int(ParamFlag.IGNORE_EOS))
        req = Request(self._next_id, prompt, max_new_tokens, Sampling(sampling), params, rng_base & _U64,
                      publish, host_sampler, stop_at_eos, submitted_at=self.clock(), grammar=grammar,
                      speculate=speculate and self.strategies.strategy is not None)
        if grammar is not None:
            self.grammars.handle(req.id, grammar, self.tick_timeout)
        self._next_id += 1
        self.requests[req.id] = req
        self.waiting.append(req)
        return req.id

    # ------------------------------------------------------------------ loop

    def busy(self) -> bool:
        """Work left: waiting requests, lanes, or tags to retire."""
        self.retire_next |= self.client.take_orphans()
        return bool(self.waiting or self.lanes or self.retire_next)

    def run_until_done(self, timeout: float = 300.0) -> Report:
        """Tick until every request is finished and every lane retired."""
        deadline = self.clock() + timeout
        start = self.clock()
        while self.busy():
            left = deadline - self.clock()
            if left <= 0:
                raise ClientTimeout(f"requests still running after {timeout}s")
            self.step(min(self.tick_timeout, left))
        self.stats.wall_s += self.clock() - start
        return self.report()

    def step(self, timeout: float | None = None) -> None:
        """One tick, or, when the worker is gone, one recovery."""
        self.retire_next |= self.client.take_orphans()  # lanes a pre-restart plan admitted
        try:
            draft, events = self._send(timeout)
        except WorkerRestarted:
            self._recover()
            return
        self._absorb(draft, events)

    def _send(self, timeout: float | None) -> tuple[Draft, TickEvents]:
        """Plan, send, and shrink the plan while the worker answers NeedsReplan."""
        caps = [c for c in (self.max_admits_per_tick, self._admit_cap) if c is not None]
        max_admits = min(caps) if caps else None
        publish = True
        while True:
            draft = self._plan(max_admits, self._evict, publish)
            events = self.client.tick(draft.builder, timeout)
            if events.status == Status.OK:
                return draft, events
            if events.status == Status.RejectStaleSeed and draft.seeded:
                # A lease ran out (or the worker let it go): admit those afresh.
                for lane in draft.admits:
                    lane.request.seed, lane.request.no_seed = None, True
                continue
            if events.status != Status.NeedsReplan:
                raise PlannerError(events)
            self.stats.replans += 1
            # Nothing happened. Let the prefix cache make room first, then
            # admit fewer, then keep nothing a retiring lane would publish,
            # then give up a running lane's memory. The first two stick: the
            # cache stays evictable, and admissions stay capped until a lane
            # retires, so the next ticks don't ask the same question.
            if not self._evict:
                self._evict = True
            elif len(draft.admits) == 1 and not self.lanes:
                self._refuse(self.waiting.popleft())  # alone on an idle worker, it still does not fit
            elif draft.admits:
                max_admits = self._admit_cap = len(draft.admits) // 2
            elif publish and any(lane.retiring and lane.request.publish for lane in self.lanes.values()):
                publish = False  # a published lane keeps its cells until a later tick evicts them
            elif self._preempt_newest():
                max_admits = 0  # not the preempted request again in this tick
            else:
                raise PlannerError(events)

    # ------------------------------------------------------------------ plan

    def _plan(self, max_admits: int | None, evict: bool, publish: bool = True) -> Draft:
        b = PlanBuilder(0, prefill_token_budget=self.prefill_token_budget)  # the client stamps plan_seq
        if evict:
            b.evictable_cache_classes = int(CacheClass.RESIDENT_PREFIX_CLASS)
            b.max_evict_bytes = _EVICT_ALL
        d = Draft(b)
        self._plan_retires(d, publish)
        self._plan_commits(d)
        # Lanes already in flight prefill first: they hold memory already.
        budget = self.prefill_token_budget
        for lane in self.lanes.values():
            budget = self._plan_prefill(d, lane, budget)
        self._plan_admits(d, max_admits, budget)
        self._plan_decodes(d)
        return d

    def _plan_retires(self, d: Draft, publish: bool) -> None:
        for lane in self.lanes.values():
            if lane.retiring:
                keep = publish and lane.request.publish
                d.builder.retire(lane.tag, publish_to_cache=keep)
                d.retires.append(lane.tag)
                if keep:
                    d.published.append(lane.request.prompt + lane.request.generated)
        for tag in sorted(self.retire_next):
            d.builder.retire(tag, publish_to_cache=False)
            d.retires.append(tag)

    def _plan_commits(self, d: Draft) -> None:
        """HOST lanes: the token the host sampler picked from last tick's row."""
        for lane in self.lanes.values():
            if lane.commit is not None and not lane.retiring:
                d.builder.commit(*lane.commit)
                d.commits.append(lane.tag)

    def _plan_prefill(self, d: Draft, lane: Lane, budget: int) -> int:
        """The lane's next prompt chunk; returns the budget left."""
        left = lane.prefill_end - lane.prefilled
        if left == 0 or lane.retiring:
            return budget
        offer = min(left, self.prefill_chunk if self.prefill_chunk else budget)
        if offer == 0:
            return budget
        d.builder.prefill(lane.tag, lane.prefilled, offer)
        d.prefills[lane.tag] = offer
        take = min(offer, budget)  # the executor takes tokens in plan order up to the budget
        d.reached[lane.tag] = lane.prefilled + take
        return budget - take

    def _plan_admits(self, d: Draft, max_admits: int | None, budget: int) -> None:
        """Waiting requests, oldest (or interrupted) first, while a lane slot
        and prefill budget are free."""
        for req in self.waiting:
            if len(self.lanes) + len(d.admits) >= self.max_lanes or budget == 0:
                break
            if max_admits is not None and len(d.admits) >= max_admits:
                break
            lane = self._admit(d, req)
            budget = self._plan_prefill(d, lane, budget)

    def _admit(self, d: Draft, req: Request) -> Lane:
        """Admit `req` from where it is: prompt + generated so far, the
        generated tail replayed by decode, draws resuming past the tokens
        already sampled (contract §9). A fresh request has nothing to replay.
        decode_replay < len(prompt + generated) always holds: the prompt is
        never empty."""
        tag = self.client.new_lane_tag()
        sampled = len(req.generated)  # every generated token was drawn (engine or host) at base + index
        tokens = req.prompt + req.generated
        if self.use_leases and req.seed is None and not req.no_seed:
            req.seed = self.seeds.lease(tokens, self.tick_timeout, replay=sampled)
        seed = req.seed
        value = seed.value if seed else 0
        # The grammar's fresh matcher replays what was generated (contract §9, as the draws resume).
        grammar = self.grammars.handle(req.id, req.grammar, self.tick_timeout) if req.grammar else 0
        slot = self.strategies.slot(self.tick_timeout) if req.speculate else 0
        ref = self.client.write_prompt(tokens)
        d.builder.admit(tag, ref, sampling=req.sampling, params=req.params,
                        rng_counter_base=(req.rng_base + sampled) & _U64, decode_replay=sampled,
                        seed_handle=seed.handle if seed else 0, determinism_class=SPI,
                        grammar_handle=grammar, grammar_replay=sampled if grammar else 0, strategy_slot=slot)
        # A seed covers `value` tokens: prefill starts there, and so does decode's replay.
        end = max(len(req.prompt), value)
        lane = Lane(tag, req, prefill_end=end, replay_left=len(tokens) - end, prefilled=value)
        if seed:
            d.seeded[tag] = value
        d.admits.append(lane)
        return lane

    def _plan_decodes(self, d: Draft) -> None:
        """Lanes whose prefill is complete by the end of this tick decode:
        GPU lanes up to `decode_grant` new tokens, never past max_new_tokens,
        plus what they have to replay (replayed tokens count against the
        grant); HOST lanes one token (replayed or new). A lane with the
        strategy may run past the grant on verified drafts (overshoot) up to
        what its request has left."""
        for lane in [*self.lanes.values(), *d.admits]:
            if lane.retiring or d.reached.get(lane.tag, lane.prefilled) != lane.prefill_end:
                continue
            req = lane.request
            over = 0
            if req.sampling == HOST:
                grant = 1  # the executor's rule: the planner picks each token
            else:
                # A re-admitted lane catches up in one tick: its replay, then the usual grant.
                left = req.max_new_tokens - len(req.generated)
                new = min(self.decode_grant, left)
                grant = min(_U16, lane.replay_left + new)
                if req.speculate:  # room for every round's draft to be taken whole
                    over = min(_U16, left - new, self.decode_grant * self.strategies.strategy.max_draft)
            d.builder.decode(lane.tag, grant, overshoot=over)
            d.decodes[lane.tag] = grant

    def _refuse(self, req: Request) -> None:
        """A request the worker's memory cannot hold even alone: it ends
        with what it has."""
        req.finish, req.finished_at = "unservable", self.clock()
        self.grammars.release(req.id, self.tick_timeout)

    def _preempt_newest(self) -> bool:
        """Give up the newest running lane's memory: retire it and queue its
        request to be re-admitted from where it is. A lane that runs short
        alone (nothing retiring keeps cells: see _send) can never run: it is
        refused instead. False: no lane to give up."""
        running = [lane for lane in self.lanes.values() if not lane.retiring]
        if not running:
            return False
        lane = running[-1]
        del self.lanes[lane.tag]
        self.retire_next.add(lane.tag)
        if len(running) == 1:
            self._refuse(lane.request)
        else:
            self.waiting.append(lane.request)
            self.stats.preemptions += 1
        return True

    # ---------------------------------------------------------------- absorb

    # -------------------------------------------------------------- recovery

    def _recover(self) -> None:
        """The worker is gone with every lane: wait for its replacement and
        queue each unfinished request to be re-admitted from where it is
        (prompt + generated, generated replayed). Finished lanes need no
        retire: the new worker never had them."""
        self.client.reconnect(self.reconnect_timeout)  # DaemonGone / WorkerGaveUp: nothing to recover to
        self.stats.restarts += 1
        again = [lane.request for lane in self.lanes.values() if not lane.request.done]
        self.lanes.clear()
        self.retire_next.clear()
        self._evict, self._admit_cap = False, None  # a fresh worker: empty cache, free memory
        self.seeds.forget()  # and no leases: nothing here may lean on them
        self.grammars.forget()  # nor grammars: each is registered again at its next admission
        self.strategies.forget()  # nor the strategy: installed again at the next admission
        for req in self.requests.values():
            req.seed, req.no_seed = None, False
        self.waiting.extendleft(reversed(again))

    # ---------------------------------------------------------------- report

    def report(self) -> Report:
        results = {}
        for req in self.requests.values():
            first = req.token_times[0] - req.submitted_at if req.token_times else None
            latency = req.finished_at - req.submitted_at if req.finished_at is not None else None
            results[req.id] = RequestResult(req.id, list(req.generated), req.finish, first, latency,
                                            list(req.token_times), req.admissions)
        s = self.stats
        s.tokens = sum(len(r.generated) for r in self.requests.values())
        s.tokens_per_s = s.tokens / s.wall_s if s.wall_s > 0 else 0.0
        ttfts = [r.ttft_s for r in results.values() if r.ttft_s is not None]
        s.ttft_p50_s, s.ttft_p99_s = _percentile(ttfts, 50), _percentile(ttfts, 99)
        return Report(results, dataclasses.replace(s))
