"""Cells the memory check promises and what the tick spends: exact_only
checkpoints (>= 128-token prompts, never at the plan's expense, a fatal
error there is fatal), retires that free before they publish, and decode
rounds that count a cell only where one is fed."""

from __future__ import annotations

import pytest

from superfluid.abi import Finish, Status, TickStatus
from superfluid.client.builder import PlanBuilder
from superfluid.testing.executor import BIG_BUDGET, admit_and_prefill, emit_of, fake, make_executor, put
from superfluid.testing.invariants import check_invariants


def _prompt(n: int) -> list[int]:
    return [(i * 7) % 60 for i in range(n)]


@pytest.mark.parametrize("n, cached", [(127, None), (128, 127), (129, 128)])
def test_exact_only_checkpoints_a_prompt_of_128_tokens_or_more(n, cached):
    ex = make_executor(fake(exact_only=True, page=4, max_seq_len=256))
    admit_and_prefill(ex, 1, 1, _prompt(n))
    assert [len(e.tokens) for e in ex.cache] == ([] if cached is None else [cached])
    assert all(e.tokens == tuple(_prompt(n)[:cached]) for e in ex.cache)
    check_invariants(ex)


def test_a_checkpoint_never_takes_cells_the_plan_was_promised():
    page = 4
    rt = fake(exact_only=True, page=page, max_seq_len=256, cells_total=65 * page)
    ex = make_executor(rt)
    admit_and_prefill(ex, 1, 2, [1, 2, 3, 4])
    r = ex.tick(PlanBuilder(2, prefill_token_budget=BIG_BUDGET).admit(1, put(ex, _prompt(129)))
                .prefill(1, 0, 129).decode(2, 2).build())
    assert r.ok and r.events.tick_status == int(TickStatus.OK) and not r.events.faults
    assert emit_of(r, 2).n_tokens == 2
    assert len(ex.cache) == 0  # no room left for the copy: skipped, not a fault
    check_invariants(ex)
    # negative control: with room to spare the same plan checkpoints
    rt = fake(exact_only=True, page=page, max_seq_len=256, cells_total=200 * page)
    ex = make_executor(rt)
    admit_and_prefill(ex, 1, 2, [1, 2, 3, 4])
    r = ex.tick(PlanBuilder(2, prefill_token_budget=BIG_BUDGET).admit(1, put(ex, _prompt(129)))
                .prefill(1, 0, 129).decode(2, 2).build())
    assert r.ok and [len(e.tokens) for e in ex.cache] == [128]


@pytest.mark.parametrize("site", ["create", "copy"])
def test_a_fatal_error_in_a_checkpoint_is_fatal(site):
    rt = fake(exact_only=True, page=4, max_seq_len=256)
    ex = make_executor(rt)
    assert ex.tick(PlanBuilder(1, prefill_token_budget=100).admit(1, put(ex, _prompt(130)))
                   .prefill(1, 0, 130).build()).ok
    rt.inject_fatal(on=site)
    r = ex.tick(PlanBuilder(2, prefill_token_budget=BIG_BUDGET).prefill(1, 100, 30).build())
    assert r.status == Status.Fatal and "checkpoint" in r.message
    assert ex.tick(PlanBuilder(3).build()).status == Status.Fatal


@pytest.mark.parametrize("publish_first", [True, False])
def test_retires_free_before_they_publish(publish_first):
    page = 4
    rt = fake(page=page, max_seq_len=64, cells_total=3 * page)
    ex = make_executor(rt)
    admit_and_prefill(ex, 1, 1, [1, 2, 3, 4, 5])  # 4 cells held, 1 pending
    admit_and_prefill(ex, 2, 2, [6, 7, 8, 9, 10, 11, 12, 13])  # 7 cells held: the pool is full
    b = PlanBuilder(3)
    b = b.retire(1, publish_to_cache=True).retire(2) if publish_first else b.retire(2).retire(1, publish_to_cache=True)
    r = ex.tick(b.build())
    assert r.ok and r.events.tick_status == int(TickStatus.OK)
    assert [e.tokens for e in ex.cache] == [(1, 2, 3, 4)]  # the 5 committed, cut to a page
    check_invariants(ex)


def test_a_publish_whose_pending_feed_fails_keeps_what_it_holds():
    rt = fake(page=4, max_seq_len=64)
    ex = make_executor(rt)
    admit_and_prefill(ex, 1, 1, list(range(1, 10)))  # 8 cells held, token 9 pending
    rt.inject_capacity_fault()
    r = ex.tick(PlanBuilder(2).retire(1, publish_to_cache=True).build())
    assert r.ok
    assert [e.tokens for e in ex.cache] == [tuple(range(1, 9))]
    check_invariants(ex)


def test_a_decode_at_no_room_costs_no_cell_unless_it_feeds_one():
    # An 8-token prompt in an 8-cell pool with max_seq_len 8: its first row comes from
    # the prefill and it finishes on LENGTH without feeding a cell.
    rt = fake(page=4, max_seq_len=8, cells_total=8)
    ex = make_executor(rt)
    r = ex.tick(PlanBuilder(1, prefill_token_budget=BIG_BUDGET).admit(1, put(ex, list(range(1, 9))))
                .prefill(1, 0, 8).decode(1, 1).build())
    assert r.ok, r.message
    assert emit_of(r, 1).finish == int(Finish.LENGTH) and emit_of(r, 1).n_tokens == 0
    # negative control: a lane holding a pending token at max_seq_len does feed it (one cell)
    rt = fake(page=4, max_seq_len=8, cells_total=8)
    ex = make_executor(rt)
    admit_and_prefill(ex, 1, 1, list(range(1, 9)))  # 7 cells, token 8 pending
    assert rt.mem_counters().cells_used == 8  # whole pages
    r = ex.tick(PlanBuilder(2).decode(1, 1).build())
    assert r.ok and emit_of(r, 1).finish == int(Finish.LENGTH)
