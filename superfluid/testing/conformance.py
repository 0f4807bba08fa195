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
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st
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
    FatalError,
    Feed,
    OutOfBounds,
    Runtime,
    RuntimeDescription,
    RuntimeFailure,
    SampleSpec,
    UnknownSequence,
    Unsupported,
)


@dataclasses.dataclass(frozen=True)
class RuntimeFactory:
    """A named way to get a fresh runtime with small, known limits."""

    name: str
    make: Callable[[], Runtime]  # called once per check (and per state-machine example): cache weights
    max_examples: int = 30  # hypothesis examples per property; lower for slow runtimes
    state_steps: int = 40  # rules per state-machine example
    paged_model: bool = False  # cells_used follows PagedPool exactly (the fakes do)


def _settings(f: RuntimeFactory) -> settings:
    return settings(max_examples=f.max_examples, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


# ------------------------------------------------------------------ helpers


@contextlib.contextmanager
def opened(f: RuntimeFactory) -> Iterator[Runtime]:
    rt = f.make()
    try:
        yield rt
    finally:
        rt.close()


class Seqs:
    """The sequences one example made; `done()` frees them and checks that the
    runtime is back to nothing held. On a failure they are freed quietly, so
    hypothesis can go on shrinking on the same runtime."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.live: list[int] = []

    def new(self, tokens: Sequence[int] = ()) -> int:
        s = self.rt.seq_create()
        self.live.append(s)
        if tokens:
            self.rt.step([Feed(s, list(tokens))])
        return s

    def free(self, s: int) -> None:
        self.live.remove(s)
        self.rt.seq_free(s)

    def done(self) -> None:
        for s in list(self.live):
            self.free(s)
        m = self.rt.mem_counters()
        assert (m.cells_used, m.seqs) == (0, 0), f"held after freeing everything: {m}"

    def drop(self) -> None:
        for s in self.live:
            with contextlib.suppress(RuntimeFailure):
                self.rt.seq_free(s)
        self.live.clear()


@contextlib.contextmanager
def seqs_of(rt: Runtime) -> Iterator[Seqs]:
    s = Seqs(rt)
    try:
        yield s
    except BaseException:
        s.drop()
        raise
    s.done()


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality of two rows."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def row_of(rt: Runtime, seq: int, tokens: Sequence[int]) -> np.ndarray:
    (row,) = rt.step([Feed(seq, list(tokens), wants_row=True)])
    return row


def replay_row(rt: Runtime, history: Sequence[int]) -> np.ndarray:
    """The row after `history`, fed in one step to a fresh sequence."""
    s = rt.seq_create()
    try:
        return row_of(rt, s, history)
    finally:
        rt.seq_free(s)


def rows_one_at_a_time(rt: Runtime, history: Sequence[int]) -> list[np.ndarray]:
    s = rt.seq_create()
    try:
        return [row_of(rt, s, [t]) for t in history]
    finally:
        rt.seq_free(s)


def counts(rt: Runtime) -> tuple[int, int, int]:
    """The counters an all-or-nothing failure must leave alone."""
    m = rt.mem_counters()
    return m.cells_total, m.cells_used, m.seqs


def lens(rt: Runtime, seqs: Sequence[int]) -> tuple[int, ...]:
    return tuple(rt.seq_len(s) for s in seqs)


@contextlib.contextmanager
def unchanged(rt: Runtime, seqs: Sequence[int]) -> Iterator[None]:
    before = (lens(rt, seqs), counts(rt))
    yield
    assert (lens(rt, seqs), counts(rt)) == before, "a refused call changed the runtime"


def refused(rt: Runtime, seqs: Sequence[int], call: Callable[[], object],
            error: type[RuntimeFailure] = RuntimeFailure) -> RuntimeFailure:
    """`call` raises `error` (never FatalError) and changes nothing."""
    with unchanged(rt, seqs), pytest.raises(error) as e:
        call()
    assert not isinstance(e.value, FatalError), f"a caller's mistake was fatal: {e.value!r}"
    return e.value


def has_step_rows(rt: Runtime) -> bool:
    return rt.step_rows([]) is not None


def export_blob(rt: Runtime, seq: int) -> bytes | None:
    """The export of seq, or None where the runtime cannot export."""
    try:
        return rt.seq_export(seq)
    except Unsupported:
        return None


def host_sampling():
    # Part of the package: an ImportError is a failure, not a reason to skip the draw check.
    return importlib.import_module("superfluid.kernels.reference_sampler")


def ramp(rt: Runtime, n: int, start: int = 0) -> list[int]:
    """n distinct-ish tokens: start, start+1, ... (mod vocab)."""
    return [(start + i) % rt.desc.vocab_size for i in range(n)]


def pages(n: int, page: int) -> int:
    return -(-n // page)


def room(rt: Runtime, seqs: int, lengths: Sequence[int]) -> bool:
    """Whether `seqs` more sequences holding `lengths` cells (a page of slack
    each) fit the runtime's limits: examples too big for a small runtime are
    skipped, not failed."""
    m, d = rt.mem_counters(), rt.desc
    if d.max_seqs and m.seqs + seqs > d.max_seqs:
        return False
    need = sum(pages(n, d.page) + 1 for n in lengths) * d.page
    return m.cells_total == 0 or m.cells_used + need <= m.cells_total


def history(rt: Runtime, max_len: int, min_len: int = 0, alphabet: int | None = None) -> st.SearchStrategy:
    v = rt.desc.vocab_size if alphabet is None else min(alphabet, rt.desc.vocab_size)
    return st.lists(st.integers(0, v - 1), min_size=min_len, max_size=min(max_len, rt.desc.max_seq_len))


def cut_points(n: int, *, whole_only: bool) -> st.SearchStrategy:
    """A length to cut a sequence of n to: any, or (no truncate_partial) 0 or n."""
    return st.sampled_from([0, n]) if whole_only else st.integers(0, n)


# ------------------------------------------------------------------ the pool model


class PagedPool:
    """Reference cell accounting of a paged pool, which the fakes follow
    exactly: a sequence holds ceil(len/page) blocks; a copy shares the full
    blocks of its source (when sharing) and takes a fresh block for the
    partial one; the first write into a partial block another sequence still
    holds copies it (one block); cells_used counts each block once."""

    def __init__(self, page: int, cells_total: int, shares: bool):
        self.page, self.total, self.shares = page, cells_total // page, shares
        self.rc: dict[int, int] = {}
        self.blocks: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self._next = 0

    def used(self) -> int:
        return len(self.rc) * self.page

    def fits(self, more_blocks: int) -> bool:
        return self.total == 0 or len(self.rc) + more_blocks <= self.total

    def _new(self) -> int:
        self._next += 1
        self.rc[self._next] = 1
        return self._next

    def _drop(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self.rc[b] -= 1
            if not self.rc[b]:
                del self.rc[b]

    def add(self, seq: int) -> None:
        self.blocks[seq], self.lens[seq] = [], 0

    def _cow(self, seq: int) -> bool:
        return self.lens[seq] % self.page != 0 and self.rc[self.blocks[seq][-1]] > 1

    def feed_need(self, feeds: Sequence[tuple[int, int]]) -> int:
        return sum(pages(self.lens[s] + k, self.page) - len(self.blocks[s]) + self._cow(s) for s, k in feeds)

    def feed(self, seq: int, k: int) -> None:
        if self._cow(seq):
            self._drop(self.blocks[seq][-1:])
            self.blocks[seq][-1] = self._new()
        self.lens[seq] += k
        while len(self.blocks[seq]) < pages(self.lens[seq], self.page):
            self.blocks[seq].append(self._new())

    def copy_need(self, src: int, dst: int, n: int) -> int:
        shared = n // self.page if self.shares else 0
        delta = collections.Counter(self.blocks[src][:shared])
        delta.subtract(self.blocks[dst])
        freed = sum(1 for b, k in delta.items() if self.rc[b] + k == 0)
        return pages(n, self.page) - shared - freed

    def copy(self, src: int, dst: int, n: int) -> None:
        shared = n // self.page if self.shares else 0
        kept = self.blocks[src][:shared]
        for b in kept:
            self.rc[b] += 1
        kept = kept + [self._new() for _ in range(pages(n, self.page) - shared)]
        self._drop(self.blocks[dst])
        self.blocks[dst], self.lens[dst] = kept, n

    def truncate(self, seq: int, n: int) -> None:
        keep = pages(n, self.page)
        self._drop(self.blocks[seq][keep:])
        del self.blocks[seq][keep:]
        self.lens[seq] = n

    def import_(self, seq: int, n: int) -> None:
        self.blocks[seq] = [self._new() for _ in range(pages(n, self.page))]
        self.lens[seq] = n

    def free(self, seq: int) -> None:
        self._drop(self.blocks.pop(seq))
        del self.lens[seq]

    def released(self, seqs: Sequence[int]) -> int:
        held = collections.Counter(b for s in set(seqs) for b in self.blocks[s])
        return self.page * sum(1 for b, k in held.items() if k == self.rc[b])


# ------------------------------------------------------------------ checks


def check_description(f: RuntimeFactory) -> None:
    """desc is coherent and survives the ABI record; a fresh runtime holds nothing."""
    with opened(f) as rt:
        d = rt.desc
        assert isinstance(d, RuntimeDescription)
        assert d.vocab_size >= 2 and d.max_seq_len >= 1 and d.page >= 1 and d.max_batch >= 1
        assert d.max_seqs >= 0 and d.prefill_step_tokens >= 0
        assert not (d.exact_only and d.truncate_partial), "a recurrent state cannot be cut back"
        assert d.engine_sampling or not d.engine_draws, "draws are a kind of engine sampling"
        assert RuntimeDescription.from_record(d.to_record()) == d
        m = rt.mem_counters()
        assert (m.cells_used, m.seqs) == (0, 0)
        assert m.cells_total == 0 or m.cells_total >= d.page


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


def check_rows_shape_and_order(f: RuntimeFactory) -> None:
    """One float32 (vocab,) finite row per feed that wants one, in feed order."""
    with opened(f) as rt:
        page, v = rt.desc.page, rt.desc.vocab_size
        n_max = min(4, rt.desc.max_batch)

        @_settings(f)
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

        @_settings(f)
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

        @_settings(f)
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

        @_settings(f)
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

        @_settings(f)
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


def check_copy(f: RuntimeFactory) -> None:
    """dst holds src's first n cells and continues exactly as a replay would;
    what dst held is dropped; src is untouched; shared copies cost at most
    the partial page, private ones at least their cells."""
    with opened(f) as rt:
        d = rt.desc
        page = d.page

        @_settings(f)
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

        @_settings(f)
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

        @_settings(f)
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

        @_settings(f)
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


def check_vocabulary_and_eos(f: RuntimeFactory) -> None:
    with opened(f) as rt:
        voc, v = rt.vocabulary(), rt.desc.vocab_size
        assert voc.size == v
        assert voc.eos and all(0 <= e < v for e in voc.eos)
        assert all(0 <= t < v for t in voc.specials.values())
        for t in sorted(set(range(min(v, 4096))) | set(voc.eos)):
            assert rt.is_eos(t) == (t in voc.eos), t


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
