"""Checking a plan (contract §3): every rule, in the contract's order, against the
executor's state. A rule that fails raises PlanReject with its status, the
field and why; nothing here changes state but the sweep of expired leases
(step 3), which the next accepted tick would make anyway. What the check
learned travels to apply() in a Verdict.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from superfluid.abi import Determinism, PlanFlag, RingId, Sampling, Status, codec, ffi
from superfluid.abi.plan_codec import PlanReject
from superfluid.abi.records import LaneAdmit, TickPlan
from superfluid.executor.cache import CacheEntry
from superfluid.executor.memory import check_memory
from superfluid.executor.seeds import SeedUse, is_bare
from superfluid.rings.errors import RefError

if TYPE_CHECKING:
    import numpy as np

    from superfluid.executor.executor import Executor
    from superfluid.executor.grammar import Matcher

_SIZE: dict[str, int] = {n: ffi.sizeof(n) for n in ("TickEvents", "AdmitResult", "LaneEmit", "LaneFault", "ShedEntry",
                                     "LaneLogprob")}
# Plain ints: `int & IntFlag` builds a flag object (microseconds a tick).
_DRAIN = int(PlanFlag.DRAIN)
_EVENTS_BASE = codec.MSG_HEADER_BYTES + _SIZE["TickEvents"] + 512  # + the reject message, alignment
_ADMIT_RESULT, _EMIT, _FAULT, _SHED, _LOGPROB = (_SIZE[n] for n in ("AdmitResult", "LaneEmit", "LaneFault",
                                                                     "ShedEntry", "LaneLogprob"))


@dataclasses.dataclass(slots=True)
class Verdict:
    """What check() learned, for apply(): nothing here has happened yet."""

    plan: TickPlan
    prompts: dict[int, list[int]]
    seeds: dict[int, SeedUse]  # seeded admits by lane tag, each with the path it takes
    evict: list[CacheEntry]  # entries that leave the pool to make room
    unpublish: set[int]  # publishing retires that free instead, to make room
    cells_after: dict[int, int]  # each prefilled or decoded lane's cells at the end, at most
    cursors: dict[int, Matcher]  # grammar admits by lane tag: the matcher that replayed grammar_replay


def reject(status: Status, field: str, message: str) -> PlanReject:
    return PlanReject(status, field, message)


def check(ex: Executor, plan: TickPlan) -> Verdict:
    """Every check of contract §3, in order. Raises PlanReject."""
    desc = ex.desc
    if ex.counters.last_plan_seq is not None and plan.plan_seq <= ex.counters.last_plan_seq:
        raise reject(Status.RejectIllegalCombination, "TickPlan.plan_seq",
                     f"{plan.plan_seq} is not above the last accepted {ex.counters.last_plan_seq}")
    if plan.max_decode_lanes > desc.max_batch:
        raise reject(Status.RejectBudget, "TickPlan.max_decode_lanes",
                     f"{plan.max_decode_lanes} > max_batch {desc.max_batch}")
    if len(plan.decodes) > plan.max_decode_lanes:
        raise reject(Status.RejectBudget, "TickPlan.decodes",
                     f"{len(plan.decodes)} decodes > max_decode_lanes {plan.max_decode_lanes}")
    if plan.flags & _DRAIN and plan.admits:
        raise reject(Status.RejectIllegalCombination, "TickPlan.admits", "admits in a DRAIN plan")
    ex.sweep_leases()
    # Each step runs where its list has something to check (an empty list passes every rule).
    cursors: dict[int, Matcher] = {}
    prompts, seeds = _admits(ex, plan, cursors) if plan.admits else ({}, {})
    if plan.commits:
        _commits(ex, plan)
    reached = _prefills(ex, plan, prompts, seeds) if plan.prefills else {}
    rounds = _decodes(ex, plan, prompts, seeds, reached) if plan.decodes else {}
    if plan.retires:
        _retires(ex, plan)
    evict, unpublish, cells_after = check_memory(ex, plan, reached, rounds, seeds)
    _events_fit(ex, plan)
    return Verdict(plan, prompts, seeds, evict, unpublish, cells_after, cursors)


def admit_of(plan: TickPlan, tag: int) -> LaneAdmit:
    """The plan's admit of a lane the caller knows it admits."""
    for a in plan.admits:
        if a.lane_tag == tag:
            return a
    raise AssertionError(f"the plan admits no lane {tag}")


