"""The triton backend end to end on a tiny checkpoint: logits close to the
torch backend's, and a lane's rows bitwise the same alone or batched."""

from __future__ import annotations

import numpy as np
import pytest

import superfluid.engine
from superfluid.engine.runtime import Feed
from superfluid.engine.tiny import write_tiny
from superfluid.kernels import decode_attention as da

pytestmark = pytest.mark.skipif(da.triton is None, reason="triton is not installed")

PROMPT = [5, 17, 200, 3, 99, 42, 7]
DECODE = [11, 250]


def _load(path, backend: str):
    return superfluid.engine.load(path, backend, kv_cells=512)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", seed=11, tokenizer=False)


def _prompt_then_decode(rt) -> np.ndarray:
    s = rt.seq_create()
    rows = [rt.step_rows([Feed(s, PROMPT, True)])[0]]
    for tok in DECODE:
        rows.append(rt.step([Feed(s, [tok], True)])[0][None])
    return np.concatenate(rows)


def test_triton_logits_match_the_torch_backend(tiny_dir):
    want = _prompt_then_decode(_load(tiny_dir, "torch"))
    got = _prompt_then_decode(_load(tiny_dir, "triton"))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_triton_rows_are_batch_invariant(tiny_dir):
    rt = _load(tiny_dir, "triton")
    alone = _prompt_then_decode(rt)
    # The same lane: its prompt in two chunks, each step shared with another
    # sequence's prefill or decode.
    lane, other = rt.seq_create(), rt.seq_create()
    rows = []
    first = rt.step_rows([Feed(other, [1, 2, 3, 4, 5], True), Feed(lane, PROMPT[:3], True)])
    rows.append(first[1])
    rows.append(rt.step_rows([Feed(lane, PROMPT[3:], True), Feed(other, [6], True)])[0])
    for i, tok in enumerate(DECODE):
        rows.append(rt.step([Feed(other, [7 + i, 8], True), Feed(lane, [tok], True)])[1][None])
    assert np.array_equal(np.concatenate(rows), alone)
