"""Our logits equal HF transformers' on the same checkpoint (fp32, 1e-4):
after a prompt, after decode steps, and after copy/truncate, for every
supported architecture."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from superfluid.engine import Feed, load
from superfluid.engine.tiny import write_tiny

# make gpu-check runs these on the triton backend (SUPERFLUID_TEST_BACKEND=triton).
BACKEND = os.environ.get("SUPERFLUID_TEST_BACKEND", "torch")

transformers = pytest.importorskip("transformers")

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3"]
TOL = 1e-4


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    arch = request.param
    d = tmp_path_factory.mktemp(arch)
    if arch == "llama3":
        write_tiny(d, arch="llama", seed=11, rope_scaling="llama3", tokenizer=False)
    else:
        write_tiny(d, arch=arch, seed=7, tokenizer=False)
    rt = load(d, BACKEND, kv_cells=2048)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return rt, hf


def hf_row(hf, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1].float().numpy()


def test_after_a_prompt_and_decode_steps(pair):
    rt, hf = pair
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, rt.desc.vocab_size, 37).tolist()
    s = rt.seq_create()
    row = rt.step([Feed(s, prompt, True)])[0]
    np.testing.assert_allclose(row, hf_row(hf, prompt), atol=TOL, rtol=0)
    toks = list(prompt)
    for _ in range(6):
        toks.append(int(np.argmax(row)))
        row = rt.step([Feed(s, [toks[-1]], True)])[0]
        np.testing.assert_allclose(row, hf_row(hf, toks), atol=TOL, rtol=0)
    rt.seq_free(s)


def test_after_copy_and_truncate(pair):
    rt, hf = pair
    rng = np.random.default_rng(1)
    toks = rng.integers(0, rt.desc.vocab_size, 45).tolist()
    a = rt.seq_create()
    rt.step([Feed(a, toks, False)])
    b = rt.seq_create()
    rt.seq_copy(a, b, 21)  # a full block shared, a partial one copied
    row_b = rt.step([Feed(b, [7], True)])[0]
    np.testing.assert_allclose(row_b, hf_row(hf, toks[:21] + [7]), atol=TOL, rtol=0)
    rt.seq_truncate(a, 30)
    row_a = rt.step([Feed(a, [9, 10], True)])[0]
    np.testing.assert_allclose(row_a, hf_row(hf, toks[:30] + [9, 10]), atol=TOL, rtol=0)
    # b wrote into its own copy, not into a's blocks, and the reverse
    row_b2 = rt.step([Feed(b, [8], True)])[0]
    np.testing.assert_allclose(row_b2, hf_row(hf, toks[:21] + [7, 8]), atol=TOL, rtol=0)
    rt.seq_truncate(a, 16)  # a now ends on a block it shares with b
    row_a2 = rt.step([Feed(a, [3], True)])[0]
    np.testing.assert_allclose(row_a2, hf_row(hf, toks[:16] + [3]), atol=TOL, rtol=0)
    row_b3 = rt.step([Feed(b, [4], True)])[0]  # copy-on-write kept b's cells
    np.testing.assert_allclose(row_b3, hf_row(hf, toks[:21] + [7, 8, 4]), atol=TOL, rtol=0)
    rt.seq_free(a)
    rt.seq_free(b)
    assert rt.mem_counters().cells_used == 0


def test_ragged_step_matches_each_sequence(pair):
    rt, hf = pair
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, rt.desc.vocab_size, n).tolist() for n in (3, 40, 17, 1)]
    seqs = [rt.seq_create() for _ in prompts]
    rows = rt.step([Feed(s, p, True) for s, p in zip(seqs, prompts)])
    assert len(rows) == len(prompts)
    for r, p in zip(rows, prompts, strict=True):
        np.testing.assert_allclose(r, hf_row(hf, p), atol=TOL, rtol=0)
    for s in seqs:
        rt.seq_free(s)


def test_a_negative_control_would_be_caught(pair):
    # The comparison is sharp enough to see one wrong token in the history.
    rt, hf = pair
    s = rt.seq_create()
    row = rt.step([Feed(s, [1, 2, 3, 4], True)])[0]
    rt.seq_free(s)
    assert np.abs(row - hf_row(hf, [1, 2, 3, 5])).max() > TOL