def _admits(ex: Executor, plan: TickPlan,
            cursors: dict[int, Matcher]) -> tuple[dict[int, list[int]], dict[int, SeedUse]]:
    desc = ex.desc
    prompts: dict[int, list[int]] = {}
    seeds: dict[int, SeedUse] = {}
    seen: dict[int, int] = {}  # seed handle -> the admit that uses it
    grammars: dict[int, int] = {}  # grammar handle -> the admit that uses it
    for i, a in enumerate(plan.admits):
        f = f"admits[{i}]"
        if a.lane_tag in ex.lanes:
            raise reject(Status.RejectIllegalCombination, f"{f}.lane_tag", f"lane {a.lane_tag} is live")
        if a.prompt.ring_id != RingId.PROMPT:
            raise reject(Status.RejectBounds, f"{f}.prompt.ring_id",
                         f"{a.prompt.ring_id} is not the prompt ring ({int(RingId.PROMPT)})")
        try:
            prompt = ex.rings.read_prompt(a.prompt)
        except RefError as e:
            raise reject(e.status, f"{f}.prompt", str(e)) from None
        if prompt.size == 0:
            raise reject(Status.RejectBounds, f"{f}.prompt", "an empty prompt")
        if int(prompt.max()) >= desc.vocab_size:
            raise reject(Status.RejectBounds, f"{f}.prompt",
                         f"token {int(prompt.max())} is outside the vocabulary of {desc.vocab_size}")
        if a.decode_replay >= prompt.size:
            raise reject(Status.RejectBounds, f"{f}.decode_replay",
                         f"{a.decode_replay} >= the prompt's {prompt.size} tokens")
        if a.strategy_slot and a.strategy_slot not in ex.registry.strategies:
            raise reject(Status.RejectIllegalCombination, f"{f}.strategy_slot",
                         f"no strategy is installed in slot {a.strategy_slot}")
        if a.grammar_handle:
            cursors[a.lane_tag] = _grammar(ex, plan, a, prompt, grammars, i, f)
        elif a.grammar_replay:
            raise reject(Status.RejectIllegalCombination, f"{f}.grammar_replay", "grammar_replay without a grammar")
        if a.logit_bias_handle and a.logit_bias_handle not in ex.registry.biases:
            raise reject(Status.RejectIllegalCombination, f"{f}.logit_bias_handle",
                         f"logit bias {a.logit_bias_handle} is not registered")
        tokens = prompt.tolist()
        if a.seed_handle:
            if a.seed_handle in seen:
                raise reject(Status.RejectStaleSeed, f"{f}.seed_handle",
                             f"seed lease {a.seed_handle} is used by admits[{seen[a.seed_handle]}] already")
            seen[a.seed_handle] = i
            seeds[a.lane_tag] = _seed_use(ex, a, tokens, f)
        if prompt.size > desc.max_seq_len:
            raise reject(Status.RejectBudget, f"{f}.prompt", f"{prompt.size} tokens > max_seq_len {desc.max_seq_len}")
        prompts[a.lane_tag] = tokens
    return prompts, seeds


