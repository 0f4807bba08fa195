"""Fuzz target for the plan decoder, `superfluid.abi.plan_codec.decode_plan`.

A queue slot is written by another process, so the decoder must answer any
bytes with a TickPlan or a PlanReject (contract §1, §3 step 1) and nothing else.
`one_input` checks that, plus a differential property: a decoded plan,
re-encoded and decoded again, is the same plan.

Inputs come from a seed corpus of valid plans (`seed_corpus`, here) and a
structure-aware mutator (`superfluid.fuzz.plan_mutator`); the built-in loop
and the atheris driver that feed them in live in `superfluid.fuzz.plan_drivers`:

    python -m superfluid.fuzz.plan_target --runs 100000 [--seed S] [--corpus DIR]
    python -m superfluid.fuzz.plan_target --atheris [--runs N] [-- libFuzzer flags]
"""

from __future__ import annotations

import math
import re

from superfluid.abi import (
    CacheClass,
    Determinism,
    PlanFlag,
    RingId,
    Sampling,
    Status,
    codec,
)
from superfluid.abi.plan_codec import PlanReject, decode_plan
from superfluid.abi.records import RingRef, TickPlan
from superfluid.client import PlanBuilder, sampling_params

Outcome = TickPlan | PlanReject

# ------------------------------------------------------------------ target


def one_input(data: bytes) -> Outcome:
    """Decode `data` as a plan slot. Returns the plan or the reject; raises on
    anything else (a finding)."""
    try:
        plan = decode_plan(data)
    except PlanReject as reject:
        _check_reject(reject)
        return reject
    _check_round_trip(plan)
    return plan


def fuzz_one_input(data: bytes) -> None:
    """The atheris entry point."""
    one_input(data)


def _check_reject(reject: PlanReject) -> None:
    try:
        status = Status(int(reject.status))
    except (TypeError, ValueError):
        raise AssertionError(f"PlanReject with invalid status {reject.status!r}: {reject}") from None
    if status == Status.OK:
        raise AssertionError(f"PlanReject with status OK: {reject}")


def _check_round_trip(plan: TickPlan) -> None:
    if not isinstance(plan, TickPlan):
        raise AssertionError(f"decode_plan returned {type(plan).__name__}, not TickPlan")
    encoded = codec.encode("TickPlan", plan)
    try:
        again = decode_plan(encoded)
    except PlanReject as reject:
        raise AssertionError(f"a decoded plan, re-encoded, is rejected: {reject}") from reject
    if not same_record(plan, again):
        raise AssertionError(f"round trip changed the plan:\n  {plan}\n  {again}")
    if codec.encode("TickPlan", again) != encoded:
        raise AssertionError("encoding the same plan twice gave different bytes")


def same_record(a: object, b: object) -> bool:
    """Record equality where NaN equals NaN (a NaN that reached a plan must
    still round-trip, and plain == would call that a mismatch)."""
    if a == b:
        return True
    if isinstance(a, float) and isinstance(b, float):
        return math.isnan(a) and math.isnan(b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_record, a, b))
    return False


def outcome_key(outcome: Outcome) -> tuple:
    """A coarse signature of an outcome, the built-in loop's novelty signal
    (no coverage there): reject status and field, or the shape of a plan."""
    if isinstance(outcome, PlanReject):
        return (outcome.status.name, re.sub(r"\[\d+\]", "[]", outcome.field))
    lists = (outcome.admits, outcome.prefills, outcome.decodes, outcome.commits, outcome.retires)
    return ("OK", outcome.flags, outcome.evictable_cache_classes, tuple(min(len(x), 3) for x in lists))


# ------------------------------------------------------------ seed corpus


def _prompt(offset: int, length: int, generation: int = 0) -> RingRef:
    return RingRef(ring_id=int(RingId.PROMPT), generation=generation, offset=offset, len=length)


def seed_plans() -> list[TickPlan]:
    """Valid plans covering every list and most fields."""
    plans = [PlanBuilder(1).build()]

    b = PlanBuilder(2, prefill_token_budget=512)
    b.admit(11, _prompt(0, 32))
    plans.append(b.build())

    b = PlanBuilder(3, prefill_token_budget=4096)
    b.admit(21, _prompt(0, 100), sampling=Sampling.GPU_SAMPLE,
            params=sampling_params(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repeat_penalty=1.1,
                                   presence_penalty=0.5, freq_penalty=-0.25, ignore_eos=True),
            rng_counter_base=1 << 40, determinism_class=Determinism.SEED_PATH_INVARIANT, want_logprobs=5)
    b.admit(22, _prompt(100, 7, generation=3), sampling=Sampling.HOST, decode_replay=2,
            determinism_class=Determinism.DISTRIBUTION_EXACT, want_logprobs=20)
    b.admit(23, _prompt(107, 64), grammar_handle=5, grammar_replay=4, logit_bias_handle=6, seed_handle=7,
            strategy_slot=1, params=sampling_params(temperature=-1.0, top_p=1.0, min_p=1.0))
    b.admit((1 << 64) - 1, _prompt((1 << 64) - 9, 8),
            params=sampling_params(temperature=3.0e38, top_k=2**32 - 1))
    plans.append(b.build())

    b = PlanBuilder(4, prefill_token_budget=256)
    b.prefill(11, 0, 16).prefill(21, 32, 64).prefill(31, 4_000_000_000, 294_967_295)
    plans.append(b.build())

    b = PlanBuilder(5, max_decode_lanes=8)
    b.decode(11).decode(21, max_new_tokens=16, overshoot=4)
    b.decode(22, max_new_tokens=0xFFFF, overshoot=0xFFFF)
    plans.append(b.build())

    b = PlanBuilder(6)
    b.commit(22, 17, 0xDEADBEEF).commit(24, 2**32 - 1, 2**64 - 1)
    plans.append(b.build())

    b = PlanBuilder(7, flags=PlanFlag.DRAIN)
    b.retire(11).retire(21, publish_to_cache=True).retire(22)
    plans.append(b.build())

    b = PlanBuilder(2**63 - 1, flags=PlanFlag.PARTIAL_EMITS, max_decode_lanes=4, prefill_token_budget=128,
                    evictable_cache_classes=CacheClass.RESIDENT_PREFIX_CLASS, max_evict_bytes=1 << 30,
                    protected_quota_bytes=1 << 20)
    b.retire(1, publish_to_cache=True)
    b.commit(2, 5, 99)
    b.admit(3, _prompt(0, 12), sampling=Sampling.HOST)
    b.admit(4, _prompt(12, 40), sampling=Sampling.GPU_SAMPLE,
            params=sampling_params(temperature=1.0, top_k=1))
    b.prefill(3, 0, 12).prefill(4, 0, 40)
    b.decode(2).decode(3).decode(4, max_new_tokens=8)
    # In-process pointers: decode_plan clears them across processes.
    plans.append(b.build()._replace(on_partial_emit=0x7F00_0000_1000, partial_emit_user=0x7F00_0000_2000))
    return plans


def seed_corpus() -> list[bytes]:
    return [codec.encode("TickPlan", p) for p in seed_plans()]


if __name__ == "__main__":
    # The CLI sits with the drivers, which import this module.
    from superfluid.fuzz.plan_drivers import main

    main()
