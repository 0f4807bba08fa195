"""The conservation state machine: random create/feed/copy/truncate/free/import
runs against a model of every sequence's tokens (and of the pool, where the
factory opts in)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from superfluid.engine.runtime import (
    CapacityError,
    Feed,
    OutOfBounds,
)
from superfluid.testing.paged_pool import PagedPool
from superfluid.testing.runtime_harness import (
    RuntimeFactory,
    counts,
    export_blob,
    has_step_rows,
    history,
    lens,
    pages,
    refused,
)


def check_conservation_machine(f: RuntimeFactory) -> None:
    """Random create/feed/copy/truncate/free/import runs against a model of
    every sequence's tokens (and, where the factory opts in, of the pool)."""
    run_state_machine_as_test(
        conservation_machine(f),
        settings=settings(max_examples=f.max_examples, stateful_step_count=f.state_steps, deadline=None,
                          database=None, suppress_health_check=[HealthCheck.too_slow]),
    )


def conservation_machine(f: RuntimeFactory) -> type[RuleBasedStateMachine]:
    class Conservation(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.rt = f.make()
            d = self.d = self.rt.desc
            total = self.rt.mem_counters().cells_total
            self.pool = PagedPool(d.page, total, d.copy_shares_cells) if f.paged_model else None
            self.limited = total > 0
            self.tokens: dict[int, list[int]] = {}
            self.rows: dict[tuple[int, ...], bytes] = {}  # history -> its row, as first seen
            self.step_rows = has_step_rows(self.rt)
            probe = self.rt.seq_create()
            self.exports = export_blob(self.rt, probe) is not None
            self.rt.seq_free(probe)

        # -- helpers

        def _seen(self, hist: Sequence[int], row: np.ndarray) -> None:
            key = tuple(hist)
            assert row.dtype == np.float32 and row.shape == (self.d.vocab_size,)
            first = self.rows.setdefault(key, row.tobytes())
            assert first == row.tobytes(), f"the row after {len(key)} tokens changed with how they got there"

        def _pick(self, data: st.DataObject) -> int:
            return data.draw(st.sampled_from(sorted(self.tokens)))

        @contextlib.contextmanager
        def _may_run_out(self, need: int | None) -> Iterator[bool]:
            """Yields whether the call is expected to go through. With the pool
            model capacity is predicted; without it a CapacityError is allowed
            where cells are limited, and must change nothing."""
            expect_fail = self.pool is not None and not self.pool.fits(need or 0)
            live = sorted(self.tokens)
            before = (lens(self.rt, live), counts(self.rt))
            try:
                yield not expect_fail
            except CapacityError:
                assert expect_fail or (self.pool is None and self.limited), "an unexpected CapacityError"
                assert (lens(self.rt, live), counts(self.rt)) == before, "a CapacityError changed something"
            else:
                assert not expect_fail, "the pool model expected a CapacityError"

        # -- rules

        @rule()
        def create(self) -> None:
            if self.d.max_seqs and len(self.tokens) >= self.d.max_seqs:
                refused(self.rt, sorted(self.tokens), self.rt.seq_create, CapacityError)
                return
            s = self.rt.seq_create()
            assert s not in self.tokens
            self.tokens[s] = []
            if self.pool:
                self.pool.add(s)

        @initialize(k=st.integers(1, 3))
        def some_sequences(self, k: int) -> None:
            for _ in range(min(k, self.d.max_seqs or k)):
                self.create()

        @precondition(lambda self: self.tokens)
        @rule(data=st.data())
        def feed(self, data: st.DataObject) -> None:
            chosen = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1,
                                        max_size=min(3, self.d.max_batch), unique=True))
            # a small alphabet makes histories repeat; "fill" feeds run the pool out
            mode = data.draw(st.sampled_from(["short", "pages", "fill"]))
            plan = []
            for s in chosen:
                cap = {"short": self.d.page + 2, "pages": 3 * self.d.page,
                       "fill": max(1, self.d.max_seq_len - len(self.tokens[s]))}[mode]
                toks = data.draw(history(self.rt, cap, min_len=1, alphabet=4))
                plan.append((s, toks, data.draw(st.booleans())))
            with_rows = self.step_rows and data.draw(st.booleans())
            feeds = [Feed(s, toks, w) for s, toks, w in plan]
            call = (lambda: self.rt.step_rows(feeds)) if with_rows else (lambda: self.rt.step(feeds))
            if any(len(self.tokens[s]) + len(t) > self.d.max_seq_len for s, t, _ in plan):
                refused(self.rt, sorted(self.tokens), call, OutOfBounds)
                return
            need = self.pool.feed_need([(s, len(t)) for s, t, _ in plan]) if self.pool else None
            used = self.rt.mem_counters().cells_used
            with self._may_run_out(need) as ok:
                got = call()
                assert ok
                assert self.rt.mem_counters().cells_used >= used, "feeding released cells"
                for s, toks, _ in plan:
                    self.tokens[s] += toks
                    if self.pool:
                        self.pool.feed(s, len(toks))
                if with_rows:
                    for (s, toks, _), rows in zip(plan, got):
                        for i, row in enumerate(rows):
                            self._seen(self.tokens[s][: len(self.tokens[s]) - len(toks) + i + 1], row)
                else:
                    wanted = [s for s, _, w in plan if w]
                    assert len(got) == len(wanted)
                    for s, row in zip(wanted, got):
                        self._seen(self.tokens[s], row)

        @precondition(lambda self: len(self.tokens) >= 2)
        @rule(data=st.data())
        def copy(self, data: st.DataObject) -> None:
            src, dst = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=2, max_size=2,
                                          unique=True))
            size = len(self.tokens[src])
            # exact_only: whole copies, or a partial one that must be refused (n = 0 is not specified)
            n = data.draw(st.integers(1, size + 1) if self.d.exact_only else st.integers(0, size + 1))
            live = sorted(self.tokens)
            if n > size or (self.d.exact_only and n not in (0, size)):
                refused(self.rt, live, lambda: self.rt.seq_copy(src, dst, n), OutOfBounds)
                return
            need = self.pool.copy_need(src, dst, n) if self.pool else None
            with self._may_run_out(need):
                self.rt.seq_copy(src, dst, n)
                self.tokens[dst] = self.tokens[src][:n]
                if self.pool:
                    self.pool.copy(src, dst, n)

        @precondition(lambda self: self.tokens)
        @rule(data=st.data())
        def truncate(self, data: st.DataObject) -> None:
            s = self._pick(data)
            size = len(self.tokens[s])
            n = data.draw(st.integers(0, size + 1))
            if n > size or (not self.d.truncate_partial and n not in (0, size)):
                refused(self.rt, sorted(self.tokens), lambda: self.rt.seq_truncate(s, n), OutOfBounds)
                return
            self.rt.seq_truncate(s, n)
            del self.tokens[s][n:]
            if self.pool:
                self.pool.truncate(s, n)

        @precondition(lambda self: self.tokens)
        @rule(data=st.data())
        def free(self, data: st.DataObject) -> None:
            """One sequence, or two together (their shared pages count once)."""
            self._free_together(data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1,
                                                   max_size=2, unique=True)))

        def _free_together(self, seqs: list[int]) -> None:
            r, used = self.rt.cells_released(seqs), self.rt.mem_counters().cells_used
            if self.pool:
                assert r == self.pool.released(seqs)
            for s in seqs:
                self.rt.seq_free(s)
                del self.tokens[s]
                if self.pool:
                    self.pool.free(s)
            assert used - self.rt.mem_counters().cells_used == r, "cells_released mispredicted a free"

        @precondition(lambda self: self.exports and self.tokens
                      and not (self.d.max_seqs and len(self.tokens) >= self.d.max_seqs))
        @rule(data=st.data())
        def export_import(self, data: st.DataObject) -> None:
            src = self._pick(data)
            blob = self.rt.seq_export(src)
            dst = self.rt.seq_create()
            self.tokens[dst] = []
            if self.pool:
                self.pool.add(dst)
            n = len(self.tokens[src])
            with self._may_run_out(pages(n, self.d.page) if self.pool else None):
                assert self.rt.seq_import(dst, blob) == n
                self.tokens[dst] = list(self.tokens[src])
                if self.pool:
                    self.pool.import_(dst, n)

        # -- invariants

        @invariant()
        def lengths_and_counters(self) -> None:
            live = sorted(self.tokens)
            assert lens(self.rt, live) == tuple(len(self.tokens[s]) for s in live)
            m = self.rt.mem_counters()
            assert m.seqs == len(live)
            assert m.cells_total == 0 or m.cells_used <= m.cells_total
            if self.pool:
                assert m.cells_used == self.pool.used(), "cells_used differs from the pool model"
            assert self.rt.cells_released(live) == m.cells_used, "freeing everything must release everything"

        def teardown(self) -> None:
            try:
                for s in sorted(self.tokens):
                    self._free_together([s])
                m = self.rt.mem_counters()
                assert (m.cells_used, m.seqs) == (0, 0), f"held after freeing everything: {m}"
            finally:
                self.rt.close()

    Conservation.__name__ = f"Conservation_{f.name}"
    return Conservation