def _grammar(ex: Executor, plan: TickPlan, a: LaneAdmit, prompt: np.ndarray, seen: dict[int, int], i: int,
             f: str) -> Matcher:
    """Step 4's grammar rules, in order; the cursor that replayed the prompt's tail."""
    h = a.grammar_handle
    reg = ex.registry.grammars
    if h not in reg:
        raise reject(Status.RejectIllegalCombination, f"{f}.grammar_handle", f"grammar {h} is not registered")
    if h in seen:
        raise reject(Status.RejectIllegalCombination, f"{f}.grammar_handle",
                     f"grammar {h} is used by admits[{seen[h]}] already")
    seen[h] = i
    if a.sampling == Sampling.HOST:
        raise reject(Status.RejectIllegalCombination, f"{f}.grammar_handle",
                     "a grammar constrains the engine's sampling: not with HOST")
    borrower = reg.borrower(h)
    if borrower is not None and borrower not in retiring_live(ex, plan):
        raise reject(Status.RejectIllegalCombination, f"{f}.grammar_handle",
                     f"grammar {h} is borrowed by lane {borrower} (one lane at a time)")
    if a.grammar_replay > prompt.size:
        raise reject(Status.RejectIllegalCombination, f"{f}.grammar_replay",
                     f"{a.grammar_replay} > the prompt's {prompt.size} tokens")
    tail = prompt[prompt.size - a.grammar_replay:].tolist() if a.grammar_replay else []
    cursor = reg.cursor(h, tail)
    if cursor is None:
        raise reject(Status.RejectIllegalCombination, f"{f}.grammar_replay",
                     f"grammar {h} refuses the last {a.grammar_replay} prompt tokens")
    return cursor


def _seed_use(ex: Executor, a: LaneAdmit, prompt: list[int], f: str) -> SeedUse:
    """The StaleSeed rules of step 4, in order; the use the lease makes."""
    h = a.seed_handle
    lease = ex.leases.get(h)
    if lease is None:
        if h in ex.leases.expired:
            raise reject(Status.RejectStaleSeed, f"{f}.seed_handle",
                         f"seed lease {h} expired after accepted tick {ex.leases.expired[h]}")
        raise reject(Status.RejectStaleSeed, f"{f}.seed_handle", f"no seed lease {h}")
    if lease.determinism != a.determinism_class:
        raise reject(Status.RejectStaleSeed, f"{f}.determinism_class",
                     f"seed lease {h} is for class {_class_name(lease.determinism)}, "
                     f"the admit asks {_class_name(a.determinism_class)}")
    n = len(lease.prefix)
    if n > len(prompt) or tuple(prompt[:n]) != lease.prefix:
        raise reject(Status.RejectStaleSeed, f"{f}.seed_handle",
                     f"seed lease {h} covers {n} tokens that are not a prefix of the prompt")
    if lease.adopt and not is_bare(lease):
        raise reject(Status.RejectStaleSeed, f"{f}.seed_handle",
                     f"the sequence seed lease {h} imported is no longer bare (another lease or admit uses it)")
    full = n == len(prompt)
    # A first run feeds the last token prefill reaches, and every replayed one, by
    # decode; a cache entry holds them as prefill fed them: on exact_only, whose state
    # tells the two apart, a seed stops short of them (a paged runtime's cells do not).
    # (decode_replay < len(prompt) was checked: most >= 0.)
    most = len(prompt) - a.decode_replay - 1
    if ex.exact_only and n > most:
        what = "the whole prompt" if full else f"{n} tokens"
        raise reject(Status.RejectIllegalCombination, f"{f}.seed_handle",
                     f"seed lease {h} covers {what}; with decode_replay {a.decode_replay} an exact_only runtime "
                     f"feeds tokens {most + 1}.. by decode, which a seed's state did not (lease at most {most} "
                     f"tokens)")
    return SeedUse(lease, n, n - 1 if full else n)


def _class_name(c: int) -> str:
    try:
        return Determinism(c).name
    except ValueError:
        return str(c)


