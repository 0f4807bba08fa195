"""Batch invariance at real widths (issue 9, item 2): a Llama of hidden 512,
ffn 1536, vocab 32000, 8 heads / 4 kv heads, two layers, at 1 and 2 threads,
in fp32 and bf16. A lane's rows are bitwise the same alone or among 31 other
feeds (prefill and decode steps, shuffled), however its prompt is chunked,
and whatever the decode batch size. The small models of test_invariance.py
never reach the K >= 1024 reductions where a plain GEMM's thread split starts
to depend on M; these do, and the negative control shows it."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from superfluid.engine import Feed, load
from superfluid.engine.tiny import write_tiny

# make gpu-check runs these on the triton backend (SUPERFLUID_TEST_BACKEND=triton).
BACKEND = os.environ.get("SUPERFLUID_TEST_BACKEND", "torch")

WIDE = dict(arch="llama", tokenizer=False, hidden_size=512, intermediate_size=1536, vocab_size=32000,
            num_layers=2, num_heads=8, num_kv_heads=4)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DECODE_STEPS = 3
# The 31 others: mixed lengths, some past one 64-cell attention chunk, some past two.
OTHER_LENGTHS = [1, 2, 140, 3, 5, 70, 1, 8, 13, 1, 21, 2, 65, 4, 1, 3,   # prefilled with the lane
                 129, 1, 6, 2, 9, 1, 33, 2, 4, 1, 67, 3, 1, 5, 2]         # arriving during its decode


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("wide")
    write_tiny(d, seed=21, **WIDE)
    return d


@pytest.fixture(scope="module")
def runtimes(wide_dir):
    """(dtype name, invariant, threads) -> runtime, loaded once each under
    that thread count (a kernel may size its work by the threads at load)."""
    cache = {}

    def get(dtype: str, invariant: bool = True):
        key = (dtype, invariant, torch.get_num_threads())
        if key not in cache:
            cache[key] = load(wide_dir, BACKEND, kv_cells=8192, dtype=DTYPES[dtype], invariant=invariant)
        return cache[key]

    yield get
    for rt in cache.values():
        rt.close()


@pytest.fixture(params=[1, 2], ids=lambda n: f"threads{n}")
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


@pytest.fixture(params=list(DTYPES))
def rt(request, threads, runtimes):
    return runtimes(request.param)


def diff(a: np.ndarray, b: np.ndarray) -> str | None:
    """None when bitwise equal, else what differs (for the failure message)."""
    if a.shape == b.shape and np.array_equal(a, b):
        return None
    if a.shape != b.shape:
        return f"shapes {a.shape} vs {b.shape}"
    return f"max |diff| {np.abs(a.astype(np.float64) - b).max():.3g}"


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def sane(rows) -> None:
    for r in rows:
        assert r.dtype == np.float32 and np.isfinite(r).all() and r.std() > 0


# ------------------------------------------------------------------ checks
# Each returns the list of differences it found (empty: invariant), so the
# negative control runs exactly the checks the positive tests run.

def check_crowd(rt, seed: int) -> list[str]:
    """A lane's prefill row and decode rows alone vs among 31 others: 16
    prefilled in its step, 15 arriving (prefill) during its decode steps,
    every step's feed order shuffled, some others wanting no row."""
    rng = random.Random(seed)
    v = rt.desc.vocab_size
    prompt = tokens(rng, 77, v)
    lane = rt.seq_create()
    alone = [rt.step([Feed(lane, prompt, True)])[0]]
    forced = []  # the lane's decode tokens: its own greedy choices alone, fed to both runs
    for _ in range(DECODE_STEPS):
        forced.append(int(np.argmax(alone[-1])))
        alone.append(rt.step([Feed(lane, [forced[-1]], True)])[0])
    rt.seq_free(lane)
    sane(alone)

    lengths = OTHER_LENGTHS[:]
    rng.shuffle(lengths)
    others = [(rt.seq_create(), tokens(rng, n, v)) for n in lengths]
    first, later = others[:16], [others[16 + 5 * k:21 + 5 * k] for k in range(DECODE_STEPS)]
    lane = rt.seq_create()
    live, crowd, where = [], [], []
    for step in range(DECODE_STEPS + 1):
        feeds = [Feed(lane, prompt if step == 0 else [forced[step - 1]], True)]
        feeds += [Feed(s, [rng.randrange(v)], rng.random() < 0.8) for s in live]
        arriving = first if step == 0 else later[step - 1]
        feeds += [Feed(s, p, rng.random() < 0.7) for s, p in arriving]
        live += [s for s, _ in arriving]
        assert len(feeds) <= 32
        rng.shuffle(feeds)
        at = next(i for i, f in enumerate(feeds) if f.seq == lane)
        rows = rt.step(feeds)
        crowd.append(rows[sum(f.wants_row for f in feeds[:at])])
        where.append(f"{at} of {len(feeds)}")
    rt.seq_free(lane)
    for s in live:
        rt.seq_free(s)
    bad = []
    for i, (a, c) in enumerate(zip(alone, crowd, strict=True)):
        if (d := diff(a, c)) is not None:
            bad.append(f"{'prefill' if i == 0 else f'decode {i}'} row (lane at {where[i]}): {d}")
    return bad


