"""Fault schedules: rules that make a worker fail on cue (contract §7
INSTALL_FAULTS / LIST_FAULTS / CLEAR_FAULTS; `serve --fault-schedule FILE`
installs one at every start of a worker). docs/faults.md says it whole.

A rule is {when, what, times}. `when` is the worker's N-th accepted tick, a
lane about to take its K-th generated token, the N-th op of a kind, or a
draw of probability P each tick from the schedule's seed (the same seed and
plans: the same faults); it may be limited to a lane and to a worker epoch.
`what` is a lane fault, a fatal error or a capacity failure of the runtime
at its next prefill or decode step, a stall inside such a step, every step
slower for T ticks, or a NaN logits row. The runtime's part happens in
engine/fault_runtime.py; the lanes' part here and in the tick's phases.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from superfluid.abi import Fault, OpKind, OpStatus, lib
from superfluid.engine.fault_runtime import PHASES, Armed, FaultRuntime, InjectedFatal
from superfluid.executor.op_fields import OpError, echo

if TYPE_CHECKING:
    from superfluid.abi.records import TickPlan
    from superfluid.executor.executor import Executor
    from superfluid.executor.lanes import Lane

__all__ = ["INJECTED", "KINDS", "MAX_RULES", "FaultSchedule", "Rule", "parse_schedule"]

INJECTED = int(lib.SF_FAULT_DETAIL_INJECTED)  # LaneFault.detail's mark of an injected fault

KINDS = ("lane_fault", "fatal", "capacity", "stall", "slow", "nan")  # the faults_injected metric's labels
MAX_RULES = 256
_WHEN = ("tick", "token", "op", "chance")
_WHAT = {"fault": "lane_fault", "fatal": "fatal", "capacity": "capacity", "stall_ms": "stall", "slow_ms": "slow",
         "nan": "nan"}
_MAX_MS = 600_000
_U64 = (1 << 64) - 1


def _bad(where: str, message: str) -> OpError:
    return OpError(OpStatus.BadRequest, f"field {where!r}: {message}")


def _int(v: object, where: str, lo: int, hi: int = _U64) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise _bad(where, f"{echo(v)} is not an integer in {lo}..{hi}")
    return v


@dataclasses.dataclass
class Rule:
    spec: dict[str, object]  # as given (LIST_FAULTS shows it)
    trigger: str  # _WHEN
    n: int = 0  # tick N, token K, op nth
    op: int = 0  # the OpKind an op rule counts
    p: float = 0.0
    lane: int | None = None
    epoch: int | None = None
    kind: str = "lane_fault"  # KINDS
    code: int = int(Fault.INJECTED)
    phase: str = "now"  # "prefill" | "decode" | "now" (at the trigger itself)
    ms: int = 0
    ticks: int = 0
    times: int | None = 1  # None: unlimited
    fired: int = 0
    seen: int = 0  # op rules: ops of the kind counted since the install

    @property
    def live(self) -> bool:
        return self.times is None or self.fired < self.times


def _member(enum: type[OpKind] | type[Fault], v: object, where: str, what: str) -> int:
    """An enum member given by name (any case) or value."""
    try:
        if isinstance(v, str):
            return int(enum[v.upper()])
        if isinstance(v, int) and not isinstance(v, bool):
            return int(enum(v))
    except (KeyError, ValueError):
        pass
    raise _bad(where, f"{echo(v)} is not {what}")


def _one_of(m: object, names: Sequence[str], where: str) -> tuple[dict[str, object], str]:
    """The map and the one key of `names` it holds."""
    if not isinstance(m, dict):
        raise _bad(where, f"expected a map, got {type(m).__name__}")
    keys = [k for k in names if k in m]
    if len(keys) != 1:
        raise _bad(where, f"name exactly one of {', '.join(names)}")
    return m, keys[0]


def _when(rule: Rule, when: object, where: str) -> None:
    when, t = _one_of(when, _WHEN, where)
    rule.trigger = t
    v = when[t]
    if t in ("tick", "token"):
        rule.n = _int(v, f"{where}.{t}", 1)
    elif t == "op":
        rule.op = _member(OpKind, v, f"{where}.op", "an op")
        rule.n = _int(when.get("nth", 1), f"{where}.nth", 1)
    else:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 1:
            raise _bad(f"{where}.chance", f"{echo(v)} is not a probability in (0, 1]")
        rule.p = float(v)
        rule.times = None
    if "lane" in when:
        if t == "op":
            raise _bad(f"{where}.lane", "an op rule has no lane")
        rule.lane = _int(when["lane"], f"{where}.lane", 0)
    if "epoch" in when:
        rule.epoch = _int(when["epoch"], f"{where}.epoch", 0)


def _phase(rule: Rule, v: object, where: str) -> str:
    """A step's phase: prefill | decode for tick and chance rules; a token
    rule's is decode (or now); an op rule's is now (the op itself)."""
    allowed = {"tick": PHASES, "chance": PHASES, "token": ("decode", "now"), "op": ("now",)}[rule.trigger]
    if v not in allowed:
        raise _bad(where, f"{echo(v)}: a {rule.trigger} rule takes {' or '.join(allowed)}")
    assert isinstance(v, str)
    return "now" if rule.trigger == "token" else v


def _what(rule: Rule, what: object, where: str) -> None:
    what, key = _one_of(what, tuple(_WHAT), where)
    rule.kind, v = _WHAT[key], what[key]
    here = f"{where}.{key}"
    if rule.trigger == "op" and rule.kind not in ("fatal", "stall"):
        raise _bad(here, "an op rule takes fatal or stall_ms")
    if rule.kind == "lane_fault":
        rule.code = _member(Fault, v, here, "a fault code")
    elif rule.kind in ("fatal", "capacity"):
        rule.phase = _phase(rule, v, here)
    elif rule.kind == "stall":
        rule.ms = _int(v, here, 1, _MAX_MS)
        rule.phase = _phase(rule, what.get("during", "now" if rule.trigger in ("op", "token") else None),
                            f"{where}.during")
    elif rule.kind == "slow":
        rule.ms = _int(v, here, 1, _MAX_MS)
        rule.ticks = _int(what.get("ticks"), f"{where}.ticks", 1, 1 << 32)
    elif v is not True:
        raise _bad(here, f"{echo(v)}: expected true")


def parse_schedule(rules: object, seed: object = 0) -> FaultSchedule:
    """The schedule of INSTALL_FAULTS' fields; OpError (BadRequest) naming the field."""
    s = _int(seed, "seed", 0)
    if not isinstance(rules, list):
        raise _bad("rules", f"expected a list, got {type(rules).__name__}")
    if len(rules) > MAX_RULES:
        raise _bad("rules", f"{len(rules)} rules: at most {MAX_RULES}")
    out = []
    for i, r in enumerate(rules):
        where = f"rules[{i}]"
        if not isinstance(r, dict):
            raise _bad(where, f"expected a map, got {type(r).__name__}")
        rule = Rule(spec=dict(r), trigger="")
        _when(rule, r.get("when"), f"{where}.when")
        _what(rule, r.get("what"), f"{where}.what")
        if "times" in r:
            if rule.trigger == "tick":
                raise _bad(f"{where}.times", "a tick rule fires once, at its tick")
            rule.times = _int(r["times"], f"{where}.times", 1, 1 << 32)
        out.append(rule)
    return FaultSchedule(out, s)