def _commits(ex: Executor, plan: TickPlan) -> None:
    retiring = {r.lane_tag for r in plan.retires}
    for i, c in enumerate(plan.commits):
        f = f"commits[{i}]"
        lane = ex.lanes.get(c.lane_tag)
        if lane is None:
            raise reject(Status.RejectUnknownLane, f"{f}.lane_tag", f"no live lane {c.lane_tag}")
        if lane.sampling != Sampling.HOST or lane.finished:
            raise reject(Status.RejectIllegalCombination, f"{f}.lane_tag",
                         f"lane {c.lane_tag} is {'finished' if lane.finished else 'not HOST-sampled'}")
        if lane.pending_row is None:
            raise reject(Status.RejectHostRules, f"{f}.lane_tag", f"lane {c.lane_tag} has no pending logits row")
        if c.logits_nonce != lane.pending_row.nonce:
            raise reject(Status.RejectStaleNonce, f"{f}.logits_nonce",
                         f"{c.logits_nonce:#x} is not the pending row's nonce")
        if c.token_id >= ex.desc.vocab_size:
            raise reject(Status.RejectBounds, f"{f}.token_id",
                         f"{c.token_id} is outside the vocabulary of {ex.desc.vocab_size}")
        if c.lane_tag in retiring:
            raise reject(Status.RejectIllegalCombination, f"{f}.lane_tag",
                         f"lane {c.lane_tag} is committed and retired in one plan")


def admitted_span(a: LaneAdmit, prompt: list[int], use: SeedUse | None) -> tuple[int, int]:
    """An admitted lane's (prefill_end, prefilled at admission)."""
    n = use.n if use else 0
    return max(len(prompt) - a.decode_replay, n), n


def _prefills(ex: Executor, plan: TickPlan, prompts: dict[int, list[int]], seeds: dict[int, SeedUse]) -> dict[int, int]:
    """Prompt tokens each prefilled lane will have taken after this tick."""
    reached: dict[int, int] = {}
    budget = plan.prefill_token_budget
    retiring = retiring_live(ex, plan)
    for i, p in enumerate(plan.prefills):
        f = f"prefills[{i}]"
        lane = ex.lanes.get(p.lane_tag)
        if lane is not None:
            end, done = lane.prefill_end, lane.prefilled
        elif p.lane_tag in prompts:
            end, done = admitted_span(admit_of(plan, p.lane_tag), prompts[p.lane_tag], seeds.get(p.lane_tag))
        else:
            raise reject(Status.RejectUnknownLane, f"{f}.lane_tag", f"no live or admitted lane {p.lane_tag}")
        if p.lane_tag in retiring:
            raise reject(Status.RejectIllegalCombination, f"{f}.lane_tag",
                         f"lane {p.lane_tag} is prefilled and retired in one plan")
        if p.token_offset != done:
            raise reject(Status.RejectIllegalCombination, f"{f}.token_offset",
                         f"{p.token_offset}, but lane {p.lane_tag} has {done} tokens prefilled")
        if p.token_offset + p.token_count > end:
            raise reject(Status.RejectBounds, f"{f}.token_count",
                         f"offset {p.token_offset} + {p.token_count} > the {end} tokens prefill feeds")
        take = min(p.token_count, budget)
        budget -= take
        reached[p.lane_tag] = done + take
    return reached


