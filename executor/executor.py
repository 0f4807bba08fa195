"""The executor: lanes, the prefix cache and the tick over a runtime.

`Executor.tick(plan)` is SPEC §3–§4: `check` reads the whole plan against
the state and either rejects it (a status; nothing changes) or returns a
Verdict; `apply` then runs the plan's phases in order — retires, cache
settling, commits, admits, prefill, decode, emits — and returns TickEvents.
Ops (SPEC §7) go through `op`. The executor never touches tensors: it drives
the runtime through its primitives and samples on the host with numpy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import time
from typing import Any, Callable

import numpy as np

from superfluid.abi import (
    CacheClass,
    codec,
    ffi,
    Determinism,
    Fault,
    Finish,
    ParamFlag,
    PlanFlag,
    RingId,
    Sampling,
    ShedKind,
    ShedReason,
    Status,
    TickStatus,
)
from superfluid.abi.records import (
    AdmitResult,
    LaneEmit,
    LaneFault as LaneFaultRecord,
    LaneLogprob,
    RingRef,
    ShedEntry,
    ShedReport,
    TickEvents,
    TickMemCounters,
    TickPlan,
    TickTimings,
)
from superfluid.engine.plan import PlanReject, check_plan, decode_plan, plan_seq_of
from superfluid.engine.runtime import (
    CapacityError,
    FatalError,
    Feed,
    LaneFault,
    Runtime,
    RuntimeFailure,
    SampleSpec,
)
from superfluid.executor import sampling as hs
from superfluid.executor.cache import CacheEntry, Eviction, PrefixCache
from superfluid.executor.lanes import Lane, PendingRow
from superfluid.executor.rings import LocalRings, TickRings
from superfluid.rings.errors import RefError

# A prompt shorter than this is not checkpointed on an exact_only runtime: it is cheap to run again.
CHECKPOINT_MIN_TOKENS = 128
# While latency-sensitive requests wait, a prefill step is about this much work,
# so a yield asked for mid-tick is answered within it.
LATENCY_STEP_SECS = 0.3
LATENCY_STEP_UNIT = 128
EXIT_FATAL = 70
# Plain ints for the per-round loop: IntEnum arithmetic costs a Python call each time.
_GREEDY, _HOST = int(Sampling.GPU_GREEDY), int(Sampling.HOST)
_IGNORE_EOS = int(ParamFlag.IGNORE_EOS)
_GREEDY_SPEC = SampleSpec()
_SIZE = {n: ffi.sizeof(n) for n in ("TickEvents", "AdmitResult", "LaneEmit", "LaneFault", "ShedEntry",
                                     "LaneLogprob", "OpCompletion")}


class ExecutorFatal(Exception):
    """The runtime failed in a way that is no lane's: its state is unknown."""


@dataclasses.dataclass
class TickResult:
    """A tick's outcome: status OK with its events, or the reject."""

    status: Status
    events: TickEvents
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == Status.OK


@dataclasses.dataclass
class Verdict:
    """What check() learned, for apply(): nothing here has happened yet."""

    plan: TickPlan
    prompts: dict[int, list[int]]
    evict: list[CacheEntry]
    cells_after: dict[int, int]  # each prefilled or decoded lane's cells at the end, at most


def _reject(status: Status, field: str, message: str) -> PlanReject:
    return PlanReject(status, field, message)


def _lane_fault_code(e: RuntimeFailure) -> int | None:
    """The LaneFault code a runtime error becomes; None: it is fatal."""
    if isinstance(e, LaneFault):
        return e.code
    if isinstance(e, CapacityError):
        return int(Fault.OOM_TENTATIVE)
    if isinstance(e, FatalError):
        return None
    return int(Fault.INTERNAL)  # Unsupported, UnknownSequence, OutOfBounds: ours, but a lane's


