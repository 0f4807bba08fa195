"""The plan decoder's fuzz target, run bounded: any bytes give a plan or a
PlanReject, mutations reach the decoder's checks, and the harness notices
when the contract breaks."""

from __future__ import annotations

import json
import random
import re
import sys

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from superfluid.abi import MsgKind, Status, codec
from superfluid.abi.plan_codec import PlanReject
from superfluid.abi.records import TickPlan
from superfluid.fuzz import plan_drivers, plan_mutator, plan_target

SEEDS = plan_target.seed_corpus()
_SETTINGS = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _assert_allowed(outcome: object) -> None:
    assert isinstance(outcome, TickPlan | PlanReject)
    if isinstance(outcome, PlanReject):
        assert outcome.status in set(Status) - {Status.OK}


def _put(buf: bytearray, f: plan_mutator.Field, value: int) -> None:
    buf[f.offset:f.offset + f.width] = value.to_bytes(f.width, "little")


@st.composite
def framed_plans(draw: st.DrawFn) -> bytes:
    """A valid MsgHeader and struct_size around random record fields and a
    random arena, so inputs get past the framing checks."""
    buf = bytearray(draw(st.binary(min_size=plan_mutator.ARENA_START, max_size=plan_mutator.ARENA_START)))
    arena = draw(st.binary(max_size=512))
    h = plan_mutator.HEADER_FIELDS
    _put(buf, h["kind"], int(MsgKind.PLAN))
    _put(buf, h["record_bytes"], plan_mutator.PLAN_BYTES)
    _put(buf, h["arena_bytes"], len(arena))
    size_field = next(f for f in plan_mutator.PLAN_FIELDS if f.path == "struct_size")
    _put(buf, size_field, plan_mutator.PLAN_BYTES)
    return bytes(buf + arena)


@_SETTINGS
@given(st.binary(max_size=1024) | framed_plans())
def test_any_bytes_decode_to_a_plan_or_a_reject(data: bytes) -> None:
    _assert_allowed(plan_target.one_input(data))


@_SETTINGS
@given(st.integers(0, len(SEEDS) - 1), st.integers(0, 2**64 - 1), st.integers(1, 8))
def test_mutated_seeds_decode_to_a_plan_or_a_reject(index: int, seed: int, rounds: int) -> None:
    data = plan_mutator.mutate(SEEDS[index], random.Random(seed), SEEDS, rounds=rounds)
    _assert_allowed(plan_target.one_input(data))


def test_builtin_loop_runs_thousands_of_mutations(tmp_path) -> None:
    summary = plan_drivers.run_builtin(3000, seed=20240601, artifact_dir=str(tmp_path))
    assert summary.runs == 3000
    assert summary.decoded + sum(summary.rejects.values()) == 3000
    assert summary.decoded > 0
    assert {"RejectBounds", "RejectIllegalCombination"} <= set(summary.rejects)
    assert not list(tmp_path.iterdir())


def test_mutation_is_deterministic_for_a_seed() -> None:
    for i, data in enumerate(SEEDS):
        a = plan_mutator.mutate(data, random.Random(i), SEEDS, rounds=4)
        b = plan_mutator.mutate(data, random.Random(i), SEEDS, rounds=4)
        assert a == b


# ------------------------------------------------------- negative controls


def test_an_unexpected_exception_propagates(monkeypatch) -> None:
    def broken(buf, **_: object) -> TickPlan:
        raise IndexError("decoder bug")

    monkeypatch.setattr(plan_target, "decode_plan", broken)
    with pytest.raises(IndexError, match="decoder bug"):
        plan_target.one_input(SEEDS[0])


def test_a_reject_with_status_ok_is_a_finding(monkeypatch) -> None:
    def rejects_ok(buf, **_: object) -> TickPlan:
        raise PlanReject(Status.OK, "TickPlan", "not really a reject")

    monkeypatch.setattr(plan_target, "decode_plan", rejects_ok)
    with pytest.raises(AssertionError, match="status OK"):
        plan_target.one_input(SEEDS[0])


def test_a_round_trip_mismatch_is_a_finding(monkeypatch) -> None:
    real = plan_target.decode_plan
    calls = iter(range(1_000))

    def drifting(buf, **kw: object) -> TickPlan:
        plan = real(buf, **kw)
        return plan._replace(plan_seq=plan.plan_seq + next(calls))

    monkeypatch.setattr(plan_target, "decode_plan", drifting)
    with pytest.raises(AssertionError, match="round trip"):
        plan_target.one_input(SEEDS[1])


