"""The executor: lanes, the prefix cache, seed leases and the tick over a runtime.

`Executor.tick(plan)` is contract §3–§4: `check` (check.py, memory.py) reads
the whole plan against the state and either rejects it (a status; nothing
changes) or returns a Verdict; `apply` then runs the plan's phases in order
(tick.py, decode.py, speculation_decode.py) and returns TickEvents. Ops (contract §7)
go through `op` (ops.py). The executor never touches tensors: it drives the
runtime through its primitives and samples on the host with numpy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import time
from collections.abc import Callable

from superfluid.abi import ShedReason, Status, TickStatus
from superfluid.abi.plan_codec import PlanReject, check_plan, decode_plan, plan_seq_of
from superfluid.abi.records import OpCompletion, ShedReport, TickEvents, TickMemCounters, TickPlan, TickTimings
from superfluid.engine.fault_runtime import FaultRuntime
from superfluid.engine.runtime import FatalError, MemCounters, Runtime, RuntimeFailure, Unsupported
from superfluid.executor.cache import CacheEntry, PrefixCache
from superfluid.executor.check import Verdict, check, empty_events_fit
from superfluid.executor.faults import KINDS as FAULT_KINDS, FaultSchedule
from superfluid.executor.lanes import Lanes
from superfluid.executor.op_fields import OpMessage
from superfluid.executor.seeds import DEFAULT_MAX_LEASES, LeaseTable
from superfluid.executor.state import Counters, Pending, Registry
from superfluid.executor.state_dir import StateDir
from superfluid.executor.tick import Tick
from superfluid.executor.tick_rings import LocalRings, TickRings

EXIT_FATAL = 70
_OK, _TICK_OK = int(Status.OK), int(TickStatus.OK)
_NO_SHED = ShedReport(0, 0, 0, ())
_tn = tuple.__new__
_MEM_FIELDS = ("allocated_bytes", "host_retained_bytes", "pool_blocks_total", "pool_blocks_used",
               "pool_bytes_evictable", "tentative_bytes")
assert TickMemCounters._fields == _MEM_FIELDS, TickMemCounters._fields
# Host memory for cache entries evicted from the pool, where the runtime can export them.
DEFAULT_HOST_CACHE_BYTES = 1 << 30
AUTO = "auto"  # cache_max_bytes: half the runtime's pool


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


class Executor:
    """One worker's executor state over a runtime.

    runtime: any superfluid.engine.Runtime. rings: where prompts are read
    and emits and logits rows written (LocalRings by default). epoch: the
    worker epoch (nonces carry it, so a commit for a dead worker's row never
    matches). fatal_exit: exit the process with status 70 on a fatal runtime
    error (a worker), else answer Fatal and refuse further ticks (in-process).
    cache_max_bytes: what resident cache entries may hold (None: no limit;
    "auto": half the pool). host_cache_bytes: host memory for entries
    evicted from the pool (0: none). max_leases: seed leases at once.
    state_dir: the folder op paths (EXPORT_ENTRY, IMPORT_STATE) may name
    (state_dir.py), holding at most state_dir_bytes (None: no limit);
    state_dir None: ops take no paths.
    """

    def __init__(self, runtime: Runtime, rings: TickRings | None = None, *, epoch: int = 0,
                 fault_injection: bool = False, fatal_exit: bool = False,
                 cache_max_bytes: int | str | None = AUTO, host_cache_bytes: int = DEFAULT_HOST_CACHE_BYTES,
                 max_leases: int = DEFAULT_MAX_LEASES, clock: Callable[[], int] = time.perf_counter_ns,
                 state_dir: str | os.PathLike[str] | None = None, state_dir_bytes: int | None = None):
        # With fault injection the runtime fails on cue (faults.py, engine/fault_runtime.py).
        self.fault_rt = FaultRuntime(runtime, self._fault_fired) if fault_injection else None
        self.runtime = runtime = self.fault_rt or runtime
        self.faults: FaultSchedule | None = None  # the installed fault schedule (INSTALL_FAULTS)
        self.faults_injected = dict.fromkeys(FAULT_KINDS, 0)
        self.fault_sink: Callable[[str], None] | None = None  # told of each injected fault (the worker's metrics)
        self.desc = runtime.desc
        self.rings = rings or LocalRings()
        self.epoch = epoch
        self.fault_injection = fault_injection
        self.fatal_exit = fatal_exit
        self.clock = clock
        self.lanes = Lanes()
        if cache_max_bytes == AUTO:
            mem = runtime.mem_counters()
            cache_max_bytes = mem.cells_total * runtime.cell_bytes() // 2 if mem.cells_total else None
        assert not isinstance(cache_max_bytes, str), f"cache_max_bytes: bytes, None or {AUTO!r}"
        self.cache = PrefixCache(self.page, cache_max_bytes, host_cache_bytes)
        self.leases = LeaseTable(self.cache, max_leases)
        self.registry = Registry(runtime)
        self.counters = Counters()
        self.pending = Pending()
        self.state_dir = StateDir(state_dir, state_dir_bytes) if state_dir is not None else None
        self.dead: str | None = None  # why the executor refuses ticks after a fatal error
        self.partial_sink: Callable[[int, int, int, int], None] | None = None
        # Called once a tick's model steps are done, before its events are built
        # (a worker wakes its planner and parks the runtime's threads there).
        self.steps_done: Callable[[], None] | None = None
        self.event_capacity: int | None = None  # bytes an events message may take (the event slot)

    # ------------------------------------------------------------ helpers

    @property
    def page(self) -> int:
        return max(1, self.desc.page)

    @property
    def exact_only(self) -> bool:
        return self.desc.exact_only

    def pages(self, cells: int) -> int:
        return -(-cells // self.page)

    def fresh_nonce(self) -> int:
        c = self.counters
        c.nonce += 1
        return ((self.epoch & 0xFFFFF) << 44) | c.nonce

    def entry_bytes(self, cells: int) -> int:
        return cells * self.runtime.cell_bytes()

    def _fault_fired(self, kind: str) -> None:
        self.faults_injected[kind] += 1
        if self.fault_sink is not None:
            self.fault_sink(kind)

    def install_faults(self, schedule: FaultSchedule | None) -> int:
        """Replace the fault schedule (None: clear it): what the old one armed,
        pending INJECT_FAULTs included, goes with it; the rules dropped."""
        if self.fault_rt is None:
            raise ValueError("a fault schedule needs fault injection (--fault-injection)")
        dropped = len(self.faults) if self.faults is not None else 0
        self.faults = schedule
        self.fault_rt.clear()
        self.lanes.injected.clear()
        return dropped

    def fatal(self, during: str, err: Exception) -> ExecutorFatal:
        msg = (f"superfluid: the {self.desc.runtime_id} runtime failed in {during} ({err}); "
               f"this worker exits so that the daemon starts a clean one")
        if self.fatal_exit:
            print(msg, file=sys.stderr, flush=True)
            os._exit(EXIT_FATAL)
        self.dead = msg
        return ExecutorFatal(msg)

    def live_sequences(self) -> int:
        return len(self.lanes) + len(self.cache)

    def sweep_leases(self) -> None:
        """contract §3 step 3 (also run by ops, so a table full of dead leases frees up)."""
        self.leases.sweep(self.counters.tick_count)

    def to_host(self, e: CacheEntry) -> bool:
        """Move a resident entry's state to the host tier (the caller frees
        its sequence); False where it cannot go (no room, no export)."""
        cap = self.cache.host_max_bytes
        if cap <= 0 or e.bare:
            return False
        try:
            blob = self.runtime.seq_export(e.resident_seq())
        except FatalError as err:
            raise self.fatal("exporting a cache entry", err) from err
        except (Unsupported, RuntimeFailure):
            return False
        if len(blob) > cap:
            return False
        over = self.cache.host_bytes + len(blob) - cap
        if over > 0:
            olds = self.cache.lru(resident=False)
            drop: list[CacheEntry] = []
            freed = 0
            for old in olds:
                if freed >= over:
                    break
                drop.append(old)
                freed += len(old.exported_blob())
            if freed < over:
                return False
            for old in drop:
                self.cache.remove(old)
        self.cache.set_exported(e, blob)
        return True

    # ------------------------------------------------------------ the tick

    def tick(self, plan: TickPlan | bytes | bytearray | memoryview, *, decoded: bool = False) -> TickResult:
        """Check, then apply, one plan (a TickPlan record or a slot message).
        `decoded`: the record came from decode_plan, whose record-level checks
        it has passed already."""
        t0 = self.clock()
        seq = plan.plan_seq if isinstance(plan, TickPlan) else plan_seq_of(plan)
        if self.dead:
            return self._refused(seq, Status.Fatal, "executor", self.dead)
        try:
            if isinstance(plan, TickPlan):
                if not decoded:
                    check_plan(plan)  # the record-level checks decode_plan runs on bytes
                record = plan
            else:
                record = decode_plan(plan)
            if not (record.admits or record.prefills or record.decodes or record.commits or record.retires):
                events = self._tick_empty(record, t0)
                if events is not None:
                    return TickResult(Status.OK, events)
            verdict = self.check(record)
        except PlanReject as r:
            return self.reject(seq, r)
        try:
            events = self.apply(verdict, t0)
        except ExecutorFatal as e:
            return self._refused(record.plan_seq, Status.Fatal, "runtime", str(e))
        return TickResult(Status.OK, events)

    def check(self, plan: TickPlan) -> Verdict:
        """Every check of contract §3, in order. Raises PlanReject; changes nothing."""
        return check(self, plan)

    def apply(self, v: Verdict, t0: int) -> TickEvents:
        plan = v.plan
        self.counters.last_plan_seq = plan.plan_seq
        self.counters.tick_count += 1
        fr = self.fault_rt
        if fr is not None:
            fr.phase = None
            if self.faults is not None:
                self.faults.on_tick(self, plan, fr)
        t = Tick(self, v)
        # A phase whose list is empty has nothing to do: it is not entered.
        for e in v.evict:
            t.evict(e, ShedReason.MEMORY)
        if plan.retires:
            t.retires()
        t.settle_cache()
        if plan.commits:
            t.commits()
        if plan.admits:
            t.takeovers()
            t.admits()
            self.counters.seeded_tokens += sum(u.n for u in v.seeds.values())
            if fr is not None and self.faults is not None and self.faults.tokens:
                for a in plan.admits:  # a nan rule for a first token: the prefill's last row
                    if (lane := self.lanes.get(a.lane_tag)) is not None:
                        self.faults.arm_nan(self, lane, fr)
        clock = self.clock
        t_prefill = clock()
        if plan.prefills:
            if fr is not None:
                fr.phase = "prefill"
            t.prefill()
        t_decode = clock()
        prefill_ns = t_decode - t_prefill
        if plan.decodes:
            if fr is not None:
                fr.phase = "decode"
            t.decode()
        if fr is not None:
            fr.phase = None
        t_end = clock()
        if self.steps_done is not None:
            self.steps_done()
        return t.events(TickTimings(t_end - t0, prefill_ns, t_end - t_decode, 0, 0))

    def tick_empty(self, plan_seq: int, max_decode_lanes: int) -> TickMemCounters | None:
        """Run a plan with no lists (a planner keeping time, waiting on host
        rows, or carrying ops): the rules and upkeep it meets, without a
        Verdict or a Tick, to the state check and apply would leave; the
        events' memory record. None, having changed nothing, where the plan
        would meet more (a rule it breaks, evictions to report, a cache over
        its limit, more sequences than slots): the general path takes it."""
        last, limit = self.counters.last_plan_seq, self.cache.max_bytes
        ticking = self.faults is not None and self.faults.ticking  # the general path runs the tick's rules
        if (self.dead or ticking or (last is not None and plan_seq <= last) or max_decode_lanes > self.desc.max_batch
                or self.pending.shed or (limit is not None and self.cache.resident_bytes > limit)
                or not empty_events_fit(self)):
            return None
        mem = self.runtime.mem_counters()
        if self.desc.max_seqs and mem.seqs > self.desc.max_seqs:
            return None
        if self.leases.leases:  # (none: nothing to sweep, and a call saved on every empty plan)
            self.sweep_leases()
        self.counters.last_plan_seq = plan_seq
        self.counters.tick_count += 1
        return self._mem_record(mem)

    def _tick_empty(self, plan: TickPlan, t0: int) -> TickEvents | None:
        mem = self.tick_empty(plan.plan_seq, plan.max_decode_lanes)
        if mem is None:
            return None
        comps = self.pending.completions
        if comps:
            self.pending.completions = []
        return TickEvents(0, plan.plan_seq, _OK, _TICK_OK, (), (), (), _NO_SHED, tuple(comps), (), b"",
                          TickTimings(self.clock() - t0, 0, 0, 0, 0), mem, self.epoch)

    def reject(self, plan_seq: int, r: PlanReject) -> TickResult:
        """A plan refused by a check (counted as a reject), also one the worker
        could not decode before calling tick."""
        self.counters.rejects += 1
        return self._refused(plan_seq, r.status, r.field, r.message)

    def begin_session(self, session: int) -> None:
        """A new planner session is served: lanes admitted now record it, and
        its plan_seq starts afresh (no session waits on another's)."""
        self.lanes.session = session
        self.counters.last_plan_seq = None

    def _refused(self, plan_seq: int, status: Status, field: str, message: str) -> TickResult:
        detail = f"{field}: {message}"
        ev = TickEvents(plan_seq=plan_seq, status=int(status), message=detail.encode(), worker_epoch=self.epoch,
                        op_completions=tuple(self.pending.take_completions()), mem=self._mem_record())
        return TickResult(status, ev, detail)

    # ---------------------------------------------------------------- ops

    def op(self, msg: OpMessage | bytes, *, queue: bool = False) -> OpCompletion:
        """Run one op now; its OpCompletion. queue=True also holds the
        completion for the next tick's events (the worker's way)."""
        from superfluid.executor.ops import run_op

        done = run_op(self, msg)
        if queue:
            self.pending.completions.append(done)
        return done

    # ------------------------------------------------------------- state

    def _mem_record(self, mem: MemCounters | None = None) -> TickMemCounters:
        if mem is None:
            mem = self.runtime.mem_counters()
        cache = self.cache
        page = cache.page  # (the executor's page: max(1, desc.page))
        # Every tick, so straight from C (_MEM_FIELDS pins the order): allocated, host
        # retained, pool blocks total and used, evictable (unpinned resident) bytes, tentative.
        return _tn(TickMemCounters, (mem.allocated_bytes, cache.host_bytes, mem.cells_total // page,
                                     mem.cells_used // page, cache.unpinned_bytes, 0))

    def state_digest(self) -> str:
        """A hash of everything a tick can change (lanes, cache, leases,
        counters, the runtime's sequences): equal before and after a
        rejected plan."""
        h = hashlib.sha256()

        def put(*xs: object) -> None:
            h.update(repr(xs).encode())

        lanes, c, reg = self.lanes, self.counters, self.registry
        faulted = [(t, getattr(lanes.faulted.lanes.get(t), "session", None)) for t in sorted(lanes.faulted)]
        put(c.last_plan_seq, c.tick_count, c.nonce, faulted, sorted(lanes.injected.items()),
            sorted(reg.biases), reg.next_handle, len(self.pending.shed), c.seeded_tokens,
            [(h, reg.grammars.borrower(h)) for h in reg.grammars.handles()],
            [st.describe() for st in reg.strategies], reg.strategies.next_cert, reg.spec_gate.snapshot())
        for tag in sorted(self.lanes):
            ln = self.lanes[tag]
            put(tag, ln.seq, ln.sampling, tuple(ln.params), ln.rng_base, ln.rng_counter, ln.prompt, ln.prefill_end,
                ln.prefilled, ln.committed, ln.pending_input, ln.pending_row, ln.finished, ln.logprobs_top,
                ln.granted_class, ln.session, self.runtime.seq_len(ln.seq), ln.grammar_handle,
                None if ln.grammar is None else ln.grammar.tokens,
                None if ln.spec is None else (ln.spec.strategy.cert_id, ln.spec.depth, ln.spec.misses, ln.spec.pause))
        for e in sorted(self.cache.all(), key=lambda e: e.eid):
            put(e.eid, e.seq, e.tokens, e.prompt_len, e.bytes, e.last_used, e.pins, e.seeded, e.checkpoint, e.bare,
                None if e.blob is None else hashlib.sha256(e.blob).hexdigest(),
                None if e.seq is None else self.runtime.seq_len(e.seq))
        for ls in sorted(self.leases, key=lambda ls: ls.handle):
            put(ls.handle, ls.entry.eid, ls.prefix, ls.determinism, ls.expires, ls.adopt)
        put(self.runtime.mem_counters())
        return h.hexdigest()