def _decodes(ex: Executor, plan: TickPlan, prompts: dict[int, list[int]], seeds: dict[int, SeedUse],
             reached: dict[int, int]) -> dict[int, int]:
    """Decode rounds each lane can run (capped by its room to max_seq_len)."""
    committing = {c.lane_tag for c in plan.commits}
    retiring = retiring_live(ex, plan)
    rounds: dict[int, int] = {}
    for i, d in enumerate(plan.decodes):
        f = f"decodes[{i}]"
        lane = ex.lanes.get(d.lane_tag)
        if lane is not None:
            host, pending_row, end = lane.sampling == Sampling.HOST, lane.pending_row is not None, lane.prefill_end
            after = reached.get(d.lane_tag, lane.prefilled)
            finished, committed = lane.finished, len(lane.committed) + (d.lane_tag in committing)
            pending = lane.pending_input is not None or d.lane_tag in committing
        elif d.lane_tag in prompts:
            a = admit_of(plan, d.lane_tag)
            use = seeds.get(d.lane_tag)
            host, pending_row = a.sampling == Sampling.HOST, False
            end, done = admitted_span(a, prompts[d.lane_tag], use)
            after, finished, committed = reached.get(d.lane_tag, done), False, end
            pending = use is not None and use.full
        else:
            raise reject(Status.RejectUnknownLane, f"{f}.lane_tag", f"no live or admitted lane {d.lane_tag}")
        if finished:
            raise reject(Status.RejectIllegalCombination, f"{f}.lane_tag", f"lane {d.lane_tag} has finished")
        if d.lane_tag in retiring:
            raise reject(Status.RejectIllegalCombination, f"{f}.lane_tag",
                         f"lane {d.lane_tag} is decoded and retired in one plan")
        if host:
            if d.max_new_tokens != 1:
                raise reject(Status.RejectHostRules, f"{f}.max_new_tokens",
                             f"{d.max_new_tokens}: a HOST lane decodes one token a tick")
            if pending_row and d.lane_tag not in committing:
                raise reject(Status.RejectHostRules, f"{f}.lane_tag",
                             f"lane {d.lane_tag} holds a logits row that this plan does not commit")
        if after != end:
            raise reject(Status.RejectIllegalCombination, f"{f}.lane_tag",
                         f"lane {d.lane_tag}'s prefill ends at {after} of {end} tokens this tick")
        # Each round feeds one cell; a lane at max_seq_len still feeds a pending token
        # once (its own, a commit's, a whole-prompt seed's, or one an exact_only
        # prefill held back this tick).
        room = max(0, ex.desc.max_seq_len - committed)
        pending = pending or (ex.exact_only and d.lane_tag in reached)
        rounds[d.lane_tag] = (max(int(pending), min(d.max_new_tokens, room))) if d.max_new_tokens else 0
    return rounds


def retiring_live(ex: Executor, plan: TickPlan) -> set[int]:
    # A retired faulted tag may be re-admitted, prefilled and decoded in
    # the same plan (retires run first); only a live lane's retire clashes.
    return {r.lane_tag for r in plan.retires if r.lane_tag in ex.lanes}


def _retires(ex: Executor, plan: TickPlan) -> None:
    for i, r in enumerate(plan.retires):
        if r.lane_tag not in ex.lanes and r.lane_tag not in ex.lanes.faulted:
            raise reject(Status.RejectUnknownLane, f"retires[{i}].lane_tag", f"no live or faulted lane {r.lane_tag}")


def _events_fit(ex: Executor, plan: TickPlan) -> None:
    """An applied plan cannot be taken back, so its events must fit their
    slot: bound them from above before anything moves. Pending op
    completions do not count: the worker carries those that do not fit into
    the messages that follow, so no completion can refuse a plan."""
    if ex.event_capacity is None:
        return
    admits, prefills, decodes = plan.admits, plan.prefills, plan.decodes
    size = _empty_events_bound(ex) + len(admits) * _ADMIT_RESULT + len(decodes) * _EMIT
    size += (len(decodes) + len(prefills) + len(admits)) * _FAULT
    # Shed entries: chunks, each retire's would-be entry, takeovers and lost imports (one per admit).
    size += (2 * len(prefills) + 2 * len(plan.retires) + 2 * len(admits)) * _SHED
    if decodes:
        wants = {a.lane_tag for a in admits if a.want_logprobs}
        wants |= {t for t, ln in ex.lanes.items() if ln.logprobs_top is not None}
        size += sum(d.max_new_tokens for d in decodes if d.lane_tag in wants) * _LOGPROB
    if size > ex.event_capacity:
        raise reject(Status.RejectBudget, "TickPlan.decodes",
                     f"its events could take {size} bytes, the event slot holds {ex.event_capacity}")


def _empty_events_bound(ex: Executor) -> int:
    # Every cache entry's eviction at most once, and the evictions ops made.
    return _EVENTS_BASE + (len(ex.cache.entries) + len(ex.pending.shed)) * _SHED


def empty_events_fit(ex: Executor) -> bool:
    """Whether a plan with no lists passes _events_fit."""
    return ex.event_capacity is None or _empty_events_bound(ex) <= ex.event_capacity
