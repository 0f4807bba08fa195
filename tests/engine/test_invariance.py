"""Batch invariance by construction: a feed's rows are bitwise identical
whatever else shares its step, in any order, and however its tokens were
chunked. Checked on the paged transformer runtime, torch backend (the
Triton backend is checked in tests/kernels)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from superfluid.engine import Feed, load
from superfluid.engine.tiny import write_tiny

# make gpu-check runs these on the triton backend (SUPERFLUID_TEST_BACKEND=triton).
BACKEND = os.environ.get("SUPERFLUID_TEST_BACKEND", "torch")


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    d = tmp_path_factory.mktemp("inv")
    write_tiny(d, arch="qwen3", seed=5, tokenizer=False)
    return load(d, BACKEND, kv_cells=16384)


def run(rt, prompts, *, chunk, batched, order, decode_steps=3):
    """Prefill every prompt (chunks of chunk(i) tokens), then greedy-decode;
    the rows each lane got, in order."""
    seqs = {i: rt.seq_create() for i in range(len(prompts))}
    rows: dict[int, list[np.ndarray]] = {i: [] for i in seqs}
    pos = dict.fromkeys(seqs, 0)
    while any(pos[i] < len(prompts[i]) for i in seqs):
        feeds = []
        for i in order:
            if pos[i] < len(prompts[i]):
                n = min(chunk(i), len(prompts[i]) - pos[i])
                feeds.append((i, Feed(seqs[i], prompts[i][pos[i]:pos[i] + n], pos[i] + n == len(prompts[i]))))
                pos[i] += n
        for group in ([feeds] if batched else [[f] for f in feeds]):
            got = iter(rt.step([f for _, f in group]))
            for i, f in group:
                if f.wants_row:
                    rows[i].append(next(got))
    for _ in range(decode_steps):
        feeds = [(i, Feed(seqs[i], [int(np.argmax(rows[i][-1]))], True)) for i in order]
        for group in ([feeds] if batched else [[f] for f in feeds]):
            for (i, _), r in zip(group, rt.step([f for _, f in group])):
                rows[i].append(r)
    for s in seqs.values():
        rt.seq_free(s)
    return rows


def same(a, b) -> bool:
    return all(len(a[i]) == len(b[i]) and all(np.array_equal(x, y) for x, y in zip(a[i], b[i])) for i in a)


@settings(max_examples=12, deadline=None)
@given(st.data())
def test_rows_do_not_depend_on_batch_order_or_chunking(runtime, data):
    rng = random.Random(data.draw(st.integers(0, 10**6)))
    v = runtime.desc.vocab_size
    prompts = [[rng.randrange(v) for _ in range(rng.randrange(1, 90))] for _ in range(data.draw(st.integers(1, 5)))]
    solo = run(runtime, prompts, chunk=lambda i: 10**9, batched=False, order=list(range(len(prompts))))
    order = data.draw(st.permutations(list(range(len(prompts)))))
    sizes = data.draw(st.lists(st.integers(1, 40), min_size=len(prompts), max_size=len(prompts)))
    other = run(runtime, prompts, chunk=lambda i: sizes[i], batched=data.draw(st.booleans()), order=order)
    assert same(solo, other)


def test_a_lane_alone_equals_the_lane_among_strangers(runtime):
    rng = random.Random(3)
    v = runtime.desc.vocab_size
    lane = [rng.randrange(v) for _ in range(50)]
    strangers = [[rng.randrange(v) for _ in range(n)] for n in (1, 7, 130, 64)]
    alone = run(runtime, [lane], chunk=lambda i: 10**9, batched=False, order=[0])
    crowd = run(runtime, [lane] + strangers, chunk=lambda i: 9, batched=True, order=[3, 0, 4, 1, 2])
    assert len(alone[0]) == len(crowd[0]) > 0
    assert all(np.array_equal(x, y) for x, y in zip(alone[0], crowd[0], strict=True))


def test_negative_control_invariance_off_is_not_bitwise(tmp_path):
    """The same checks against plain GEMMs and a plain softmax find
    differences: the property is not vacuous on this machine."""
    write_tiny(tmp_path, arch="llama", seed=5, tokenizer=False, hidden_size=256, intermediate_size=512,
               num_heads=4, num_kv_heads=2)
    rt = load(tmp_path, "torch", kv_cells=16384, invariant=False)
    rng = random.Random(4)
    v = rt.desc.vocab_size
    prompts = [[rng.randrange(v) for _ in range(n)] for n in (3, 61, 18, 44, 90, 5)]
    solo = run(rt, prompts, chunk=lambda i: 10**9, batched=False, order=list(range(6)))
    other = run(rt, prompts, chunk=lambda i: 5 + i, batched=True, order=[5, 2, 0, 1, 4, 3])
    assert not same(solo, other)