SCHEDULES = ([1, 7, 33, 64, 30], [70, 1, 64])  # each 135 tokens; chunks cross 16- and 64-cell edges


def check_chunks(rt, seed: int) -> list[str]:
    """A 135-token prompt whole vs in chunks: every token's row (step_rows)
    and each chunk's last row (step) equal the whole prompt's."""
    rng = random.Random(seed)
    prompt = tokens(rng, 135, rt.desc.vocab_size)
    s = rt.seq_create()
    whole = rt.step_rows([Feed(s, prompt, True)])[0]
    rt.seq_free(s)
    s = rt.seq_create()
    last = rt.step([Feed(s, prompt, True)])[0]
    rt.seq_free(s)
    sane([whole[0], whole[-1], last])
    bad = [f"step's last row vs step_rows': {d}"] if (d := diff(last, whole[-1])) else []
    for sched in SCHEDULES:
        assert sum(sched) == len(prompt)
        a, b = rt.seq_create(), rt.seq_create()
        at = 0
        for n in sched:
            rows = rt.step_rows([Feed(a, prompt[at:at + n], True)])[0]
            if (d := diff(rows, whole[at:at + n])) is not None:
                bad.append(f"{sched} step_rows of tokens {at}..{at + n - 1}: {d}")
            row = rt.step([Feed(b, prompt[at:at + n], True)])[0]
            if (d := diff(row, whole[at + n - 1])) is not None:
                bad.append(f"{sched} step row of token {at + n - 1}: {d}")
            at += n
        rt.seq_free(a)
        rt.seq_free(b)
    return bad


BATCHES = (1, 2, 5, 32)


def check_decode_batches(rt, seed: int) -> list[str]:
    """The lane's decode rows in a decode batch of 1, 2, 5 and 32 (its place
    moving each step; the others of mixed lengths) are equal. Every batch
    starts from copies (seq_copy) of the same prefilled sequences."""
    rng = random.Random(seed)
    v = rt.desc.vocab_size
    lengths = [140, 3, 70, 1] + [rng.randrange(1, 30) for _ in range(27)]
    lane0, others0 = rt.seq_create(), [rt.seq_create() for _ in lengths]
    row = rt.step([Feed(lane0, tokens(rng, 40, v), True)])[0]
    rt.step([Feed(s, tokens(rng, n, v), False) for s, n in zip(others0, lengths)])
    forced = [int(np.argmax(row))] + [rng.randrange(v) for _ in range(DECODE_STEPS - 1)]
    other_tokens = [[rng.randrange(v) for _ in range(DECODE_STEPS)] for _ in lengths]
    got = {}
    for batch in BATCHES:
        lane, others = rt.seq_create(), [rt.seq_create() for _ in range(batch - 1)]
        for src, dst in zip([lane0] + others0, [lane] + others):
            rt.seq_copy(src, dst, rt.seq_len(src))
        got[batch] = []
        for k in range(DECODE_STEPS):
            feeds = [Feed(s, [t[k]], True) for s, t in zip(others, other_tokens)]
            at = (3 * k + 1) % batch
            feeds.insert(at, Feed(lane, [forced[k]], True))
            got[batch].append(rt.step(feeds)[at])
        for s in [lane] + others:
            rt.seq_free(s)
    for s in [lane0] + others0:
        rt.seq_free(s)
    sane(got[1])
    return [f"decode {k + 1}, batch {b} vs 1: {d}" for b in BATCHES[1:] for k in range(DECODE_STEPS)
            if (d := diff(got[1][k], got[b][k])) is not None]


# ------------------------------------------------------------------- tests

@pytest.mark.parametrize("seed", [1, 2])
def test_a_lane_alone_equals_the_lane_among_31_others(rt, seed):
    bad = check_crowd(rt, seed)
    assert not bad, "; ".join(bad)


def test_chunked_prefill_gives_the_whole_prompts_rows(rt):
    bad = check_chunks(rt, 3)
    assert not bad, "; ".join(bad)


def test_decode_rows_do_not_depend_on_the_batch_size(rt):
    bad = check_decode_batches(rt, 4)
    assert not bad, "; ".join(bad)


def test_negative_control_a_plain_gemm_path_is_caught(runtimes):
    """The same checks against plain torch.mm GEMMs and a plain softmax
    attention (invariant=False) at 2 threads find differences. On this
    machine (2-core AMD EPYC, AVX2, no AVX-512) every check finds 2e-6..3e-6
    at 1 and 2 threads alike: MKL picks its kernel, and so its summation
    order, by M. (The issue measured 1e-6 on an AVX-512 box, where the
    split across threads also depends on M: today's invariant path passes
    these tests here at 1, 2, 4 and 8 threads.)"""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rt = runtimes("fp32", invariant=False)
        found = {"crowd": check_crowd(rt, 1), "chunks": check_chunks(rt, 3),
                 "decode batches": check_decode_batches(rt, 4)}
    finally:
        torch.set_num_threads(old)
    missed = [name for name, bad in found.items() if not bad]
    assert not missed, f"the plain path passed the {missed} check(s): they would not catch it"