def _generated(lane: Lane) -> int:
    """Tokens the lane generated in this worker (its prompt, re-admitted tokens included, is not)."""
    return max(0, len(lane.committed) - len(lane.prompt))


class FaultSchedule:
    """The installed rules and where they stand; `rt` the worker's FaultRuntime."""

    def __init__(self, rules: list[Rule], seed: int):
        self.rules, self.seed = rules, seed
        self.ticking = any(r.trigger in ("tick", "chance") for r in rules)
        self.tokens = [r for r in rules if r.trigger == "token"]
        self.ops = [r for r in rules if r.trigger == "op"]
        self._nan: dict[int, Rule] = {}  # sequence -> the rule that armed its next row NaN

    def __len__(self) -> int:
        return len(self.rules)

    def listing(self) -> dict[str, object]:
        return {"seed": self.seed, "rules": [
            {**{k: v for k, v in r.spec.items() if k in ("when", "what")},
             **({} if r.times is None else {"times": r.times}), "fired": r.fired} for r in self.rules]}

    def _draw(self, index: int, tick: int) -> float:
        """Uniform in [0, 1) from the seed, the rule and the tick: replayable."""
        h = hashlib.blake2b(f"{self.seed}:{index}:{tick}".encode(), digest_size=8).digest()
        return int.from_bytes(h, "little") / 2.0**64

    def _applies(self, r: Rule, epoch: int) -> bool:
        return r.live and (r.epoch is None or r.epoch == epoch)

    # ----------------------------------------------------------- triggers

    def on_tick(self, ex: Executor, plan: TickPlan, rt: FaultRuntime) -> None:
        """An accepted tick begins (its number is counted): tick and chance
        rules. A rule counts as fired when it had something to act on."""
        tick = ex.counters.tick_count
        rt.tick = tick
        for i, r in enumerate(self.rules):
            if r.trigger not in ("tick", "chance") or not self._applies(r, ex.epoch):
                continue
            if r.trigger == "tick" and r.n != tick:
                continue
            if r.trigger == "chance" and self._draw(i, tick) >= r.p:
                continue
            lanes = [r.lane] if r.lane is not None else [d.lane_tag for d in plan.decodes]
            if self._fire(r, ex, rt, [t for t in lanes if t in ex.lanes], f"rule {i}, tick {tick}"):
                r.fired += 1
        if self.tokens:
            for d in plan.decodes:
                lane = ex.lanes.get(d.lane_tag)
                if lane is not None and lane.pending_row is None:  # a HOST lane's commit arms it (Tick.commits)
                    self.arm_nan(ex, lane, rt)

    def _fire(self, r: Rule, ex: Executor, rt: FaultRuntime, lanes: list[int], why: str) -> bool:
        """What the rule does this tick; False when it had nothing to act on."""
        if r.kind == "lane_fault":
            for tag in lanes:
                ex.lanes.injected[tag] = r.code
            return bool(lanes)
        if r.kind == "nan":
            armed = [self._arm(r, ex.lanes[tag].seq, rt) for tag in lanes]
            return any(armed)
        if r.kind == "slow":
            rt.fired("slow")
            rt.slow_ms, rt.slow_until = r.ms, rt.tick + r.ticks - 1
            return True
        return rt.arm(r.phase, Armed(r.kind, r.ms, why))

    def _arm(self, r: Rule, seq: int, rt: FaultRuntime) -> bool:
        """A NaN for this sequence's next row, on the rule's account: it counts
        as fired when the row is poisoned (poisoned()), not before."""
        if seq in rt.nan_seqs:
            return False
        self._nan = {s: rr for s, rr in self._nan.items() if s in rt.nan_seqs}  # armed rows not yet taken
        if r.times is not None and r.fired + sum(rr is r for rr in self._nan.values()) >= r.times:
            return False
        self._nan[seq] = r
        rt.nan_seqs.add(seq)
        rt.poison_sink = self.poisoned
        return True

    def poisoned(self, seq: int) -> None:
        """A row of `seq` was made NaN: the rule that armed it fired."""
        r = self._nan.pop(seq, None)
        if r is not None:
            r.fired += 1

    def watches(self, tag: int) -> bool:
        """Whether a token rule may fire for this lane (it then decodes without drafts)."""
        return any(r.live and (r.lane is None or r.lane == tag) for r in self.tokens)

    def arm_nan(self, ex: Executor, lane: Lane, rt: FaultRuntime) -> None:
        """A nan token rule for the lane's next token: its next row is NaN."""
        k = _generated(lane) + 1
        for r in self.tokens:
            if (r.kind == "nan" and r.n == k and (r.lane is None or r.lane == lane.tag)
                    and self._applies(r, ex.epoch) and self._arm(r, lane.seq, rt)):
                return

    def on_token(self, ex: Executor, lane: Lane, rt: FaultRuntime) -> int | None:
        """The lane is about to take its K-th generated token: what a token
        rule does now. A fault code (injected) for the lane to fault with, or
        None to go on; a fatal rule raises."""
        k = _generated(lane) + 1
        code = None
        for r in self.tokens:
            if (r.kind == "nan" or r.n != k or (r.lane is not None and r.lane != lane.tag)
                    or not self._applies(r, ex.epoch)):
                continue
            r.fired += 1
            why = f"token rule, lane {lane.tag}'s token {k}"
            if r.kind == "fatal":
                rt.fired("fatal")
                raise InjectedFatal(f"injected fatal error at {why}")
            if r.kind == "stall":
                rt.fired("stall")
                rt.sleep(r.ms / 1e3)
            elif r.kind == "slow":
                rt.fired("slow")
                rt.slow_ms, rt.slow_until = r.ms, rt.tick + r.ticks - 1
            elif code is None:
                rt.fired(r.kind)
                code = r.code if r.kind == "lane_fault" else int(Fault.OOM_TENTATIVE)
        return code

    def on_op(self, kind: int, ex: Executor, rt: FaultRuntime) -> None:
        """An op of this kind is about to run: op rules whose count it reaches."""
        for r in self.ops:
            if r.op != kind or not self._applies(r, ex.epoch):
                continue
            r.seen += 1
            if r.seen < r.n:  # then the next `times` ops of the kind
                continue
            r.fired += 1
            rt.fired(r.kind)
            if r.kind == "fatal":
                raise InjectedFatal(f"injected fatal error at {OpKind(kind).name} number {r.n}")
            rt.sleep(r.ms / 1e3)
