"""Batch and chunking invariance of the Mamba2 runtime, bitwise, at 1 and 2 torch threads.

A sequence's rows are the same bits alone or batched with others (prefills and decodes mixed,
in any order), however its prompt was cut into prefill feeds, after decodes and a prefill that
extends them (what a fresh prefill of all its tokens gives), and after a copy, an export and
import, or a truncate. Negative controls show the equalities are not vacuous: where chunks sit
changes the bits, the decode path and the chunk path differ, plain GEMMs differ across
batches, other tokens give other rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from superfluid.engine import CapacityError, Feed, OutOfBounds, load, mamba2_forward
from superfluid.engine.tiny_mamba2 import write_tiny_mamba2
from superfluid.kernels.ssd import ssd_chunk

VOCAB = 320
L = 8  # the chunk length the runtime is loaded with: short prompts cross several boundaries

SETTINGS = settings(max_examples=12, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def decode(seq: int, token: int, wants_row: bool = True) -> Feed:
    return Feed(seq, [token], wants_row, decode=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_mamba2(tmp_path_factory.mktemp("m2inv"), seed=5, vocab_size=VOCAB, n_groups=2)


@pytest.fixture(scope="module")
def runtime(ckpt):
    return load(ckpt, chunk_size=L, max_seqs=16, partial_truncate=True)


@pytest.fixture(params=[1, 2], ids=lambda n: f"threads{n}")
def rt(request, runtime):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield runtime
    torch.set_num_threads(old)
    for s in list(runtime.seqs):
        runtime.seq_free(s)


def solo(rt, prompt: tuple[int, ...], steps: tuple[int, ...] = ()) -> list[np.ndarray]:
    """The reference: alone, the prompt as one prefill feed, then one decode feed per step."""
    key = (torch.get_num_threads(), prompt, steps)
    if key not in _SOLO:
        s = rt.seq_create()
        rows = rt.step([Feed(s, list(prompt), True)])
        rows += [rt.step([decode(s, t)])[0] for t in steps]
        rt.seq_free(s)
        _SOLO[key] = rows
    return _SOLO[key]


_SOLO: dict = {}

tokens = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=26)


@st.composite
def lane(draw):
    prompt = draw(tokens)
    k = draw(st.integers(1, len(prompt)))
    points = sorted(draw(st.sets(st.integers(1, len(prompt) - 1), max_size=k)) if len(prompt) > 1 else [])
    pieces = [b - a for a, b in zip([0] + points, points + [len(prompt)])]
    steps = draw(st.lists(st.integers(0, VOCAB - 1), max_size=10))
    return prompt, pieces, steps


@SETTINGS
@given(lanes=st.lists(lane(), min_size=1, max_size=4), order=st.randoms(use_true_random=False))
def test_rows_do_not_depend_on_the_batch_nor_the_feeds(rt, lanes, order):
    seqs = [rt.seq_create() for _ in lanes]
    at = [0] * len(lanes)  # pieces fed
    done = [0] * len(lanes)  # decode steps fed
    got: list[list[tuple[str, int, np.ndarray]]] = [[] for _ in lanes]
    while True:
        feeds, who = [], []
        for i, (prompt, pieces, steps) in enumerate(lanes):
            if at[i] < len(pieces):
                start = sum(pieces[:at[i]])
                feeds.append(Feed(seqs[i], prompt[start:start + pieces[at[i]]], True))
                at[i] += 1
                who.append((i, "p", start + pieces[at[i] - 1]))
            elif done[i] < len(steps):
                feeds.append(decode(seqs[i], steps[done[i]]))
                done[i] += 1
                who.append((i, "d", done[i]))
        if not feeds:
            break
        perm = list(range(len(feeds)))
        order.shuffle(perm)
        rows = rt.step([feeds[p] for p in perm])
        for p, row in zip(perm, rows):
            i, kind, n = who[p]
            got[i].append((kind, n, row))
    for i, (prompt, _pieces, steps) in enumerate(lanes):
        for kind, n, row in got[i]:
            # A prefix's row is its own fresh prefill's; a decode row is the solo lane's.
            want = solo(rt, tuple(prompt[:n]))[0] if kind == "p" else solo(rt, tuple(prompt), tuple(steps))[n]
            assert np.array_equal(row, want), (i, kind, n)
    for s in seqs:
        rt.seq_free(s)


@SETTINGS
@given(prompt=tokens, steps=st.lists(st.integers(0, VOCAB - 1), max_size=12),
       more=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
       after=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3))
def test_a_prefill_after_decodes_is_a_fresh_prefill_of_all(rt, prompt, steps, more, after):
    s = rt.seq_create()
    rt.step([Feed(s, prompt)])
    for t in steps:
        rt.step([decode(s, t, False)])
    row = rt.step([Feed(s, more, True)])[0]  # a cache entry seeded for the next turn
    want = solo(rt, tuple(prompt + steps + more), tuple(after))
    assert np.array_equal(row, want[0])
    for t, w in zip(after, want[1:]):
        assert np.array_equal(rt.step([decode(s, t)])[0], w)
    rt.seq_free(s)


@SETTINGS
@given(prompt=tokens, steps=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
       after=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3))
def test_a_settled_sequence_decodes_as_a_fresh_prefill_of_all(rt, prompt, steps, after):
    # What the executor publishes: the lane's decoded tail redone the prefill way, so a lane
    # seeded from it that decodes at once decodes as one that prefilled everything.
    s, unsettled, blob = rt.seq_create(), rt.seq_create(), None
    rt.step([Feed(s, prompt)])
    for t in steps:
        rt.step([decode(s, t, False)])
    rt.seq_copy(s, unsettled, rt.seq_len(s))
    rt.seq_settle(s)
    blob = rt.seq_export(s)
    imp = rt.seq_create()
    rt.seq_import(imp, blob)
    fresh = rt.seq_create()
    rt.step([Feed(fresh, prompt + steps)])
    for t in after:
        want = rt.step([decode(fresh, t)])[0]
        got = rt.step([decode(s, t), decode(imp, t)])
        assert np.array_equal(got[0], want) and np.array_equal(got[1], want)
    # Control: without settling, the decoded tail's arithmetic shows.
    want = solo(rt, tuple(prompt + steps), (after[0],))[1]
    assert not np.array_equal(rt.step([decode(unsettled, after[0])])[0], want)
    for q in (s, unsettled, imp, fresh):
        rt.seq_free(q)


@SETTINGS
@given(prompt=tokens, steps=st.lists(st.integers(0, VOCAB - 1), max_size=10),
       extra=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
       then=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4), more=tokens)
def test_copy_export_import_and_truncate_continue_exactly(rt, prompt, steps, extra, then, more):
    src = rt.seq_create()
    rt.step([Feed(src, prompt)])
    for t in steps:
        rt.step([decode(src, t, False)])
    n = rt.seq_len(src)
    cp, imp, cut = rt.seq_create(), rt.seq_create(), rt.seq_create()
    rt.seq_copy(src, cp, n)
    rt.seq_import(imp, rt.seq_export(src))
    rt.seq_copy(src, cut, n)
    rt.step([Feed(cut, extra)])
    try:
        rt.seq_truncate(cut, n)  # back past the new tokens, if the state still reaches n
    except OutOfBounds:
        rt.seq_free(cut)
        cut = None
    # Copy and import continue as the source does, bitwise (live state included).
    for t in then:
        rows = rt.step([decode(s, t) for s in (src, cp, imp)])
        assert np.array_equal(rows[0], rows[1]) and np.array_equal(rows[0], rows[2])
    rows = rt.step([Feed(s, more, True) for s in (src, cp, imp)])
    assert np.array_equal(rows[0], rows[1]) and np.array_equal(rows[0], rows[2])
    assert np.array_equal(rows[0], solo(rt, tuple(prompt + steps + then + more))[0])
    if cut is not None:
        # A cut sequence continues as a fresh prefill of what it kept (its live state is rebuilt).
        want = solo(rt, tuple(prompt + steps), tuple(then))
        for t, w in zip(then, want[1:]):
            assert np.array_equal(rt.step([decode(cut, t)])[0], w)
    for s in (src, cp, imp) + ((cut,) if cut else ()):
        rt.seq_free(s)


def test_a_refused_step_or_create_changes_no_row(rt, ckpt):
    a, b = rt.seq_create(), rt.seq_create()
    rt.step([Feed(a, [1, 2, 3, 4, 5]), Feed(b, [7, 8])])
    with pytest.raises(OutOfBounds):
        rt.step([decode(a, 6), Feed(b, [9, VOCAB])])  # the bad token is in the second feed
    rows = rt.step([decode(a, 6), Feed(b, [9, 10], True)])
    assert np.array_equal(rows[0], solo(rt, (1, 2, 3, 4, 5), (6,))[1])
    assert np.array_equal(rows[1], solo(rt, (7, 8, 9, 10))[0])
    small = load(ckpt, chunk_size=L, max_seqs=1)
    s = small.seq_create()
    small.step([Feed(s, [1, 2, 3])])
    with pytest.raises(CapacityError):
        small.seq_create()
    assert np.array_equal(small.step([Feed(s, [4], True)])[0], solo(rt, (1, 2, 3, 4))[0])


# ------------------------------------------------------------------ negative controls


def test_where_chunks_sit_changes_the_bits():
    """The same 20 tokens through chunks at 0, 8, 16 and through chunks at 0, 5, 13 (as a
    runtime that chunked relative to its feeds would): close, not bitwise equal."""
    g = torch.Generator().manual_seed(0)
    n, H, P, G, S = 20, 4, 8, 2, 16
    x = torch.randn(n, H, P, generator=g)
    B, C = torch.randn(n, G, S, generator=g), torch.randn(n, G, S, generator=g)
    dt, A = torch.rand(n, H, generator=g) * 0.5, -torch.rand(H, generator=g) - 0.1

    def run(starts):
        h, ys = torch.zeros(1, H, P, S), []
        for a, b in zip(starts, starts[1:] + [n]):
            pad = lambda t: torch.cat([t[a:b], t.new_zeros((L - (b - a),) + t.shape[1:])])[None]  # noqa: E731
            y, h = ssd_chunk(pad(x), pad(dt), A, pad(B), pad(C), h)
            ys.append(y[0, :b - a])
        return torch.cat(ys), h

    (ya, ha), (yb, hb) = run([0, 8, 16]), run([0, 5, 13])
    assert torch.allclose(ya, yb, atol=1e-5) and torch.allclose(ha, hb, atol=1e-5)
    assert not torch.equal(ya[13:], yb[13:]) or not torch.equal(ha, hb)


def test_negative_controls_through_the_runtime(ckpt, monkeypatch):
    # The torch linears (kernels/linear.py), so the last control can swap in a plain GEMM.
    monkeypatch.setenv("SUPERFLUID_CPU_KERNELS", "0")
    rt = load(ckpt, chunk_size=L, max_seqs=8)
    monkeypatch.delenv("SUPERFLUID_CPU_KERNELS")
    prompt = list(range(3, 23))

    def row(r, toks, steps=()):
        s = r.seq_create()
        out = r.step([Feed(s, toks, True)])[0]
        for t in steps:
            out = r.step([decode(s, t)])[0]
        r.seq_free(s)
        return out

    # Another chunk length: the same model, other bits.
    other = row(load(ckpt, chunk_size=2 * L, max_seqs=1), prompt)
    assert np.allclose(other, row(rt, prompt), atol=1e-4) and not np.array_equal(other, row(rt, prompt))
    # The decode path and the chunk path for the same last token: other bits.
    assert not np.array_equal(row(rt, prompt[:-1], [prompt[-1]]), row(rt, prompt))
    # Another token early on: another row.
    assert not np.array_equal(row(rt, [0] + prompt[1:]), row(rt, prompt))
    # Plain GEMMs (no token padding): a decode row alone (a GEMV here) and in a decode round of
    # five differ, which the invariant linear keeps bitwise equal.
    def decoded_with(others: int, plain: bool) -> np.ndarray:
        with monkeypatch.context() as m:
            if plain:
                m.setattr(mamba2_forward, "_linear", lambda x, w, b=None: x @ w.T + (0 if b is None else b))
            seqs = [rt.seq_create() for _ in range(1 + others)]
            rt.step([Feed(s, prompt[:-1] if i == 0 else [i] * (i + 2)) for i, s in enumerate(seqs)])
            out = rt.step([decode(s, prompt[-1] if i == 0 else 1) for i, s in enumerate(seqs)])[0]
            for s in seqs:
                rt.seq_free(s)
            return out

    assert np.array_equal(decoded_with(0, False), decoded_with(4, False))
    assert not np.array_equal(decoded_with(0, True), decoded_with(4, True)), \
        "the batch check would not catch a plain GEMM"
