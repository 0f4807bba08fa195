"""kernels/cpu_step.py: a small step's layout built in Python into one
buffer is the numpy layout, tensor for tensor, with the same bounds and
pointers the C side reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from superfluid.kernels import cpu_step
from superfluid.kernels.cpu_step import StepLayout, step_layout


@st.composite
def steps(draw):
    page = draw(st.sampled_from([1, 4, 16]))
    feeds = []
    for _ in range(draw(st.integers(1, 6))):
        start = draw(st.integers(0, 40))
        k = draw(st.integers(1, 9))
        blocks = -(-(start + k) // page)
        table = draw(st.lists(st.integers(0, 500), min_size=blocks, max_size=blocks + 2))
        feeds.append((table, start, k))
    return feeds, page


@settings(max_examples=60, deadline=None)
@given(step=steps(), with_ids=st.booleans())
def test_the_small_layout_is_the_numpy_layout(step, with_ids):
    feeds, page = step
    n = sum(f[2] for f in feeds)
    ids = list(range(7, 7 + n)) if with_ids else None
    small = step_layout(feeds, page, ids)
    big = cpu_step._numpy_layout(feeds, page, ids)
    assert small._buf is not None and big._buf is None  # the two builders, not one twice
    for name in ("positions", "cells", "feed_of", "tables"):
        assert torch.equal(getattr(small, name), getattr(big, name)), name
    assert (small.n, small.nf, small.width, small.bounds) == (big.n, big.nf, big.width, big.bounds)
    assert small.has_ids == big.has_ids == with_ids
    if with_ids:
        assert small.ids.tolist() == big.ids.tolist() == ids


def test_pointers_read_the_layout_in_place():
    from superfluid.kernels.cpu import ffi

    if ffi is None:
        pytest.skip("the CPU kernels are not built")
    lay = step_layout([([3, 9], 17, 2), ([5], 2, 1)], 16, [11, 12, 13])
    pos, cells, feed_of, tables, ids = lay.pointers(ffi)
    assert [pos[i] for i in range(3)] == [17, 18, 2]
    assert [cells[i] for i in range(3)] == [9 * 16 + 1, 9 * 16 + 2, 5 * 16 + 2]
    assert [feed_of[i] for i in range(3)] == [0, 0, 1]
    assert [tables[i] for i in range(4)] == [3, 9, 5, 0]
    assert [ids[i] for i in range(3)] == [11, 12, 13]
    assert lay.bounds == (18, 146, 9)
    # a layout of tensors (a tensor-parallel rank's) gives its tensors' pointers
    t = StepLayout(lay.positions.clone(), lay.cells.clone(), lay.feed_of.clone(), lay.tables.clone(), 16)
    assert t.pointers(ffi)[4] == ffi.NULL and t.pointers(ffi)[0][2] == 2
    with pytest.raises(ValueError, match="contiguous int64"):
        StepLayout(lay.positions.int(), lay.cells, lay.feed_of, lay.tables, 16).pointers(ffi)


def test_ids_must_cover_the_tokens_and_a_wide_step_takes_numpy():
    with pytest.raises(ValueError, match="2 ids for 3 tokens"):
        step_layout([([1], 0, 3)], 4, [1, 2])
    wide = step_layout([(list(range(40)), 0, cpu_step.SMALL_STEP + 1)], 16)
    assert wide._buf is None and wide.n == cpu_step.SMALL_STEP + 1
    assert np.array_equal(wide.positions.numpy(), np.arange(cpu_step.SMALL_STEP + 1))
