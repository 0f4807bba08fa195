"""Conformance checks for any Runtime (contract §8), through its public interface only.

Each `check_*` takes a RuntimeFactory and either passes, fails, or skips what
the runtime's description says it cannot do. `CHECKS` lists them; the test
module crosses them with its factory table. Nothing here knows a runtime's
insides: limits come from `desc` and `mem_counters()`, and the one exact
model of cell accounting (PagedPool) runs only for factories that opt in.

What a runtime must hold to pass:
- rows are float32 (vocab,), finite, and a pure function of the sequence's
  history: bitwise the same however the history was fed (chunks, one at a
  time, copied, truncated and re-fed, exported and imported) and whatever
  else shares the step (contract §9);
- every primitive is all or nothing and names a bad sequence UnknownSequence;
- cells are counted in whole pages; freeing everything returns cells_used and
  seqs to 0, and cells_released predicts exactly what a free releases;
- an import refuses a corrupt blob (a checksum is needed for that) and a
  non-empty target, changing nothing.

The checks feed small literal tokens (up to 7): a vocabulary of at least 8.

Here: the checks on rows and the description. conformance_sequences.py holds
those on the sequence primitives and cells, conservation_machine.py the state
machine, runtime_harness.py what they share, paged_pool.py the pool model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import assume, given, strategies as st

from superfluid.engine.runtime import (
    Feed,
    RuntimeDescription,
    SampleSpec,
)
from superfluid.testing.conformance_sequences import (
    check_bad_feed_all_or_nothing,
    check_capacity_all_or_nothing,
    check_cells_released,
    check_copy,
    check_copy_on_write,
    check_create_len_free,
    check_export_import,
    check_max_seqs,
    check_truncate,
    check_unknown_sequence,
)
from superfluid.testing.conservation_machine import check_conservation_machine
from superfluid.testing.runtime_harness import (
    RuntimeFactory,
    example_settings,
    has_step_rows,
    history,
    host_sampling,
    lens,
    opened,
    replay_row,
    room,
    row_of,
    rows_one_at_a_time,
    same,
    seqs_of,
)


def check_description(f: RuntimeFactory) -> None:
    """desc is coherent and survives the ABI record; a fresh runtime holds nothing."""
    with opened(f) as rt:
        d = rt.desc
        assert isinstance(d, RuntimeDescription)
        assert d.vocab_size >= 2 and d.max_seq_len >= 1 and d.page >= 1 and d.max_batch >= 1
        assert d.max_seqs >= 0 and d.prefill_step_tokens >= 0
        assert not (d.exact_only and d.truncate_partial), "a recurrent state cannot be cut back"
        assert d.engine_sampling or not d.engine_draws, "draws are a kind of engine sampling"
        assert d.tp >= 1 and 1 <= d.nnodes <= d.tp, "parallel: tp >= 1 ranks on 1..tp machines"
        # The record holds neither the layout nor the numeric class: they come back as the defaults.
        assert RuntimeDescription.from_record(d.to_record()) == dataclasses.replace(d, tp=1, nnodes=1,
                                                                                    numeric_class="", isa="")
        m = rt.mem_counters()
        assert (m.cells_used, m.seqs) == (0, 0)
        assert m.cells_total == 0 or m.cells_total >= d.page


def check_rows_shape_and_order(f: RuntimeFactory) -> None:
    """One float32 (vocab,) finite row per feed that wants one, in feed order."""
    with opened(f) as rt:
        page, v = rt.desc.page, rt.desc.vocab_size
        n_max = min(4, rt.desc.max_batch)

        @example_settings(f)
        @given(st.lists(st.tuples(history(rt, 2 * page + 1, min_len=1), st.booleans()),
                        min_size=1, max_size=n_max))
        def run(feeds: list[tuple[list[int], bool]]) -> None:
            assume(room(rt, len(feeds) + 1, [len(h) for h, _ in feeds] + [2 * page + 1]))
            with seqs_of(rt) as ss:
                seqs = [ss.new() for _ in feeds]
                rows = rt.step([Feed(s, h, w) for s, (h, w) in zip(seqs, feeds)])
                wanted = [h for h, w in feeds if w]
                assert isinstance(rows, list) and len(rows) == len(wanted)
                for row, h in zip(rows, wanted):
                    assert isinstance(row, np.ndarray) and row.shape == (v,) and row.dtype == np.float32
                    assert np.isfinite(row).all()
                    assert same(row, replay_row(rt, h)), "rows out of order, or not a function of history"
                assert lens(rt, seqs) == tuple(len(h) for h, _ in feeds)

        run()


def check_chunking_invariance(f: RuntimeFactory) -> None:
    """One token a step, random chunks, or all at once: bitwise the same rows."""
    with opened(f) as rt:
        page = rt.desc.page

        @example_settings(f)
        @given(st.data())
        def run(data: st.DataObject) -> None:
            h = data.draw(history(rt, 3 * page + 2, min_len=1))
            cuts = sorted(set(data.draw(st.lists(st.integers(1, len(h)), max_size=4))) | {len(h)})
            assume(room(rt, 2, [len(h)] * 2))
            one_by_one = rows_one_at_a_time(rt, h)
            with seqs_of(rt) as ss:
                chunked, whole = ss.new(), ss.new()
                at = 0
                for c in cuts:
                    assert same(row_of(rt, chunked, h[at:c]), one_by_one[c - 1])
                    at = c
                assert same(row_of(rt, whole, h), one_by_one[-1])
                assert lens(rt, [chunked, whole]) == (len(h), len(h))

        run()


def check_batch_invariance(f: RuntimeFactory) -> None:
    """A feed's rows do not depend on the other feeds of its step or their order."""
    with opened(f) as rt:
        page = rt.desc.page
        n_max = max(1, min(4, rt.desc.max_batch // 2))

        @example_settings(f)
        @given(st.data())
        def run(data: st.DataObject) -> None:
            k = data.draw(st.integers(1, n_max))
            prefixes = [data.draw(history(rt, 2 * page)) for _ in range(k)]
            nexts = [data.draw(history(rt, page + 1, min_len=1)) for _ in range(k)]
            prefixes = [p[: rt.desc.max_seq_len - len(n)] for p, n in zip(prefixes, nexts)]
            noise = data.draw(st.lists(history(rt, page + 2, min_len=1), max_size=n_max))
            assume(room(rt, k + len(noise), [len(p) + len(n) for p, n in zip(prefixes, nexts)]
                        + [len(n) for n in noise]))
            solo = [replay_row(rt, p + n) for p, n in zip(prefixes, nexts)]
            with seqs_of(rt) as ss:
                lanes = [ss.new(p) for p in prefixes]
                others = [ss.new() for _ in noise]
                feeds = [(i, Feed(s, n, True)) for i, (s, n) in enumerate(zip(lanes, nexts))]
                feeds += [(-1, Feed(s, n, data.draw(st.booleans()))) for s, n in zip(others, noise)]
                order = data.draw(st.permutations(feeds))
                rows = iter(rt.step([fd for _, fd in order]))
                for i, fd in order:
                    if fd.wants_row:
                        row = next(rows)
                        if i >= 0:
                            assert same(row, solo[i]), "a row depends on its step's other feeds"

        run()


def check_step_rows(f: RuntimeFactory) -> None:
    """step_rows: an (n_tokens, vocab) array per feed, each row the row of that
    token alone; the last one is step's row."""
    with opened(f) as rt:
        if not has_step_rows(rt):
            pytest.skip(f"{f.name}: no step_rows")
        page, v = rt.desc.page, rt.desc.vocab_size

        @example_settings(f)
        @given(st.lists(st.tuples(history(rt, page), history(rt, page + 2, min_len=1), st.booleans()),
                        min_size=1, max_size=min(3, rt.desc.max_batch)))
        def run(feeds: list[tuple[list[int], list[int], bool]]) -> None:
            feeds = [(p[: rt.desc.max_seq_len - len(n)], n, w) for p, n, w in feeds]
            assume(room(rt, len(feeds) + 1, [len(p) + len(n) for p, n, _ in feeds] + [2 * page + 2]))
            with seqs_of(rt) as ss:
                seqs = [ss.new(p) for p, _, _ in feeds]
                got = rt.step_rows([Feed(s, n, w) for s, (_, n, w) in zip(seqs, feeds)])
                assert got is not None and len(got) == len(feeds)
                for rows, (p, n, _) in zip(got, feeds):
                    assert rows.shape == (len(n), v) and rows.dtype == np.float32
                    ref = rows_one_at_a_time(rt, p + n)[len(p):]
                    for row, r in zip(rows, ref):
                        assert same(np.ascontiguousarray(row), r)
                    assert same(np.ascontiguousarray(rows[-1]), replay_row(rt, p + n))

        run()


def check_step_sampled(f: RuntimeFactory) -> None:
    """Greedy specs give the argmax (lowest id on ties) of the row step would
    give; draws give what the host sampler draws from that row (contract §5)."""
    with opened(f) as rt:
        if not rt.desc.engine_sampling:
            pytest.skip(f"{f.name}: no engine sampling")
        hs = host_sampling() if rt.desc.engine_draws else None
        page = rt.desc.page

        @example_settings(f)
        @given(st.data())
        def run(data: st.DataObject) -> None:
            k = data.draw(st.integers(1, min(3, rt.desc.max_batch)))
            hists = [data.draw(history(rt, 2 * page, min_len=1)) for _ in range(k)]
            specs = []
            for _ in range(k):
                if rt.desc.engine_draws and data.draw(st.booleans()):
                    specs.append(SampleSpec(temperature=data.draw(st.sampled_from([0.5, 1.0, 2.0])),
                                            top_k=data.draw(st.integers(0, 8)),
                                            top_p=data.draw(st.sampled_from([0.0, 0.5, 0.9])),
                                            min_p=data.draw(st.sampled_from([0.0, 0.05])),
                                            rng_position=data.draw(st.integers(0, 2**64 - 1))))
                else:
                    specs.append(SampleSpec())
            assume(room(rt, 2 * k, [len(h) + 1 for h in hists] * 2))
            with seqs_of(rt) as ss:
                seqs = [ss.new(h[:-1]) for h in hists]
                twins = [ss.new(h[:-1]) for h in hists]
                toks = rt.step_sampled([Feed(s, h[-1:]) for s, h in zip(seqs, hists)], specs)
                assert toks is not None and len(toks) == k
                assert lens(rt, seqs) == tuple(len(h) for h in hists)
                for s, h, spec, tok in zip(twins, hists, specs, toks):
                    row = row_of(rt, s, h[-1:])
                    assert isinstance(tok, int) and 0 <= tok < rt.desc.vocab_size
                    if spec.temperature <= 0:
                        assert tok == int(np.argmax(row))
                    elif hs is not None:
                        assert tok == hs.sample(row, spec.temperature, spec.top_k, spec.top_p, spec.min_p,
                                                spec.rng_position)
                # both now hold the same histories: the same specs must draw the same tokens
                on_twins = rt.step_sampled([Feed(s, h[-1:]) for s, h in zip(twins, hists)], specs)
                on_seqs = rt.step_sampled([Feed(s, h[-1:]) for s, h in zip(seqs, hists)], specs)
                assert on_twins is not None and on_twins == on_seqs, "a draw is not a function of its inputs"

        run()


def check_vocabulary_and_eos(f: RuntimeFactory) -> None:
    with opened(f) as rt:
        voc, v = rt.vocabulary(), rt.desc.vocab_size
        assert voc.size == v
        assert voc.eos and all(0 <= e < v for e in voc.eos)
        assert all(0 <= t < v for t in voc.specials.values())
        for t in sorted(set(range(min(v, 4096))) | set(voc.eos)):
            assert rt.is_eos(t) == (t in voc.eos), t


CHECKS: list[Callable[[RuntimeFactory], None]] = [
    check_description,
    check_create_len_free,
    check_unknown_sequence,
    check_rows_shape_and_order,
    check_chunking_invariance,
    check_batch_invariance,
    check_step_rows,
    check_step_sampled,
    check_copy,
    check_copy_on_write,
    check_truncate,
    check_export_import,
    check_capacity_all_or_nothing,
    check_bad_feed_all_or_nothing,
    check_cells_released,
    check_max_seqs,
    check_vocabulary_and_eos,
    check_conservation_machine,
]
