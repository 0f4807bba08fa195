"""Conformance checks of the sequence primitives (create, copy, truncate,
export/import, free): each all or nothing, an unknown sequence named as such,
cells counted in whole pages and released as predicted."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import assume, given, strategies as st

from superfluid.engine.runtime import (
    CapacityError,
    Feed,
    OutOfBounds,
    RuntimeFailure,
    SampleSpec,
    UnknownSequence,
)
from superfluid.testing.paged_pool import PagedPool
from superfluid.testing.runtime_harness import (
    RuntimeFactory,
    cut_points,
    example_settings,
    export_blob,
    has_step_rows,
    history,
    lens,
    opened,
    pages,
    ramp,
    refused,
    replay_row,
    room,
    row_of,
    rows_one_at_a_time,
    same,
    seqs_of,
    unchanged,
)


def check_create_len_free(f: RuntimeFactory) -> None:
    with opened(f) as rt, seqs_of(rt) as ss:
        a, b = ss.new(), ss.new()
        assert isinstance(a, int) and isinstance(b, int) and a > 0 and b > 0 and a != b
        assert lens(rt, [a, b]) == (0, 0)
        m = rt.mem_counters()
        assert (m.cells_used, m.seqs) == (0, 2), "an empty sequence holds no cells"
        rt.step([Feed(a, [1, 2, 3])])
        assert lens(rt, [a, b]) == (3, 0)
        assert rt.mem_counters().cells_used >= 3
        ss.free(a)
        assert rt.mem_counters().seqs == 1
        with pytest.raises(UnknownSequence):
            rt.seq_len(a)
        refused(rt, [b], lambda: rt.seq_free(a), UnknownSequence)


def check_unknown_sequence(f: RuntimeFactory) -> None:
    """Every primitive names a bad id UnknownSequence and changes nothing."""
    with opened(f) as rt, seqs_of(rt) as ss:
        good = ss.new([1, 2, 3])
        gone = ss.new([4])
        ss.free(gone)
        blob = export_blob(rt, good)
        rows_ok = has_step_rows(rt)
        for bad in (0, gone):
            calls: list[Callable[[], object]] = [
                lambda: rt.seq_len(bad),
                lambda: rt.seq_free(bad),
                lambda: rt.seq_truncate(bad, 0),
                lambda: rt.seq_copy(bad, good, 0),
                lambda: rt.seq_copy(good, bad, 0),
                lambda: rt.step([Feed(bad, [1], True)]),
                lambda: rt.step([Feed(good, [1], True), Feed(bad, [1], True)]),
                lambda: rt.cells_released([bad]),
                lambda: rt.cells_released([good, bad]),
            ]
            if rows_ok:
                calls.append(lambda: rt.step_rows([Feed(good, [1]), Feed(bad, [1])]))
            if rt.desc.engine_sampling:
                calls.append(lambda: rt.step_sampled([Feed(good, [1]), Feed(bad, [1])], [SampleSpec()] * 2))
            if blob is not None:
                calls += [lambda: rt.seq_export(bad), lambda: rt.seq_import(bad, blob)]
            for call in calls:
                refused(rt, [good], call, UnknownSequence)


def check_copy(f: RuntimeFactory) -> None:
    """dst holds src's first n cells and continues exactly as a replay would;
    what dst held is dropped; src is untouched; shared copies cost at most
    the partial page, private ones at least their cells."""
    with opened(f) as rt:
        d = rt.desc
        page = d.page

        @example_settings(f)
        @given(st.data())
        def run(data: st.DataObject) -> None:
            h = data.draw(history(rt, 3 * page + 1, min_len=1))[: d.max_seq_len - 1]
            n = len(h) if d.exact_only else data.draw(st.integers(0, len(h)))
            junk = data.draw(history(rt, page + 2))
            t = data.draw(st.integers(0, d.vocab_size - 1))
            assume(room(rt, 5, [len(h) + 1, n + 1, max(n + 1, len(junk)), len(junk), len(h) + 1]))
            with seqs_of(rt) as ss:
                src, fresh, held = ss.new(h), ss.new(), ss.new(junk)
                used = rt.mem_counters().cells_used
                rt.seq_copy(src, fresh, n)
                grew = rt.mem_counters().cells_used - used
                assert lens(rt, [src, fresh]) == (len(h), n)
                if d.copy_shares_cells:
                    assert grew <= page and (n <= page or grew < n), f"copy of {n} cells took {grew}"
                else:
                    assert grew >= n, f"a private copy of {n} cells took {grew}"
                rt.seq_copy(src, held, n)
                assert rt.seq_len(held) == n
                want = replay_row(rt, h[:n] + [t])
                assert same(row_of(rt, fresh, [t]), want)
                assert same(row_of(rt, held, [t]), want), "dst kept some of what it held"
                assert same(row_of(rt, src, [t]), replay_row(rt, h + [t])), "the copy changed src"
                other = ss.new(junk)
                refused(rt, [src, other], lambda: rt.seq_copy(src, other, rt.seq_len(src) + 1), OutOfBounds)
                if d.exact_only and len(h) >= 2:
                    refused(rt, [src, other], lambda: rt.seq_copy(src, other, 1), OutOfBounds)

        run()


def check_copy_on_write(f: RuntimeFactory) -> None:
    """A copy cut back into a page it shares, then fed, writes its own page:
    the source's rows do not change (and, with the pool model, the write
    costs exactly the pages the model says)."""
    with opened(f) as rt:
        d = rt.desc
        page = d.page
        if not (d.copy_shares_cells and d.truncate_partial and page > 1 and d.max_seq_len > 2 * page + 1):
            pytest.skip(f"{f.name}: no shared pages to cut into")

        @example_settings(f)
        @given(st.data())
        def run(data: st.DataObject) -> None:
            h = data.draw(history(rt, 3 * page, min_len=2 * page))
            m = data.draw(st.integers(page + 1, 2 * page - 1))  # inside the second page, which is shared
            u = data.draw(history(rt, page + 1, min_len=1))
            t = data.draw(st.integers(0, d.vocab_size - 1))
            assume(room(rt, 3, [len(h) + 1, m + len(u), len(h) + 1]))
            pool = PagedPool(page, rt.mem_counters().cells_total, True) if f.paged_model else None
            with seqs_of(rt) as ss:
                src, dst = ss.new(h), ss.new()
                rt.seq_copy(src, dst, len(h))
                rt.seq_truncate(dst, m)
                if pool:
                    pool.add(src), pool.add(dst), pool.feed(src, len(h))
                    pool.copy(src, dst, len(h)), pool.truncate(dst, m), pool.feed(dst, len(u))
                assert same(row_of(rt, dst, u), replay_row(rt, h[:m] + u))
                if pool:
                    assert rt.mem_counters().cells_used == pool.used()
                assert same(row_of(rt, src, [t]), replay_row(rt, h + [t])), "a write to a shared page leaked"

        run()


def check_truncate(f: RuntimeFactory) -> None:
    """Keeping n cells then re-feeding the rest gives the same rows bitwise;
    whole pages are released; n > len is OutOfBounds; a runtime without
    truncate_partial cuts only to 0 or len."""
    with opened(f) as rt:
        d = rt.desc
        page = d.page

        @example_settings(f)
        @given(st.data())
        def run(data: st.DataObject) -> None:
            h = data.draw(history(rt, 3 * page + 2, min_len=1))
            n = data.draw(cut_points(len(h), whole_only=not d.truncate_partial))
            assume(room(rt, 2, [len(h)] * 2))
            ref = rows_one_at_a_time(rt, h)
            with seqs_of(rt) as ss:
                s = ss.new(h)
                refused(rt, [s], lambda: rt.seq_truncate(s, len(h) + 1), OutOfBounds)
                if not d.truncate_partial and len(h) >= 2:
                    refused(rt, [s], lambda: rt.seq_truncate(s, len(h) - 1), OutOfBounds)
                used, alone = rt.mem_counters().cells_used, rt.cells_released([s])
                rt.seq_truncate(s, n)
                assert rt.seq_len(s) == n
                drop = used - rt.mem_counters().cells_used
                assert drop == (pages(len(h), page) - pages(n, page)) * page, f"{len(h)}->{n} freed {drop}"
                if n == 0:
                    assert drop == alone
                for i in range(n, len(h)):
                    assert same(row_of(rt, s, [h[i]]), ref[i]), f"re-fed token {i} differs"

        run()


def check_export_import(f: RuntimeFactory) -> None:
    """An import of an export continues bitwise as the original; a non-empty
    target and every corrupt blob are refused, changing nothing."""
    with opened(f) as rt:
        d = rt.desc
        with seqs_of(rt) as ss:
            probe = ss.new([1])
            if export_blob(rt, probe) is None:
                pytest.skip(f"{f.name}: no export")

        @example_settings(f)
        @given(st.data())
        def run(data: st.DataObject) -> None:
            h = data.draw(history(rt, 2 * d.page + 3))[: d.max_seq_len - 1]
            t = data.draw(st.integers(0, d.vocab_size - 1))
            assume(room(rt, 5, [len(h) + 1] * 3 + [1, len(h) + 1]))
            with seqs_of(rt) as ss:
                a = ss.new(h)
                with unchanged(rt, [a]):
                    blob = rt.seq_export(a)
                assert isinstance(blob, bytes)
                assert len(blob) <= rt.export_bytes_max(), (len(blob), rt.export_bytes_max())
                b = ss.new()
                used = rt.mem_counters().cells_used
                assert rt.seq_import(b, blob) == len(h) == rt.seq_len(b)
                assert rt.mem_counters().cells_used - used >= len(h)
                full = ss.new([t])
                refused(rt, [a, b, full], lambda: rt.seq_import(full, blob))
                target = ss.new()
                corrupt = [b"", blob[:-1], blob[: len(blob) // 2], blob + b"\0"]
                for i in sorted({0, len(blob) // 2, len(blob) - 1}):
                    corrupt.append(blob[:i] + bytes([blob[i] ^ 0x41]) + blob[i + 1:])
                for bad in corrupt:
                    refused(rt, [a, b, target], lambda: rt.seq_import(target, bad))
                    assert rt.seq_len(target) == 0
                assert rt.seq_import(target, blob) == len(h)
                want = row_of(rt, a, [t])
                assert same(row_of(rt, b, [t]), want)
                assert same(row_of(rt, target, [t]), want)

        run()


def check_capacity_all_or_nothing(f: RuntimeFactory) -> None:
    """With the pool one page short, a step, copy or import that needs more
    raises CapacityError and changes nothing (the feeds that would fit too)."""
    with opened(f) as rt:
        d, total = rt.desc, rt.mem_counters().cells_total
        page = d.page
        if total == 0:
            pytest.skip(f"{f.name}: no cell limit")
        with seqs_of(rt) as ss:
            x, y = ss.new(), ss.new()
            src = ss.new(ramp(rt, min(page + 1, d.max_seq_len - 1)))
            fill: list[int] = []
            while (free := total - rt.mem_counters().cells_used) > page:
                k = min(free - page, d.max_seq_len) // page * page
                if k == 0 or (d.max_seqs and rt.mem_counters().seqs >= d.max_seqs):
                    pytest.skip(f"{f.name}: cannot fill the pool to one page free")
                fill.append(ss.new([7] * k))
            assert total - rt.mem_counters().cells_used == page
            live = [x, y, src, *fill]
            n = min(page, d.max_seq_len)
            refused(rt, live, lambda: rt.step([Feed(x, [1] * n, True), Feed(y, [2], True)]), CapacityError)
            refused(rt, live, lambda: rt.step([Feed(y, [2], True), Feed(x, [1] * n, True)]), CapacityError)
            if n < d.max_seq_len:
                refused(rt, live, lambda: rt.step([Feed(x, [1] * (n + 1), True)]), CapacityError)
            # src's partial page has room: with x's page this step takes exactly the last page
            sl = rt.seq_len(src)
            room_in_page = sl % page != 0 and sl < d.max_seq_len
            got = rt.step([Feed(x, [1] * n), *([Feed(src, [3], True)] if room_in_page else [])])
            assert lens(rt, [x, src]) == (n, sl + room_in_page) and len(got) == room_in_page
            src_tokens = ramp(rt, sl) + [3] * room_in_page
            m = rt.mem_counters()
            assert m.cells_used == m.cells_total, "a page of feeds did not take the last page"
            refused(rt, live, lambda: rt.step([Feed(y, [2], True)]), CapacityError)
            if has_step_rows(rt):
                refused(rt, live, lambda: rt.step_rows([Feed(y, [2])]), CapacityError)
            if d.engine_sampling:
                refused(rt, live, lambda: rt.step_sampled([Feed(y, [2])], [SampleSpec()]), CapacityError)
            # a whole copy of src needs a page even when full pages are shared
            if not d.copy_shares_cells or rt.seq_len(src) % page:
                refused(rt, live, lambda: rt.seq_copy(src, y, rt.seq_len(src)), CapacityError)
            blob = export_blob(rt, src)
            if blob is not None:
                refused(rt, live, lambda: rt.seq_import(y, blob), CapacityError)
            ss.free(x)
            assert rt.step([Feed(y, [2], True)])[0].shape == (d.vocab_size,)
            for s in [y, *fill]:
                ss.free(s)
            assert same(row_of(rt, src, [4]), replay_row(rt, src_tokens + [4])), "src did not go on as fed"


def check_bad_feed_all_or_nothing(f: RuntimeFactory) -> None:
    """A step with one bad feed (unknown seq, token out of the vocabulary,
    past max_seq_len, a sequence fed twice) changes nothing, and the good
    feeds' sequences continue as if it never ran."""
    with opened(f) as rt:
        d = rt.desc
        v, limit = d.vocab_size, d.max_seq_len
        h = ramp(rt, min(d.page + 1, limit - 2), start=3)
        with seqs_of(rt) as ss:
            a, b = ss.new(h), ss.new([5])
            gone = ss.new()
            ss.free(gone)
            bad: list[tuple[Feed, type[RuntimeFailure]]] = [
                (Feed(gone, [1], True), UnknownSequence),
                (Feed(b, [v], True), OutOfBounds),
                (Feed(b, [-1], True), OutOfBounds),
                (Feed(b, [1, v + 5], True), OutOfBounds),
                (Feed(a, [1], True), RuntimeFailure),  # a fed twice in one step
            ]
            free = rt.mem_counters().cells_total - rt.mem_counters().cells_used
            over = limit - rt.seq_len(b) + 1
            if rt.mem_counters().cells_total == 0 or free >= over + d.page:
                bad.append((Feed(b, [1] * over, True), OutOfBounds))
            if rt.mem_counters().cells_total == 0 or free >= limit + 2 * d.page:
                c = ss.new([2] * limit)
                assert rt.seq_len(c) == limit, "a sequence may hold exactly max_seq_len cells"
                bad.append((Feed(c, [1], True), OutOfBounds))
            live = list(ss.live)
            for feed, error in bad:
                good = Feed(a, [1], True)
                refused(rt, live, lambda: rt.step([good, feed]), error)
                refused(rt, live, lambda: rt.step([feed, good]), error)
                if has_step_rows(rt):
                    refused(rt, live, lambda: rt.step_rows([good, feed]), error)
                if d.engine_sampling:
                    refused(rt, live, lambda: rt.step_sampled([good, feed], [SampleSpec()] * 2), error)
            assert same(row_of(rt, a, [1]), replay_row(rt, h + [1]))
            assert same(row_of(rt, b, [1]), replay_row(rt, [5, 1]))