class Executor:
    """One worker's executor state over a runtime.

    runtime: any superfluid.engine.Runtime. rings: where prompts are read
    and emits and logits rows written (LocalRings by default). epoch: the
    worker epoch (nonces carry it, so a commit for a dead worker's row never
    matches). fatal_exit: exit the process with status 70 on a fatal runtime
    error (a worker), else answer Fatal and refuse further ticks (in-process).
    """

    def __init__(self, runtime: Runtime, rings: TickRings | None = None, *, epoch: int = 0,
                 fault_injection: bool = False, fatal_exit: bool = False,
                 cache_max_bytes: int | None = None, clock: Callable[[], int] = time.perf_counter_ns):
        self.runtime = runtime
        self.desc = runtime.desc
        self.rings = rings or LocalRings()
        self.epoch = epoch
        self.fault_injection = fault_injection
        self.fatal_exit = fatal_exit
        self.clock = clock
        self.lanes: dict[int, Lane] = {}
        self.faulted: set[int] = set()  # faulted lanes not yet retired
        self.cache = PrefixCache()
        self.cache_max_bytes = cache_max_bytes
        self.last_plan_seq: int | None = None
        self.tick_count = 0
        self.biases: dict[int, Any] = {}  # handle -> hs.LogitBias
        self.next_handle = 1
        self.inject_fault: dict[int, int] = {}  # lane tag -> fault code, fired at its next decode
        self.completions: list = []  # OpCompletion records for the next events
        self.pending_shed: list = []  # evictions made by ops, reported by the next tick
        self._nonce = 0
        self.prefill_secs_per_token: float | None = None
        self.penalty_exempt: frozenset[int] | None = None
        self.dead: str | None = None  # why the executor refuses ticks after a fatal error
        self.partial_sink: Callable[[int, int, int, int], None] | None = None
        self.tokens_emitted = 0
        self.rejects = 0
        self.last_fault: tuple[int, int] | None = None  # (lane, code) of the newest LaneFault
        self.event_capacity: int | None = None  # bytes an events message may take (the event slot)

    # ------------------------------------------------------------ helpers

    @property
    def page(self) -> int:
        return max(1, self.desc.page)

    @property
    def exact_only(self) -> bool:
        return self.desc.exact_only

    def _fresh_nonce(self) -> int:
        self._nonce += 1
        return ((self.epoch & 0xFFFFF) << 44) | self._nonce

    def _entry_bytes(self, cells: int) -> int:
        return cells * self.runtime.cell_bytes()

    def _fatal(self, during: str, err: Exception) -> ExecutorFatal:
        msg = (f"superfluid: the {self.desc.runtime_id} runtime failed in {during} ({err}); "
               f"this worker exits so that the daemon starts a clean one")
        if self.fatal_exit:
            print(msg, file=sys.stderr, flush=True)
            os._exit(EXIT_FATAL)
        self.dead = msg
        return ExecutorFatal(msg)

    def live_sequences(self) -> int:
        return len(self.lanes) + len(self.cache)

    # ------------------------------------------------------------ the tick

    def tick(self, plan: TickPlan | bytes | bytearray | memoryview) -> TickResult:
        """Check, then apply, one plan (a TickPlan record or a slot message)."""
        t0 = self.clock()
        seq = plan.plan_seq if isinstance(plan, TickPlan) else plan_seq_of(plan)
        if self.dead:
            return self._refused(seq, Status.Fatal, "executor", self.dead)
        try:
            if isinstance(plan, TickPlan):
                check_plan(plan)  # the record-level checks decode_plan runs on bytes
            else:
                plan = decode_plan(plan)
            verdict = self.check(plan)
        except PlanReject as r:
            self.rejects += 1
            return self._refused(seq, r.status, r.field, r.message)
        try:
            events = self.apply(verdict, t0)
        except ExecutorFatal as e:
            return self._refused(plan.plan_seq, Status.Fatal, "runtime", str(e))
        return TickResult(Status.OK, events)

    def _refused(self, plan_seq: int, status: Status, field: str, message: str) -> TickResult:
        detail = f"{field}: {message}"
        ev = TickEvents(plan_seq=plan_seq, status=int(status), message=detail.encode(), worker_epoch=self.epoch,
                        op_completions=tuple(self._take_completions()), mem=self._mem_record())
        return TickResult(status, ev, detail)

    def _take_completions(self) -> list:
        out, self.completions = self.completions, []
        return out

    # ---------------------------------------------------------------- ops

    def op(self, msg: dict | bytes, *, queue: bool = False):
        """Run one op now; its OpCompletion. queue=True also holds the
        completion for the next tick's events (the worker's way)."""
        from superfluid.executor.ops import run_op

        done = run_op(self, msg)
        if queue:
            self.completions.append(done)
        return done

    # -------------------------------------------------------------- check

    def check(self, plan: TickPlan) -> Verdict:
        """Every check of SPEC §3, in order. Raises PlanReject; changes nothing."""
        desc = self.desc
        if self.last_plan_seq is not None and plan.plan_seq <= self.last_plan_seq:
            raise _reject(Status.RejectIllegalCombination, "TickPlan.plan_seq",
                          f"{plan.plan_seq} is not above the last accepted {self.last_plan_seq}")
        if plan.max_decode_lanes > desc.max_batch:
            raise _reject(Status.RejectBudget, "TickPlan.max_decode_lanes",
                          f"{plan.max_decode_lanes} > max_batch {desc.max_batch}")
        if len(plan.decodes) > plan.max_decode_lanes:
            raise _reject(Status.RejectBudget, "TickPlan.decodes",
                          f"{len(plan.decodes)} decodes > max_decode_lanes {plan.max_decode_lanes}")
        if plan.flags & PlanFlag.DRAIN and plan.admits:
            raise _reject(Status.RejectIllegalCombination, "TickPlan.admits", "admits in a DRAIN plan")
        # (Step 3, sweeping expired seed leases, has nothing to sweep until leases exist.)
        prompts = self._check_admits(plan)
        self._check_commits(plan)
        reached, prefill_tokens = self._check_prefills(plan, prompts)
        decode_rounds = self._check_decodes(plan, prompts, reached)
        self._check_retires(plan)
        evict, cells_after = self._check_memory(plan, prompts, reached, decode_rounds)
        self._check_events_fit(plan)
        return Verdict(plan, prompts, evict, cells_after)

    def _check_events_fit(self, plan: TickPlan) -> None:
        """An applied plan cannot be taken back, so its events must fit their
        slot: bound them from above before anything moves."""
        if self.event_capacity is None:
            return
        size = codec.MSG_HEADER_BYTES + _SIZE["TickEvents"] + 512  # + the reject message, alignment
        size += len(plan.admits) * _SIZE["AdmitResult"]
        size += len(plan.decodes) * _SIZE["LaneEmit"]
        size += (len(plan.decodes) + len(plan.prefills) + len(plan.admits)) * _SIZE["LaneFault"]
        sheds = 2 * len(plan.prefills) + len(plan.retires) + len(self.cache) + len(self.pending_shed)
        size += sheds * _SIZE["ShedEntry"]
        wants = {a.lane_tag for a in plan.admits if a.want_logprobs}
        wants |= {t for t, ln in self.lanes.items() if ln.logprobs_top is not None}
        size += sum(d.max_new_tokens for d in plan.decodes if d.lane_tag in wants) * _SIZE["LaneLogprob"]
        size += sum(_SIZE["OpCompletion"] + len(c.payload) + 8 for c in self.completions)
        if size > self.event_capacity:
            raise _reject(Status.RejectBudget, "TickPlan.decodes",
                          f"its events could take {size} bytes, the event slot holds {self.event_capacity}")

    def _check_admits(self, plan: TickPlan) -> dict[int, list[int]]:
        desc = self.desc
        prompts: dict[int, list[int]] = {}
        for i, a in enumerate(plan.admits):
            f = f"admits[{i}]"
            if a.lane_tag in self.lanes:
                raise _reject(Status.RejectIllegalCombination, f"{f}.lane_tag", f"lane {a.lane_tag} is live")
            if a.prompt.ring_id != RingId.PROMPT:
                raise _reject(Status.RejectBounds, f"{f}.prompt.ring_id",
                              f"{a.prompt.ring_id} is not the prompt ring ({int(RingId.PROMPT)})")
            try:
                prompt = self.rings.read_prompt(a.prompt)
            except RefError as e:
                raise _reject(e.status, f"{f}.prompt", str(e)) from None
            if prompt.size == 0:
                raise _reject(Status.RejectBounds, f"{f}.prompt", "an empty prompt")
            if int(prompt.max()) >= desc.vocab_size:
                raise _reject(Status.RejectBounds, f"{f}.prompt",
                              f"token {int(prompt.max())} is outside the vocabulary of {desc.vocab_size}")
            if a.decode_replay >= prompt.size:
                raise _reject(Status.RejectBounds, f"{f}.decode_replay",
                              f"{a.decode_replay} >= the prompt's {prompt.size} tokens")
            if a.strategy_slot:
                raise _reject(Status.RejectIllegalCombination, f"{f}.strategy_slot",
                              f"no strategy is installed in slot {a.strategy_slot}")
            if a.grammar_handle:
                raise _reject(Status.RejectIllegalCombination, f"{f}.grammar_handle",
                              f"grammar {a.grammar_handle} is not registered")
            if a.grammar_replay:
                raise _reject(Status.RejectIllegalCombination, f"{f}.grammar_replay", "grammar_replay without a grammar")
            if a.logit_bias_handle and a.logit_bias_handle not in self.biases:
                raise _reject(Status.RejectIllegalCombination, f"{f}.logit_bias_handle",
                              f"logit bias {a.logit_bias_handle} is not registered")
            if a.seed_handle:
                raise _reject(Status.RejectStaleSeed, f"{f}.seed_handle", f"no seed lease {a.seed_handle}")
            if prompt.size > desc.max_seq_len:
                raise _reject(Status.RejectBudget, f"{f}.prompt",
                              f"{prompt.size} tokens > max_seq_len {desc.max_seq_len}")
            prompts[a.lane_tag] = prompt.tolist()
        return prompts

    def _check_commits(self, plan: TickPlan) -> None:
        retiring = {r.lane_tag for r in plan.retires}
        for i, c in enumerate(plan.commits):
            f = f"commits[{i}]"
            lane = self.lanes.get(c.lane_tag)
            if lane is None:
                raise _reject(Status.RejectUnknownLane, f"{f}.lane_tag", f"no live lane {c.lane_tag}")
            if lane.sampling != Sampling.HOST or lane.finished:
                raise _reject(Status.RejectIllegalCombination, f"{f}.lane_tag",
                              f"lane {c.lane_tag} is {'finished' if lane.finished else 'not HOST-sampled'}")
            if lane.pending_row is None:
                raise _reject(Status.RejectHostRules, f"{f}.lane_tag", f"lane {c.lane_tag} has no pending logits row")
            if c.logits_nonce != lane.pending_row.nonce:
                raise _reject(Status.RejectStaleNonce, f"{f}.logits_nonce",
                              f"{c.logits_nonce:#x} is not the pending row's nonce")
            if c.token_id >= self.desc.vocab_size:
                raise _reject(Status.RejectBounds, f"{f}.token_id",
                              f"{c.token_id} is outside the vocabulary of {self.desc.vocab_size}")
            if c.lane_tag in retiring:
                raise _reject(Status.RejectIllegalCombination, f"{f}.lane_tag",
                              f"lane {c.lane_tag} is committed and retired in one plan")

    def _admit_of(self, plan: TickPlan, tag: int):
        for a in plan.admits:
            if a.lane_tag == tag:
                return a
        return None

    def _check_prefills(self, plan: TickPlan, prompts: dict[int, list[int]]) -> tuple[dict[int, int], int]:
        """Prefill tokens each lane will have after this tick, and the tokens taken."""
        reached: dict[int, int] = {}
        budget = plan.prefill_token_budget
        taken = 0
        retiring = self._retiring_live(plan)
        for i, p in enumerate(plan.prefills):
            f = f"prefills[{i}]"
            lane = self.lanes.get(p.lane_tag)
            if lane is not None:
                end, done = lane.prefill_end, lane.prefilled
            elif p.lane_tag in prompts:
                a = self._admit_of(plan, p.lane_tag)
                end, done = len(prompts[p.lane_tag]) - a.decode_replay, 0
            else:
                raise _reject(Status.RejectUnknownLane, f"{f}.lane_tag", f"no live or admitted lane {p.lane_tag}")
            if p.lane_tag in retiring:
                raise _reject(Status.RejectIllegalCombination, f"{f}.lane_tag",
                              f"lane {p.lane_tag} is prefilled and retired in one plan")
            if p.token_offset != done:
                raise _reject(Status.RejectIllegalCombination, f"{f}.token_offset",
                              f"{p.token_offset}, but lane {p.lane_tag} has {done} tokens prefilled")
            if p.token_offset + p.token_count > end:
                raise _reject(Status.RejectBounds, f"{f}.token_count",
                              f"offset {p.token_offset} + {p.token_count} > the {end} tokens prefill feeds")
            take = min(p.token_count, budget)
            budget -= take
            taken += take
            reached[p.lane_tag] = done + take
        return reached, taken

    def _check_decodes(self, plan: TickPlan, prompts: dict[int, list[int]], reached: dict[int, int]) -> dict[int, int]:
        """Decode rounds each lane can run (capped by its room to max_seq_len)."""
        committing = {c.lane_tag for c in plan.commits}
        retiring = self._retiring_live(plan)
        rounds: dict[int, int] = {}
        for i, d in enumerate(plan.decodes):
            f = f"decodes[{i}]"
            lane = self.lanes.get(d.lane_tag)
            if lane is not None:
                host, pending_row, end = lane.sampling == Sampling.HOST, lane.pending_row is not None, lane.prefill_end
                prompt_len = len(lane.prompt)
                after = reached.get(d.lane_tag, lane.prefilled)
                finished, committed = lane.finished, len(lane.committed) + (d.lane_tag in committing)
            elif d.lane_tag in prompts:
                a = self._admit_of(plan, d.lane_tag)
                host, pending_row = a.sampling == Sampling.HOST, False
                prompt_len = len(prompts[d.lane_tag])
                end = prompt_len - a.decode_replay
                after, finished, committed = reached.get(d.lane_tag, 0), False, end
            else:
                raise _reject(Status.RejectUnknownLane, f"{f}.lane_tag", f"no live or admitted lane {d.lane_tag}")
            if finished:
                raise _reject(Status.RejectIllegalCombination, f"{f}.lane_tag", f"lane {d.lane_tag} has finished")
            if d.lane_tag in retiring:
                raise _reject(Status.RejectIllegalCombination, f"{f}.lane_tag",
                              f"lane {d.lane_tag} is decoded and retired in one plan")
            if host:
                if d.max_new_tokens != 1:
                    raise _reject(Status.RejectHostRules, f"{f}.max_new_tokens",
                                  f"{d.max_new_tokens}: a HOST lane decodes one token a tick")
                if pending_row and d.lane_tag not in committing:
                    raise _reject(Status.RejectHostRules, f"{f}.lane_tag",
                                  f"lane {d.lane_tag} holds a logits row that this plan does not commit")
            if after != end:
                raise _reject(Status.RejectIllegalCombination, f"{f}.lane_tag",
                              f"lane {d.lane_tag}'s prefill ends at {after} of {end} tokens this tick")
            # Each round feeds one cell; a lane at max_seq_len still feeds a pending token
            # once (its own, a commit's, or one an exact_only prefill held back this tick).
            room = max(0, self.desc.max_seq_len - committed)
            pending = (lane is not None and (lane.pending_input is not None or d.lane_tag in committing)) or (
                self.exact_only and d.lane_tag in reached and end == prompt_len and prompt_len >= 2)
            rounds[d.lane_tag] = (max(int(pending), min(d.max_new_tokens, room))) if d.max_new_tokens else 0
        return rounds

    def _retiring_live(self, plan: TickPlan) -> set[int]:
        # A retired faulted tag may be re-admitted, prefilled and decoded in
        # the same plan (retires run first); only a live lane's retire clashes.
        return {r.lane_tag for r in plan.retires if r.lane_tag in self.lanes}

    def _check_retires(self, plan: TickPlan) -> None:
        for i, r in enumerate(plan.retires):
            if r.lane_tag not in self.lanes and r.lane_tag not in self.faulted:
                raise _reject(Status.RejectUnknownLane, f"retires[{i}].lane_tag",
                              f"no live or faulted lane {r.lane_tag}")

    def _pages(self, cells: int) -> int:
        return -(-cells // self.page)

    def _check_memory(self, plan: TickPlan, prompts: dict[int, list[int]], reached: dict[int, int],
                      rounds: dict[int, int]) -> tuple[list[CacheEntry], dict[int, int]]:
        """Step 9: cells (in whole pages) and sequence slots for the plan,
        evicting unpinned cache entries only as the plan allows."""
        page = self.page
        # Cells each lane's sequence holds now and after this tick.
        grow: dict[int, list[int]] = {}

        def held(tag: int) -> int:
            lane = self.lanes.get(tag)
            return self.runtime.seq_len(lane.seq) if lane else 0

        for tag, done in reached.items():
            lane = self.lanes.get(tag)
            h = held(tag)
            grow[tag] = [h, h + done - (lane.prefilled if lane else 0)]
        for tag, n in rounds.items():
            grow.setdefault(tag, [held(tag), held(tag)])[1] += n
        needed = sum((self._pages(after) - self._pages(held)) * page for held, after in grow.values())
        live_retires = [r for r in plan.retires if r.lane_tag in self.lanes]
        for r in live_retires:
            lane = self.lanes[r.lane_tag]
            if r.publish_to_cache and lane.pending_input is not None:
                held = self.runtime.seq_len(lane.seq)
                needed += (self._pages(held + 1) - self._pages(held)) * page
        retired = [self.lanes[r.lane_tag].seq for r in live_retires if not r.publish_to_cache]
        mem = self.runtime.mem_counters()
        free = max(0, mem.cells_total - mem.cells_used)
        short = 0
        if self.desc.max_seqs:
            room = self.desc.max_seqs + len(retired) - mem.seqs
            short = max(0, len(plan.admits) - room)

        def fits(victims: list[int]) -> bool:
            return mem.cells_total == 0 or free + (self.runtime.cells_released(victims) if victims else 0) >= needed

        cells_after = {tag: after for tag, (_, after) in grow.items()}
        if fits(retired) and short == 0:
            return [], cells_after
        why = (f"the plan needs {needed} cells, {free} are free" if not fits(retired)
               else f"{short} more sequence slots than max_seqs allows")
        if not plan.evictable_cache_classes & CacheClass.RESIDENT_PREFIX_CLASS:
            raise _reject(Status.NeedsReplan, "TickPlan.evictable_cache_classes",
                          f"{why}, and the plan allows no cache eviction")
        cap = min(plan.max_evict_bytes, max(0, self.cache.resident_bytes - plan.protected_quota_bytes))
        picked, ok = self.cache.plan_evict_until(
            cap, lambda p: len(p) >= short and fits(retired + [e.seq for e in p]))
        if not ok:
            raise _reject(Status.NeedsReplan, "TickPlan.max_evict_bytes",
                          f"{why}; evicting up to {cap} bytes of the cache is not enough")
        return picked, cells_after

    # -------------------------------------------------------------- apply

    def apply(self, v: Verdict, t0: int) -> TickEvents:
        plan = v.plan
        self.last_plan_seq = plan.plan_seq
        self.tick_count += 1
        t = _Tick(self, plan)
        t.cells_after = v.cells_after
        for e in v.evict:
            t.evict(e, ShedReason.MEMORY)
        t.retires()
        t.settle_cache()
        t.commits()
        t.admits(v.prompts)
        t_prefill = self.clock()
        t.prefill()
        prefill_ns = self.clock() - t_prefill
        t_decode = self.clock()
        t.decode()
        decode_ns = self.clock() - t_decode
        return t.events(TickTimings(self.clock() - t0, prefill_ns, decode_ns, 0, 0))

    def _mem_record(self) -> TickMemCounters:
        mem = self.runtime.mem_counters()
        page = self.page
        return TickMemCounters(allocated_bytes=mem.allocated_bytes, host_retained_bytes=0,
                               pool_blocks_total=mem.cells_total // page, pool_blocks_used=mem.cells_used // page,
                               pool_bytes_evictable=self.cache.unpinned_bytes, tentative_bytes=0)

    # ------------------------------------------------------------- state

    def state_digest(self) -> str:
        """A hash of everything a tick can change (lanes, cache, counters,
        the runtime's sequences): equal before and after a rejected plan."""
        h = hashlib.sha256()

        def put(*xs: Any) -> None:
            h.update(repr(xs).encode())

        put(self.last_plan_seq, self.tick_count, self._nonce, sorted(self.faulted), sorted(self.inject_fault.items()),
            sorted(self.biases), self.next_handle, len(self.pending_shed))
        for tag in sorted(self.lanes):
            ln = self.lanes[tag]
            put(tag, ln.seq, ln.sampling, tuple(ln.params), ln.rng_base, ln.rng_counter, ln.prompt, ln.prefill_end,
                ln.prefilled, ln.committed, ln.pending_input, ln.pending_row, ln.finished, ln.logprobs_top,
                self.runtime.seq_len(ln.seq))
        for e in sorted(self.cache, key=lambda e: e.seq):
            put(dataclasses.astuple(e), self.runtime.seq_len(e.seq))
        put(self.runtime.mem_counters())
        return h.hexdigest()


class _Tick:
    """One applied plan's working state."""

    def __init__(self, ex: Executor, plan: TickPlan):
        self.ex = ex
        self.rt = ex.runtime
        self.plan = plan
        self.admit_results: list = []
        self.faults: list = []
        self.faulted_now: set[int] = set()
        self.shed: list = list(ex.pending_shed)
        self.chunks_dropped = 0
        self.evictions = len(ex.pending_shed)
        self.bytes_evicted = sum(e.bytes for e in ex.pending_shed)
        ex.pending_shed = []
        self.logprobs: list = []
        self.rows: dict[int, np.ndarray] = {}
        self.out_tokens: dict[int, list[int]] = {d.lane_tag: [] for d in plan.decodes}
        self.finishes: dict[int, int] = {}
        self.partial = bool(plan.flags & PlanFlag.PARTIAL_EMITS) and ex.partial_sink is not None
        self.yielded = False
        self.cells_after: dict[int, int] = {}  # the check's bound on each lane's cells at the end

    # ----------------------------------------------------------- faults

    def fault(self, tag: int, code: int, detail: int = 0) -> None:
        if tag in self.faulted_now:
            return
        self.faulted_now.add(tag)
        self.faults.append(LaneFaultRecord(lane_tag=tag, code=int(code), detail=detail))
        self.ex.last_fault = (tag, int(code))
        lane = self.ex.lanes.pop(tag, None)
        if lane is not None:
            self.free(lane.seq, "freeing a faulted lane")
            self.ex.faulted.add(tag)
        self.ex.inject_fault.pop(tag, None)
        self.rows.pop(tag, None)

    def free(self, seq: int, during: str) -> None:
        """Free a sequence; only a fatal error matters (any other means the
        runtime holds nothing more of it that we could free)."""
        try:
            self.rt.seq_free(seq)
        except FatalError as e:
            raise self.ex._fatal(during, e) from e
        except RuntimeFailure:
            pass

    def step(self, feeds: list[Feed], tags: list[int], during: str) -> list[np.ndarray] | None:
        """One runtime step; on a lane error its lanes fault and None returns."""
        try:
            return self.rt.step(feeds)
        except RuntimeFailure as e:
            code = _lane_fault_code(e)
            if code is None:
                raise self.ex._fatal(during, e) from e
            for tag in tags:
                self.fault(tag, code)
            return None

    # ----------------------------------------------------------- cache

    def evict(self, e: CacheEntry, reason: int) -> None:
        self.ex.cache.remove(e.seq)
        self.free(e.seq, "evicting a cache entry")
        self.shed.append(ShedEntry(lane_tag=0, kind=int(ShedKind.CACHE_EVICTION), reason=int(reason),
                                   bytes=e.bytes, tokens=len(e.tokens)))
        self.evictions += 1
        self.bytes_evicted += e.bytes

    def settle_cache(self) -> None:
        """Keep the cache within its byte limit: least recently used first."""
        limit = self.ex.cache_max_bytes
        if limit is None:
            return
        over = self.ex.cache.resident_bytes - limit
        for e in self.ex.cache.lru():
            if over <= 0:
                break
            over -= e.bytes
            self.evict(e, ShedReason.PRESSURE)

    def publish(self, lane: Lane) -> bool:
        """Keep a retiring lane's sequence as a cache entry; False when it
        could not be kept (the caller frees it)."""
        ex = self.ex
        if lane.pending_input is not None:
            # Forward-once held the last token back: feed it so the entry keys every
            # committed token. Out of cells, the step changed nothing: publish what is
            # held. A lane fault says the sequence itself is suspect: keep none of it.
            try:
                self.rt.step([Feed(lane.seq, [lane.pending_input])])
                lane.pending_input = None
            except CapacityError:
                pass
            except FatalError as e:
                raise ex._fatal("a publishing retire", e) from e
            except RuntimeFailure:
                return False
        ingested = lane.ingested
        key_len = ingested if ex.exact_only else ingested // ex.page * ex.page
        if key_len < 1:
            return False
        key = tuple(lane.committed[:key_len])
        same = ex.cache.find(key)
        if same is not None:
            same.last_used = ex.tick_count  # the same cells are cached already
            return False
        held = self.rt.seq_len(lane.seq)
        if key_len < held:
            try:
                self.rt.seq_truncate(lane.seq, key_len)
            except RuntimeFailure:
                return False
        ex.cache.insert(lane.seq, key, len(lane.prompt), ex._entry_bytes(key_len), ex.tick_count)
        return True

    # ----------------------------------------------------------- phases

    def retires(self) -> None:
        ex = self.ex
        publishing = []
        # Frees first: the memory check counted their cells as free for the
        # publishes' pending feeds, whatever the plan's order.
        for r in self.plan.retires:
            if r.lane_tag in ex.faulted:
                ex.faulted.discard(r.lane_tag)
                continue
            lane = ex.lanes.pop(r.lane_tag)
            ex.inject_fault.pop(r.lane_tag, None)
            if r.publish_to_cache:
                publishing.append(lane)
            else:
                self.free(lane.seq, "a retire")
        for lane in publishing:
            if not self.publish(lane):
                self.free(lane.seq, "a retire")

    def commits(self) -> None:
        for c in self.plan.commits:
            lane = self.ex.lanes[c.lane_tag]
            lane.committed.append(c.token_id)
            lane.pending_input = c.token_id
            lane.pending_row = None
            lane.rng_counter += 1

    def admits(self, prompts: dict[int, list[int]]) -> None:
        ex = self.ex
        for a in self.plan.admits:
            ex.faulted.discard(a.lane_tag)
            try:
                seq = self.rt.seq_create()
            except RuntimeFailure as e:
                raise ex._fatal("creating a sequence the check made room for", e) from e
            prompt = prompts[a.lane_tag]
            bias = ex.biases.get(a.logit_bias_handle) if a.logit_bias_handle else None
            lane = Lane(
                tag=a.lane_tag, seq=seq, sampling=a.sampling, params=a.params, rng_base=a.rng_counter_base,
                prompt=prompt, prefill_end=len(prompt) - a.decode_replay, bias=bias,
                logprobs_top=(a.want_logprobs - 1) if a.want_logprobs else None,
                granted_class=int(Determinism.SEED_PATH_INVARIANT))
            lane.greedy = a.sampling == _GREEDY or a.params.temperature <= 0
            lane.ignore_eos = bool(a.params.flags & _IGNORE_EOS)
            desc = ex.desc
            lane.engine_ok = (desc.engine_sampling and a.sampling != _HOST and (lane.greedy or desc.engine_draws)
                              and bias is None and not hs.penalizes(a.params) and lane.logprobs_top is None)
            ex.lanes[a.lane_tag] = lane
            self.admit_results.append(AdmitResult(lane_tag=a.lane_tag, status=1, reject_code=0, cert_id=0,
                                                  granted_class=int(Determinism.SEED_PATH_INVARIANT)))

    def _shed_chunk(self, tag: int, tokens: int, reason: int) -> None:
        self.chunks_dropped += 1
        self.shed.append(ShedEntry(lane_tag=tag, kind=int(ShedKind.PREFILL_CHUNK), reason=int(reason), bytes=0,
                                   tokens=tokens))

    def _step_cap(self) -> int:
        ex = self.ex
        n = ex.desc.prefill_step_tokens
        if n == 0:
            return 1 << 62
        spt = ex.prefill_secs_per_token
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
            feeds, tags, wants = [], [], []
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
                checkpoint = completes and ex.exact_only and len(lane.prompt) >= 2
                want = completes and tag in decoding and not checkpoint
                if checkpoint:
                    checkpoints.append(tag)
                if completes and not want:
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
            spt = ex.prefill_secs_per_token
            ex.prefill_secs_per_token = sample if spt is None else 0.7 * spt + 0.3 * sample

    def _checkpoint(self, tag: int) -> None:
        """On an exact_only runtime: a copy of a lane whose prompt of >= 128
        tokens just ended, one token short (the held-back one), kept in the
        cache for a resent prompt. The memory check does not count it, so it
        is taken only from cells and slots the rest of the tick cannot need."""
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
            promised = sum(max(0, ex._pages(after) - ex._pages(self.rt.seq_len(ex.lanes[t].seq)))
                           for t, after in self.cells_after.items() if t in ex.lanes) * ex.page
            if mem.cells_total - mem.cells_used - promised < ex._pages(n) * ex.page:
                return
        dst = None
        try:
            dst = self.rt.seq_create()
            self.rt.seq_copy(lane.seq, dst, n)
        except FatalError as e:
            raise ex._fatal("a checkpoint", e) from e
        except RuntimeFailure:
            if dst is not None:
                self.free(dst, "a failed checkpoint")
            return
        ex.cache.insert(dst, key, n, ex._entry_bytes(n), ex.tick_count)

    # ----------------------------------------------------------- decode

    @staticmethod
    def _engine_spec(lane: Lane) -> SampleSpec | None:
        """The device sampling spec of a lane, or None when the host samples it."""
        if not lane.engine_ok:
            return None
        p = lane.params
        if lane.greedy:
            return _GREEDY_SPEC
        return SampleSpec(p.temperature, p.top_k, p.top_p, p.min_p, lane.position)

    def decode(self) -> None:
        ex, plan = self.ex, self.plan
        yielded = self.yielded
        remaining: dict[int, int] = {}
        replaying: list[int] = []
        round_: list[tuple[int, int]] = []  # (tag, token to feed)
        for d in plan.decodes:
            tag = d.lane_tag
            if tag in self.faulted_now:
                continue
            code = ex.inject_fault.pop(tag, None)
            if code is not None:
                self.fault(tag, code)
                continue
            if d.max_new_tokens == 0:
                continue
            lane = ex.lanes[tag]
            if yielded and len(lane.committed) < len(lane.prompt):
                continue  # its prefill was cut short by the yield
            remaining[tag] = d.max_new_tokens
            if len(lane.committed) < len(lane.prompt):
                replaying.append(tag)
                continue
            if tag in self.rows:
                continue  # the prefill's last step gave its first row
            if lane.pending_input is None:
                raise ex._fatal("decode", RuntimeError(f"lane {tag} has no input to decode"))
            round_.append((tag, lane.pending_input))
            lane.pending_input = None
        self._replay(replaying, remaining)
        self._rounds(round_, remaining)

    def _replay(self, replaying: list[int], remaining: dict[int, int]) -> None:
        """decode_replay: the prompt's tail, one token a round, as decode fed
        it the first time; not emitted, counted against the grant."""
        ex = self.ex
        yield_after = False
        while True:
            passes: list[tuple[int, int, bool]] = []
            for tag in replaying:
                lane = ex.lanes.get(tag)
                if lane is None or remaining.get(tag, 0) <= 0 or len(lane.committed) >= len(lane.prompt):
                    continue
                token = lane.prompt[len(lane.committed)]
                last = len(lane.committed) + 1 == len(lane.prompt)
                lane.committed.append(token)
                remaining[tag] -= 1
                if last and remaining[tag] == 0:
                    lane.pending_input = token
                else:
                    passes.append((tag, token, last))
            if not passes:
                break
            if yield_after and ex.rings.yield_requested():
                for tag, _, _ in passes:
                    ex.lanes[tag].committed.pop()
                    remaining[tag] += 1
                break
            yield_after = True
            for i in range(0, len(passes), max(1, ex.desc.max_batch)):
                chunk = passes[i:i + max(1, ex.desc.max_batch)]
                feeds = [Feed(ex.lanes[tag].seq, [token], last) for tag, token, last in chunk]
                got = self.step(feeds, [tag for tag, _, _ in chunk], "a decode replay")
                if got is None:
                    for tag, _, _ in chunk:
                        remaining.pop(tag, None)
                    continue
                it = iter(got)
                for tag, _, last in chunk:
                    if last:
                        self.rows[tag] = next(it)
        for tag in replaying:
            if remaining.get(tag) == 0:
                remaining.pop(tag)

    def _finish(self, lane: Lane, code: int, remaining: dict[int, int]) -> None:
        self.finishes[lane.tag] = int(code)
        lane.finished = True
        remaining.pop(lane.tag, None)

    def _rounds(self, round_: list[tuple[int, int]], remaining: dict[int, int]) -> None:
        ex, rt = self.ex, self.rt
        desc = ex.desc
        eos = rt.vocabulary().eos
        max_len = desc.max_seq_len
        picked: dict[int, int] = {}
        while True:
            for i in range(0, len(round_), max(1, desc.max_batch)):
                chunk = round_[i:i + max(1, desc.max_batch)]
                lanes = [ex.lanes[tag] for tag, _ in chunk]
                feeds = [Feed(ln.seq, [tok], True) for ln, (_, tok) in zip(lanes, chunk)]
                tags = [tag for tag, _ in chunk]
                specs = [self._engine_spec(ln) for ln in lanes]
                if all(s is not None for s in specs):
                    try:
                        toks = rt.step_sampled(feeds, specs)
                    except RuntimeFailure as e:
                        code = _lane_fault_code(e)
                        if code is None:
                            raise ex._fatal("a decode step", e) from e
                        for tag in tags:
                            self.fault(tag, code)
                            remaining.pop(tag, None)
                        continue
                    if toks is not None:
                        picked.update(zip(tags, toks))
                        continue
                got = self.step(feeds, tags, "a decode step")
                if got is None:
                    for tag in tags:
                        remaining.pop(tag, None)
                    continue
                self.rows.update(zip(tags, got))
            round_ = []
            for tag in sorted(set(self.rows) | set(picked)):
                lane = ex.lanes.get(tag)
                if lane is None or tag not in remaining:
                    self.rows.pop(tag, None)
                    picked.pop(tag, None)
                    continue
                if len(lane.committed) >= max_len:
                    self.rows.pop(tag, None)
                    picked.pop(tag, None)
                    self._finish(lane, Finish.LENGTH, remaining)
                    continue
                if tag in picked:
                    token = int(picked.pop(tag))
                else:
                    row = self.rows.pop(tag)
                    if lane.sampling == _HOST:
                        remaining.pop(tag, None)
                        try:
                            ref = ex.rings.write_logits(row)
                        except RefError:
                            self.fault(tag, Fault.REF_SPAN_OOB)
                            continue
                        lane.pending_row = PendingRow(ex._fresh_nonce(), ref)
                        continue
                    token = self._host_pick(lane, row)
                lane.committed.append(token)
                lane.rng_counter += 1
                out = self.out_tokens[tag]
                if self.partial:
                    ex.partial_sink(self.plan.plan_seq, tag, token, len(out))
                out.append(token)
                remaining[tag] -= 1
                lane.pending_input = token
                if token in eos and not lane.ignore_eos:
                    self._finish(lane, Finish.EOS, remaining)
                elif len(lane.committed) >= max_len:
                    self._finish(lane, Finish.LENGTH, remaining)
                elif remaining[tag] == 0:
                    remaining.pop(tag)
                else:
                    lane.pending_input = None
                    round_.append((tag, token))
            if not round_:
                break
            if ex.rings.yield_requested():
                for tag, token in round_:
                    ex.lanes[tag].pending_input = token
                    remaining.pop(tag, None)
                break

    def _host_pick(self, lane: Lane, row: np.ndarray) -> int:
        ex = self.ex
        exempt = frozenset()
        if hs.penalizes(lane.params):
            if ex.penalty_exempt is None:
                v = self.rt.vocabulary()
                ex.penalty_exempt = frozenset(v.specials.values()) | frozenset(v.eos)
            exempt = ex.penalty_exempt
        token, lp = hs.pick(row, lane.sampling, lane.params, lane.position, bias=lane.bias, history=lane.committed,
                            exempt=exempt, want_logprobs=0 if lane.logprobs_top is None else lane.logprobs_top + 1)
        if lp is not None:
            idx = len(self.out_tokens[lane.tag])
            self.logprobs.append(LaneLogprob(lane_tag=lane.tag, token_id=token, logprob=lp.logprob,
                                             n_top=len(lp.top_ids), index=idx, top_ids=lp.top_ids,
                                             top_logprobs=lp.top_logprobs))
        return token

    # ----------------------------------------------------------- events

    def events(self, timings: TickTimings) -> TickEvents:
        ex = self.ex
        emits = []
        for d in self.plan.decodes:
            tag = d.lane_tag
            if tag in self.faulted_now or tag not in ex.lanes:
                continue
            lane = ex.lanes[tag]
            finish = self.finishes.get(tag, int(Finish.NONE))
            if lane.sampling == Sampling.HOST:
                row = lane.pending_row
                emits.append(LaneEmit(lane_tag=tag, finish=finish, logits_row=row.ref if row else RingRef(),
                                      logits_nonce=row.nonce if row else 0))
                continue
            tokens = self.out_tokens.get(tag, [])
            try:
                ref = ex.rings.write_tokens(np.asarray(tokens, dtype=np.uint32))
            except RefError:
                self.fault(tag, Fault.REF_SPAN_OOB)
                continue
            ex.tokens_emitted += len(tokens)
            emits.append(LaneEmit(lane_tag=tag, token_ref=ref, n_tokens=len(tokens), finish=finish))
        status = (TickStatus.LANE_ERRORS if self.faults else
                  TickStatus.SHED if self.chunks_dropped or self.evictions else TickStatus.OK)
        shed = ShedReport(self.chunks_dropped, self.evictions, self.bytes_evicted, tuple(self.shed))
        return TickEvents(plan_seq=self.plan.plan_seq, status=int(Status.OK), tick_status=int(status),
                          admit_results=tuple(self.admit_results), emits=tuple(emits), faults=tuple(self.faults),
                          shed=shed, op_completions=tuple(ex._take_completions()), logprobs=tuple(self.logprobs),
                          timings=timings, mem=ex._mem_record(), worker_epoch=ex.epoch)
