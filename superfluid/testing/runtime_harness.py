"""What the runtime conformance checks (superfluid.testing.conformance) share:
the factory a check gets, its hypothesis settings, sequences freed and checked
at the end of an example, rows read bitwise, calls that must be refused and
change nothing, and the strategies that size examples to a runtime."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as st

from superfluid.engine.runtime import (
    FatalError,
    Feed,
    Runtime,
    RuntimeFailure,
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


def example_settings(f: RuntimeFactory) -> settings:
    return settings(max_examples=f.max_examples, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


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


def play(rt: Runtime, script: Sequence[Sequence[tuple[int, Sequence[int]]]]) -> list[bytes]:
    """Run a script of steps (each: (name, tokens) feeds; a name's first feed
    makes its sequence) and free the sequences: every row, as bytes."""
    seqs: dict[int, int] = {}
    out = []
    for step in script:
        feeds = []
        for name, tokens in step:
            if name not in seqs:
                seqs[name] = rt.seq_create()
            feeds.append(Feed(seqs[name], list(tokens), True))
        out += [r.tobytes() for r in rt.step(feeds)]
    for s in seqs.values():
        rt.seq_free(s)
    return out


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