def check_cells_released(f: RuntimeFactory) -> None:
    """cells_released predicts what freeing releases; shared cells only count
    when every holder goes."""
    with opened(f) as rt:
        d = rt.desc
        page = d.page
        n = min(2 * page + 1, d.max_seq_len)
        with seqs_of(rt) as ss:
            assert rt.cells_released([]) == 0
            a = ss.new(ramp(rt, n))
            alone = rt.cells_released([a])
            assert alone == rt.cells_released([a, a]) >= n
            used = rt.mem_counters().cells_used
            ss.free(a)
            assert used - rt.mem_counters().cells_used == alone

            src, dst = ss.new(ramp(rt, n)), ss.new()
            rt.seq_copy(src, dst, n)
            both = rt.cells_released([src, dst])
            assert both == rt.mem_counters().cells_used
            if d.copy_shares_cells:
                assert rt.cells_released([src]) < both - n // page * page + page, "shared pages counted"
                assert rt.cells_released([src]) + rt.cells_released([dst]) < both
            else:
                assert rt.cells_released([src]) + rt.cells_released([dst]) == both
            for s in (src, dst):
                r, used = rt.cells_released([s]), rt.mem_counters().cells_used
                ss.free(s)
                assert used - rt.mem_counters().cells_used == r


def check_max_seqs(f: RuntimeFactory) -> None:
    with opened(f) as rt:
        cap = rt.desc.max_seqs
        if cap == 0:
            pytest.skip(f"{f.name}: unbounded sequences")
        with seqs_of(rt) as ss:
            made = [ss.new() for _ in range(cap)]
            assert rt.mem_counters().seqs == cap
            refused(rt, made, rt.seq_create, CapacityError)
            ss.free(made[0])
            ss.new()
