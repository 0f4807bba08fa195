"""Tensor parallelism on the torch and Triton backends (engine/blocked.py,
engine/parallel/tp_torch.py): the path a GPU takes. Here on the CPU, with
the torch reference ops (SUPERFLUID_CPU_KERNELS=0) or Triton's interpreter;
`make gpu-check` runs this file on a GPU with SUPERFLUID_TEST_BACKEND=triton
(two ranks on one GPU through host copies, or NCCL where there are two).

Rows are bitwise TP=1's at TP=2 and TP=4 (replicated KV heads), batched or
alone; a plain all-reduce changes them (the negative control); and the
blocked computation is the model's (it agrees with the C kernels' path to
rounding: an equality between degrees could not see a layout bug that every
degree shares)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from superfluid.engine import Feed, SampleSpec, load
from superfluid.engine.config import load_config
from superfluid.engine.parallel.sharding import Shard, TpError, kv_block_heads, vocab_blocks, vocab_ranges
from superfluid.engine.tiny import write_tiny
from superfluid.kernels import cpu
from superfluid.testing.runtime_harness import play

BACKEND = os.environ.get("SUPERFLUID_TEST_BACKEND", "torch")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KV_CELLS = 1024


@pytest.fixture(scope="module", autouse=True)
def reference_ops():
    """The torch backend's reference ops, not the C kernels (every rank gets
    the choice in its spec)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("SUPERFLUID_CPU_KERNELS", "0")
    yield
    mp.undo()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp("tpb") / "llama", seed=3))


@pytest.fixture(scope="module")
def runtimes(tiny, reference_ops):
    rts = {1: load(tiny, BACKEND, device=DEVICE, kv_cells=KV_CELLS),
           2: load(tiny, BACKEND, device=DEVICE, tp=2, kv_cells=KV_CELLS),
           4: load(tiny, BACKEND, device=DEVICE, tp=4, kv_cells=KV_CELLS, tp_options=dict(transport="gloo"))}
    yield rts
    for rt in rts.values():
        rt.close()


steps = st.lists(st.lists(st.integers(0, 319), min_size=1, max_size=10), min_size=1, max_size=3)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=steps, decode=st.lists(st.integers(0, 319), min_size=1, max_size=3), alone=st.booleans())
def test_rows_are_the_same_at_every_degree(runtimes, prompts, decode, alone):
    script = [[(i, p) for i, p in enumerate(prompts)]]
    script += [[(i, [t]) for i in range(len(prompts))] for t in decode]
    if alone:
        script = [[f] for step in script for f in step]
    base = play(runtimes[1], script)
    for n in (2, 4):
        assert play(runtimes[n], script) == base, f"TP={n}"


def test_sampling_and_exports_across_degrees(runtimes):
    outs = {}
    for n, rt in runtimes.items():
        a, b = rt.seq_create(), rt.seq_create()
        rows = rt.step_rows([Feed(a, list(range(1, 19))), Feed(b, [40, 41])])
        toks = rt.step_sampled([Feed(a, [19]), Feed(b, [42])], [SampleSpec(0.8, 20, 0.9, 0.0, 7), SampleSpec(0.0)])
        outs[n] = ([r.tobytes() for r in rows], toks, rt.seq_export(a))
        for s in (a, b):
            rt.seq_free(s)
    assert outs[2] == outs[1] and outs[4] == outs[1]
    cont = {}
    for n, rt in runtimes.items():
        s = rt.seq_create()
        rt.seq_import(s, outs[2][2])
        cont[n] = rt.step([Feed(s, [77], True)])[0].tobytes()
        rt.seq_free(s)
    assert cont[2] == cont[1] and cont[4] == cont[1]


def test_a_plain_all_reduce_changes_bits(tiny, runtimes):
    script = [[(0, list(range(5, 45))), (1, [9, 8, 7])], [(0, [3]), (1, [4])]]
    rt = load(tiny, BACKEND, device=DEVICE, tp=2, kv_cells=KV_CELLS, tp_options=dict(plain_reduce=True))
    try:
        plain = play(rt, script)
    finally:
        rt.close()
    assert plain != play(runtimes[1], script)


@pytest.mark.skipif(not cpu.available(), reason="the C kernels are the other side of this comparison")
def test_the_blocks_compute_the_model(tiny, runtimes, monkeypatch):
    """TP=2 on these ops against TP=1 on the C kernels (themselves checked
    against Hugging Face): equal to rounding, so a block in the wrong place,
    the same at every degree, would show here."""
    script = [[(0, list(range(5, 40))), (1, [9, 8, 7])], [(0, [3]), (1, [4])]]
    monkeypatch.delenv("SUPERFLUID_CPU_KERNELS")
    c = load(tiny, kv_cells=KV_CELLS)
    try:
        want = [np.frombuffer(r, dtype=np.float32) for r in play(c, script)]
    finally:
        c.close()
    got = [np.frombuffer(r, dtype=np.float32) for r in play(runtimes[2], script)]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch,dtype,kv", [("qwen3", "float32", 2), ("qwen2", "bfloat16", 4)])
def test_architectures_and_bf16(tmp_path, arch, dtype, kv):
    """Qwen3's q/k norms, Qwen2's q/k/v biases, bf16 weights and KV."""
    path = str(write_tiny(tmp_path / arch, arch=arch, seed=5, num_heads=4, num_kv_heads=kv))
    script = [[(0, [5, 6, 7, 8, 9, 10, 11]), (1, [12])], [(0, [13]), (1, [14])]]
    one = load(path, BACKEND, device=DEVICE, kv_cells=256, dtype=dtype)
    two = load(path, BACKEND, device=DEVICE, tp=2, kv_cells=256, dtype=dtype)
    try:
        assert play(two, script) == play(one, script)
    finally:
        one.close()
        two.close()


def test_real_widths(tmp_path):
    """Hidden 512, ffn 1536, vocab 32000, 8 heads and 2 KV heads: the GEMMs
    a library tiles differently by shape, TP=2 and TP=4 against TP=1."""
    path = str(write_tiny(tmp_path / "wide", seed=1, vocab_size=32000, hidden_size=512, intermediate_size=1536,
                          num_layers=2, num_heads=8, num_kv_heads=2))
    script = [[(0, list(range(100, 180))), (1, [7, 8, 9])], [(0, [3]), (1, [4])], [(0, [5]), (1, [6])]]
    rts = [load(path, BACKEND, device=DEVICE, kv_cells=512)]
    try:
        rts += [load(path, BACKEND, device=DEVICE, tp=n, kv_cells=512) for n in (2, 4)]
        base = play(rts[0], script)
        assert play(rts[1], script) == base
        assert play(rts[2], script) == base
    finally:
        for rt in rts:
            rt.close()


def test_fixed_blocks(tiny):
    """Each rank's vocabulary and KV heads are whole blocks of TP=1's."""
    cfg = load_config(tiny)  # 4 heads, 2 KV heads: 4 pieces
    for world in (1, 2, 4):
        blocks = vocab_blocks(cfg.vocab_size, 4)
        for r, v in enumerate(vocab_ranges(cfg.vocab_size, world, 4)):
            assert v == range(blocks[r * 4 // world].start, blocks[(r + 1) * 4 // world - 1].stop)
            assert len(Shard.plan(cfg, world, r).kv_heads) % kv_block_heads(cfg, 4) == 0
    with pytest.raises(TpError, match=r"--tp 2.*invariant"):
        load(tiny, BACKEND, device=DEVICE, tp=2, invariant=False)