def test_the_builtin_loop_saves_and_raises_a_finding(monkeypatch, tmp_path) -> None:
    real = plan_target.decode_plan

    def fails_on_short(buf, **kw: object) -> TickPlan:
        if len(buf) < plan_mutator.ARENA_START:
            raise IndexError("short input")
        return real(buf, **kw)

    monkeypatch.setattr(plan_target, "decode_plan", fails_on_short)
    with pytest.raises(IndexError):
        plan_drivers.run_builtin(5000, seed=1, artifact_dir=str(tmp_path))
    saved = [p for p in tmp_path.iterdir() if p.name.startswith("crash-")]
    assert len(saved) == 1 and len(saved[0].read_bytes()) < plan_mutator.ARENA_START


# ------------------------------------------------------------ the corpus


def test_every_seed_decodes_to_the_plan_it_was_built_from() -> None:
    for plan, data in zip(plan_target.seed_plans(), SEEDS, strict=True):
        got = plan_target.one_input(data)
        assert isinstance(got, TickPlan)
        # Compared as bytes: the params went through float32. decode_plan
        # clears the in-process pointers across processes.
        want = plan._replace(on_partial_emit=0, partial_emit_user=0)
        assert codec.encode("TickPlan", got) == codec.encode("TickPlan", want)


def test_seed_records_have_zeroed_padding() -> None:
    for data in SEEDS:
        for span in plan_mutator.SPANS:
            off = int.from_bytes(data[span.offset_at:span.offset_at + span.width], "little")
            count = int.from_bytes(data[span.count_at:span.count_at + span.width], "little")
            base = plan_mutator.ARENA_START + off
            for k in range(count):
                for f in span.item_fields:
                    if f.path.startswith("_pad"):
                        at = base + k * span.item_size + f.offset
                        assert data[at:at + f.width] == bytes(f.width), (span.name, k, f.path)


def test_mutations_reach_every_layer_of_checks() -> None:
    rng = random.Random(7)
    statuses: set[Status] = set()
    fields: set[str] = set()
    duplicate_tags = 0
    decoded = 0
    for _ in range(3000):
        outcome = plan_target.one_input(plan_mutator.mutate(rng.choice(SEEDS), rng, SEEDS))
        if isinstance(outcome, PlanReject):
            statuses.add(outcome.status)
            fields.add(re.sub(r"\[\d+\]", "[]", outcome.field))
            duplicate_tags += "appears twice" in outcome.message
        else:
            decoded += 1
    # decode_plan can only answer these two; the rest are the tick's.
    assert statuses == {Status.RejectBounds, Status.RejectIllegalCombination}
    assert decoded > 0 and duplicate_tags > 0
    framing = {"MsgHeader.kind", "MsgHeader.record_bytes", "MsgHeader.arena_bytes", "TickPlan.struct_size"}
    assert framing <= fields
    assert {f"TickPlan.{s.name}" for s in plan_mutator.SPANS} <= fields
    assert any(f.startswith("admits[].params.") for f in fields)
    assert len(fields) >= 20, sorted(fields)


# ------------------------------------------------------------------- CLI


def test_cli_prints_a_json_summary(capsys, tmp_path) -> None:
    plan_drivers.main(["--runs", "300", "--seed", "3", "--corpus", str(tmp_path)])
    summary = json.loads(capsys.readouterr().out)
    assert summary["runs"] == 300
    assert summary["decoded"] + sum(summary["rejects"].values()) == 300
    assert summary["elapsed_s"] > 0 and summary["exec_per_s"] > 0
    assert len(list(tmp_path.iterdir())) >= len(SEEDS)


def test_cli_without_atheris_says_how_to_install_it(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "atheris", None)  # makes `import atheris` fail
    with pytest.raises(SystemExit) as exit_:
        plan_drivers.main(["--atheris"])
    assert "pip install atheris" in str(exit_.value.code)


def test_runs_0_fuzzes_until_interrupted_and_still_reports(monkeypatch):
    from superfluid.fuzz import plan_drivers

    real, calls = plan_drivers.mutate, []

    def mutate(*a, **kw):
        calls.append(1)
        if len(calls) > 2500:  # what Ctrl-C does to a run of --runs 0
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(plan_drivers, "mutate", mutate)
    summary = plan_drivers.run_builtin(0)
    assert summary.runs == 2500 and summary.decoded + sum(summary.rejects.values()) == 2500
    calls.clear()
    with pytest.raises(KeyboardInterrupt):  # a bounded run passes the interrupt on
        plan_drivers.run_builtin(5000)
