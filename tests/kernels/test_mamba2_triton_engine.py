"""The Mamba2 runtime on the Triton kernels (kernels/ssd_triton.py) end to end,
under the interpreter at a tiny shape: rows close to the torch backend's
through chunked prefill (across chunk boundaries), decode and a settle, and a
sequence's rows bitwise the same alone or batched."""

from __future__ import annotations

import numpy as np
import pytest

from superfluid.engine.loader import load
from superfluid.engine.runtime import Feed
from superfluid.engine.tiny_mamba2 import write_tiny_mamba2
from superfluid.kernels import ssd_triton

pytestmark = pytest.mark.skipif(ssd_triton.triton is None, reason="triton is not installed")

PROMPT = [5, 17, 90, 3, 61, 42, 7, 8, 33, 2, 71]  # crosses two chunks of 4
DECODE = [11, 50, 23, 9, 4]  # the third completes a chunk: b moves in decode


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_mamba2(tmp_path_factory.mktemp("m2t"), seed=4, vocab_size=96, hidden_size=32, num_heads=4,
                             state_size=8, n_groups=2, num_layers=2, chunk_size=4)


def _rows(rt, other: bool) -> list[np.ndarray]:
    s = rt.seq_create()
    o = rt.seq_create() if other else None
    first = [Feed(s, PROMPT[:6]), *([Feed(o, [1, 2, 3])] if other else [])]
    rt.step(first)
    rows = rt.step([*([Feed(o, [4])] if other else []), Feed(s, PROMPT[6:], True)])[-1:]
    for t in DECODE:
        got = rt.step([Feed(s, [t], True, decode=True), *([Feed(o, [t], True, decode=True)] if other else [])])
        rows.append(got[0])
    rt.seq_settle(s)
    rows += rt.step([Feed(s, [6, 6], True)])
    return rows


def test_triton_rows_match_torch_and_do_not_depend_on_the_batch(ckpt):
    tri = load(ckpt, "triton", max_seqs=4)
    ref = _rows(load(ckpt, "torch", max_seqs=4), False)
    alone = _rows(tri, False)
    batched = _rows(load(ckpt, "triton", max_seqs=4), True)
    for a, b, r in zip(alone, batched, ref):
        assert np.array_equal(a, b)
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-4)
    assert len(alone) == 2 + len(DECODE)
    assert not np.allclose(alone[1], alone[2], atol=1e-3)  # (the rows are not all one row)
