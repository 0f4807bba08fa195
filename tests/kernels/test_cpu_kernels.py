"""The CPU kernels (kernels/cpu.py over sf_cpu.c) against their torch
references, and invariant by construction: a row's bits do not depend on
the other rows, the thread count, or the ISA (the scalar path is the same
arithmetic one lane at a time)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from superfluid.kernels import cpu
from superfluid.kernels.attention import attention_torch, build_batch
from superfluid.kernels.rmsnorm import rmsnorm_torch
from superfluid.kernels.rope import rope_torch

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the CPU kernels are not built")

DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def scalar(fn):
    cpu.force_isa(0)
    try:
        return fn()
    finally:
        cpu.force_isa(None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out,inp", [(37, 19), (512, 1536), (1040, 512)])
def test_linear_matches_float64(dtype, out, inp):
    torch.manual_seed(out)
    w, b = torch.randn(out, inp).to(dtype), torch.randn(out)
    x, base = torch.randn(101, inp), torch.randn(101, out)
    p = cpu.pack(w, b)
    xs = x.to(torch.bfloat16) if p.numeric_class in ("bf16-dot", "bf16-amx") else x  # those round x to bf16
    ref = xs.double() @ w.double().T + b.double()
    tol = 2e-6 * inp ** 0.5 * 8
    assert (cpu.linear(x, p).double() - ref).abs().max() < tol
    y = base.clone()
    cpu.linear(x, p, out=y, residual=True)
    assert torch.equal(y, base + cpu.linear(x, p))  # the residual add rounds as torch's x + linear(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_linear_row_is_the_same_in_any_batch_position_thread_count_and_isa(dtype, threads):
    torch.manual_seed(1)
    w = torch.randn(1100, 1536).to(dtype)  # a K beyond two cache blocks, outputs past a panel edge
    p = cpu.pack(w)
    x = torch.randn(200, 1536)
    threads(1)
    ref = cpu.linear(x[:1], p)[0]
    for t in (1, 2, 3):
        threads(t)
        for n in (1, 2, 5, 6, 7, 13, 96, 97, 200):
            for at in {0, n // 2, n - 1}:
                xx = x[:n].clone()
                xx[at] = x[0]
                assert torch.equal(cpu.linear(xx, p)[at], ref), (t, n, at)
    full = cpu.linear(x, p)
    if p.numeric_class != "bf16-amx":  # (that class runs on its path only)
        assert torch.equal(scalar(lambda: cpu.linear(x, p)), full)
    assert not torch.equal(full[0], full[1])  # rows differ: the equalities above are not vacuous


@pytest.mark.parametrize("numeric", ["fp32", "bf16-fma", "bf16-dot"])
@pytest.mark.parametrize("inter,inp", [(16, 7), (48, 33), (1536, 512)])
def test_swiglu_from_the_gemms_epilogue_is_linear_then_silu_mul(numeric, inter, inp, threads):
    """gate_up packed in (gate, up) panel pairs: linear_swiglu's one call
    gives the bits of linear then silu_mul on the plain packing, in every
    class, at every token count (the GEMV paths, tile tails, several blocks),
    thread count and path, with and without a bias; odd reductions too."""
    torch.manual_seed(inter + inp)
    dtype, cls = (torch.float32, None) if numeric == "fp32" else (torch.bfloat16, numeric)
    w, b = torch.randn(2 * inter, inp).to(dtype), torch.randn(2 * inter)
    x = torch.randn(300, inp) * 2
    for bias in (None, b):
        paired, plain = cpu.pack_gate_up(w, bias, numeric=cls), cpu.pack(w, bias, numeric=cls)
        assert paired.swiglu and not plain.swiglu
        if paired.numeric_class == "bf16-amx":
            levels = [cpu.ISA_LEVELS["amx-bf16"]]
        else:
            levels = list(range(cpu.ISA_LEVELS.get(cpu.best_isa(), 0) + 1))
        want = cpu.silu_mul(cpu.linear(x, plain))
        for level in levels:
            cpu.force_isa(level)
            try:
                for t in (1, 2, 3):
                    threads(t)
                    for n in (1, 2, 4, 5, 13, 97, 300):
                        got = cpu.linear_swiglu(x[:n], paired)
                        assert torch.equal(got, want[:n]), (cpu.ISA_NAMES[level], t, n, bias is None)
            finally:
                cpu.force_isa(None)
        assert not torch.equal(want[0], want[1])
    with pytest.raises(ValueError, match="linear_swiglu"):
        cpu.linear(x, paired)


def test_a_gate_up_whose_halves_are_not_whole_panels_is_packed_plain():
    w = torch.randn(2 * 40, 32)
    p = cpu.pack_gate_up(w)
    assert not p.swiglu
    x = torch.randn(7, 32)
    assert torch.equal(cpu.linear_swiglu(x, p), cpu.silu_mul(cpu.linear(x, p)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_bias_and_residual_forms_give_the_same_bits_on_every_path(dtype):
    # the epilogue: whole panels in 64-byte vectors on the AVX-512 paths, 4- and 1-wide elsewhere
    torch.manual_seed(6)
    w, b = torch.randn(1100, 96).to(dtype), torch.randn(1100)  # a tail panel of 12
    x, base = torch.randn(37, 96), torch.randn(37, 1100)
    p, pb = cpu.pack(w), cpu.pack(w, b)
    if p.numeric_class == "bf16-amx":
        pytest.skip("the bf16-amx class runs on its path only")

    def forms():
        y, yb = base.clone(), base.clone()
        cpu.linear(x, p, out=y, residual=True)
        cpu.linear(x, pb, out=yb, residual=True)
        return cpu.linear(x, pb), y, yb

    want = scalar(forms)
    for level in range(cpu.ISA_LEVELS.get(cpu.best_isa(), 0) + 1):
        cpu.force_isa(level)
        try:
            got = forms()
        finally:
            cpu.force_isa(None)
        assert all(torch.equal(g, w_) for g, w_ in zip(got, want)), cpu.ISA_NAMES[level]
    assert not torch.equal(want[1], want[2])  # the bias reached the residual form


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out", [2000, 1990])  # rows of 64-byte lines; rows 16-byte aligned every other, a tail panel
def test_an_output_past_the_caches_is_written_around_them_with_the_same_bits(dtype, out):
    """From 2M floats (STREAM_FLOATS) a GEMM's plain stores bypass the
    caches: the rows equal those of calls too small to stream, on every
    path, in one piece and in parts; the bias and residual forms, which never
    stream, are the control that the big calls ran whole."""
    torch.manual_seed(3)
    n, inp = 1090, 64  # over 2.1M outputs; a tail token block
    w, b = torch.randn(out, inp).to(dtype), torch.randn(out)
    x = torch.randn(n, inp)
    p, pp = cpu.pack(w), cpu.pack_parts(w, 4)
    parts = cpu.linear_parts(x, pp)
    levels = range(cpu.ISA_LEVELS.get(cpu.best_isa(), 0) + 1)
    for level in levels if p.numeric_class != "bf16-amx" else [None]:
        cpu.force_isa(level)
        try:
            big = cpu.linear(x, p)
            small = torch.cat([cpu.linear(x[i:i + 100], p) for i in range(0, n, 100)])
            assert torch.equal(big, small), cpu.isa()
            assert torch.equal(cpu.linear_parts(x, pp), parts), cpu.isa()
        finally:
            cpu.force_isa(None)
    assert torch.equal(parts, torch.stack([torch.cat([cpu.linear_parts(x[i:i + 100], pp)[q]
                                                      for i in range(0, n, 100)]) for q in range(4)]))
    assert torch.equal(cpu.linear(x, cpu.pack(w, b)), big + b)  # (acc + bias: the same adds)
    y = torch.randn(n, out)
    want = y + big
    cpu.linear(x, p, out=y, residual=True)
    assert torch.equal(y, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pieces_folded_in_cache_add_the_bits_of_pieces_then_combine(dtype, threads):
    """linear_parts_add (sf_forward's o and down): below two token blocks a
    thread, the pieces then combine; above, every piece of a task's panels
    folded in order into one plane and the last added into out: the same
    bits either way, with and without a bias, on every path of the class;
    rows differ, so the equality is not vacuous."""
    torch.manual_seed(4)
    w, b = torch.randn(200, 8 * 48).to(dtype), torch.randn(200)  # 8 pieces of 48; a tail panel
    best = cpu.ISA_LEVELS.get(cpu.best_isa(), 0)
    # each side of 2 x 96 x threads; 193: a lone token's block (the GEMV paths); one piece
    for n, t, g in ((5, 2, 8), (191, 1, 8), (192, 1, 8), (193, 1, 8), (420, 2, 8), (700, 3, 8), (200, 1, 1)):
        p = cpu.pack_parts(w, g)
        threads(t)
        x, base = torch.randn(n, 8 * 48), torch.randn(n, 200)
        want = cpu.combine(cpu.linear_parts(x, p), base.clone(), b)
        for level in range(best + 1) if p.numeric_class != "bf16-amx" else [best]:
            cpu.force_isa(level)
            try:
                assert torch.equal(cpu.linear_parts_add(x, p, base.clone(), b), want), (n, t, cpu.isa())
                assert torch.equal(cpu.linear_parts_add(x, p, base.clone()), cpu.combine(cpu.linear_parts(x, p),
                                                                                         base.clone()))
            finally:
                cpu.force_isa(None)
        assert not torch.equal(want[0], want[-1])


def test_rmsnorm_and_silu_mul_match_torch_and_the_scalar_path():
    torch.manual_seed(2)
    x, w = torch.randn(33, 520) * 3, torch.rand(520)
    got = cpu.rmsnorm(x, w, 1e-6)
    assert torch.allclose(got, rmsnorm_torch(x, w, 1e-6), rtol=1e-6, atol=1e-6)
    assert torch.equal(scalar(lambda: cpu.rmsnorm(x, w, 1e-6)), got)
    assert torch.equal(cpu.rmsnorm(x[7:8], w, 1e-6)[0], got[7])
    gu = torch.randn(9, 2 * 203) * 5  # an intermediate size that leaves a tail
    got = cpu.silu_mul(gu)
    ref = torch.nn.functional.silu(gu[:, :203].double()) * gu[:, 203:].double()
    assert torch.allclose(got.double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(scalar(lambda: cpu.silu_mul(gu)), got)
    assert torch.equal(cpu.silu_mul(gu[4:5])[0], got[4])


def test_silu_mul_gives_the_scalar_paths_bits_on_every_path_at_the_edges():
    # elementwise exp and divide, 16, 8 and 1 lanes at a time: the same operations on every path
    torch.manual_seed(8)
    edges = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-40, 88.5, -88.5,
                          87.2, -87.4, 100.0, -100.0, 3e38, -3e38, 1.0, -1.0])
    g = torch.cat([edges, torch.randn(203 - len(edges)) * 30])
    gu = torch.stack([torch.cat([g[torch.randperm(203)], torch.randn(203) * 4]) for _ in range(5)])
    gu[1, 203:210] = torch.tensor([float("inf"), 0.0, -0.0, float("nan"), 1e-40, -3e38, 2.0])
    want = scalar(lambda: cpu.silu_mul(gu)).view(torch.int32)
    for level in range(cpu.ISA_LEVELS.get(cpu.best_isa(), 0) + 1):
        cpu.force_isa(level)
        try:
            got = cpu.silu_mul(gu).view(torch.int32)
        finally:
            cpu.force_isa(None)
        assert torch.equal(got, want), cpu.ISA_NAMES[level]


def test_embed_widens_bf16_rows_exactly():
    table = torch.randn(50, 24).to(torch.bfloat16)
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(cpu.embed(table, ids), table[ids].float())
    with pytest.raises(IndexError):
        cpu.embed(table, torch.tensor([50]))


def _attend(q, k, v, feeds, k_pool, v_pool, cos, sin, qn=None, kn=None):
    n, nh, d = q.shape
    nkv = k.shape[1]
    qkv = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], 1)
    return cpu.attention(qkv, cpu.step_layout(feeds, k_pool.shape[2]), k_pool, v_pool, n_heads=nh, n_kv=nkv,
                         head_dim=d, cos=cos, sin=sin, q_norm=qn, k_norm=kn, eps=1e-6, scale=d ** -0.5).view(n, nh, d)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_matches_the_torch_reference(dtype):
    torch.manual_seed(3)
    page, nkv, g, d, blocks = 16, 2, 3, 64, 40
    pool_k = torch.randn(nkv, blocks, page, d).to(dtype)
    pool_v = torch.randn(nkv, blocks, page, d).to(dtype)
    feeds = [([5, 9, 2, 30, 31], 70, 1), ([1, 3], 20, 4), ([7, 8, 10, 11, 12, 13, 14], 100, 9)]
    n = sum(f[2] for f in feeds)
    q, k, v = torch.randn(n, nkv * g, d), torch.randn(n, nkv, d), torch.randn(n, nkv, d)
    angles = torch.arange(256.)[:, None] * 0.01 * torch.arange(1., d // 2 + 1)
    cos, sin = torch.cos(angles), torch.sin(angles)
    kp, vp = pool_k.clone(), pool_v.clone()
    got = _attend(q, k, v, feeds, kp, vp, cos, sin)
    # the reference: rope, write the cells, attend (float32 over the same pool)
    lay = cpu.step_layout(feeds, page)
    qr, kr = rope_torch(q, cos, sin, lay.positions), rope_torch(k, cos, sin, lay.positions)
    rk, rv = pool_k.float().clone(), pool_v.float().clone()
    c = lay.cells
    rk[:, c // page, c % page] = kr.to(dtype).float().transpose(0, 1)
    rv[:, c // page, c % page] = v.to(dtype).float().transpose(0, 1)
    assert torch.equal(kp.float(), rk) and torch.equal(vp.float(), rv)  # this step's cells, stored
    ref = attention_torch(qr, rk.permute(1, 2, 0, 3), rv.permute(1, 2, 0, 3), build_batch(feeds, page, g), d ** -0.5)
    assert (got - ref).abs().max() < 2e-5


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_rows_ignore_other_feeds_threads_and_isa(dtype, threads):
    torch.manual_seed(4)
    page, nkv, g, d, blocks = 16, 2, 2, 32, 64
    pool_k = torch.randn(nkv, blocks, page, d).to(dtype)
    pool_v = torch.randn(nkv, blocks, page, d).to(dtype)
    cos, sin = torch.rand(512, d // 2), torch.rand(512, d // 2)
    lane = ([5, 9, 2, 30, 31], 70, 1)
    ql, kl, vl = torch.randn(1, nkv * g, d), torch.randn(1, nkv, d), torch.randn(1, nkv, d)
    threads(1)
    alone = _attend(ql, kl, vl, [lane], pool_k.clone(), pool_v.clone(), cos, sin)[0]
    others = [([1, 3], 20, 4), ([7, 8, 10, 11, 12, 13, 14], 100, 1), ([40], 0, 9)]
    for t in (1, 2):
        threads(t)
        for at in range(len(others) + 1):
            feeds = others[:at] + [lane] + others[at:]
            n = sum(f[2] for f in feeds)
            q, k, v = torch.randn(n, nkv * g, d), torch.randn(n, nkv, d), torch.randn(n, nkv, d)
            first = sum(f[2] for f in feeds[:at])
            q[first], k[first], v[first] = ql[0], kl[0], vl[0]
            out = _attend(q, k, v, feeds, pool_k.clone(), pool_v.clone(), cos, sin)
            assert torch.equal(out[first], alone), (t, at)
    got = scalar(lambda: _attend(ql, kl, vl, [lane], pool_k.clone(), pool_v.clone(), cos, sin))[0]
    assert torch.equal(got, alone)


def test_attention_qk_norm_is_rmsnorm_per_head_before_rope():
    torch.manual_seed(5)
    page, nkv, g, d = 8, 1, 2, 16
    kp, vp = torch.zeros(nkv, 4, page, d), torch.zeros(nkv, 4, page, d)
    q, k, v = torch.randn(3, g, d), torch.randn(3, nkv, d), torch.randn(3, nkv, d)
    qn, kn = torch.rand(d) + 0.5, torch.rand(d) + 0.5
    cos, sin = torch.rand(16, d // 2), torch.rand(16, d // 2)
    _attend(q, k, v, [([1], 0, 3)], kp, vp, cos, sin, qn, kn)
    want = rope_torch(rmsnorm_torch(k, kn, 1e-6), cos, sin, torch.arange(3))
    assert torch.allclose(kp[0, 1, :3], want[:, 0], rtol=1e-6, atol=1e-6)


def test_kernels_called_from_two_threads_at_once_and_after_a_fork(threads):
    # cffi drops the GIL: two callers may overlap (the second runs its tasks itself);
    # a forked child has no helper threads and does every task itself.
    import os
    import threading

    threads(2)
    torch.manual_seed(6)
    p = cpu.pack(torch.randn(700, 300))
    xs = [torch.randn(40, 300) for _ in range(2)]
    want = [cpu.linear(x, p) for x in xs]
    bad = []

    def hammer(i):
        for _ in range(50):
            if not torch.equal(cpu.linear(xs[i], p), want[i]):
                bad.append(i)

    ts = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not bad
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        os._exit(0 if torch.equal(cpu.linear(xs[0], p), want[0]) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])  # q/k norms; q/k/v biases
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_stack_in_one_call_is_bitwise_the_layer_by_layer_path(tmp_path, arch, dtype, threads):
    from superfluid.engine import Feed, load
    from superfluid.engine.tiny import write_tiny

    threads(2)
    write_tiny(tmp_path, arch=arch, seed=3, tokenizer=False)

    def rows(one_call: bool):
        rt = load(tmp_path, "torch", kv_cells=1024, dtype=dtype)
        assert rt.model.stack is not None
        if not one_call:
            rt.model.stack = None
        a, b, c = rt.seq_create(), rt.seq_create(), rt.seq_create()
        out = rt.step_rows([Feed(a, list(range(1, 40))), Feed(b, [7, 8, 9])])
        # 420 tokens (past 2 x 96 x threads): o's and down's pieces folded in cache (sf_linear_parts_add)
        out += rt.step([Feed(c, [(7 * i) % 300 + 1 for i in range(420)], True)])
        out += rt.step([Feed(a, [3], True), Feed(b, [4], True)])
        out += rt.step([Feed(a, [5, 6, 7], True), Feed(b, [8, 9], False)])  # some rows: the head gathers them
        return out

    got, want = rows(True), rows(False)
    assert len(got) == len(want) == 6
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_paired_gate_up_gives_the_plain_gate_ups_rows(tmp_path, dtype, threads, monkeypatch):
    # a model whose intermediate size is whole panels: the stack's MLP through sf_linear_swiglu
    from superfluid.engine import Feed, load
    from superfluid.engine.tiny import write_tiny

    threads(2)
    write_tiny(tmp_path, arch="qwen2", seed=6, tokenizer=False, intermediate_size=96)

    def rows():
        rt = load(tmp_path, "torch", kv_cells=1024, dtype=dtype)
        a, b = rt.seq_create(), rt.seq_create()
        out = rt.step_rows([Feed(a, list(range(1, 120))), Feed(b, [7, 8, 9])])
        out += rt.step([Feed(a, [3], True), Feed(b, [4], True)])
        return out, rt.model.layers[0].gate_up.swiglu

    got, paired = rows()
    monkeypatch.setattr(cpu, "pack_gate_up", cpu.pack)
    want, plain = rows()
    assert paired and not plain
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("order", ["early first", "late first"])
def test_a_step_whose_feeds_share_a_written_block_runs_in_one_pass(tmp_path, order, threads):
    # two feeds on one block table: the one with the later positions first would read, in an early
    # pass, cells the other writes in a later one; sf_forward must see it and take one pass
    from superfluid.engine import load
    from superfluid.engine.tiny import write_tiny
    from superfluid.kernels.cpu_step import StepLayout

    threads(1)
    write_tiny(tmp_path, arch="qwen3", seed=4, tokenizer=False)

    def run(budget):
        cpu.pass_bytes(budget)
        try:
            rt = load(tmp_path, "torch", kv_cells=2048, dtype=torch.float32)
            page, k = rt.pool.page, 8
            blocks = rt.pool.alloc((2 * k + page - 1) // page)
            early, late = list(range(k)), list(range(k, 2 * k))
            pos = torch.tensor(early + late if order == "early first" else late + early)
            cells = torch.tensor([blocks[p // page] * page + p % page for p in pos.tolist()])
            lay = StepLayout(pos, cells, torch.tensor([0] * k + [1] * k), torch.tensor([blocks, blocks]), page)
            return rt.model._forward_stack(torch.arange(1, 2 * k + 1), lay, rt.pool.k, rt.pool.v, None, None)
        finally:
            cpu.pass_bytes(None)

    assert torch.equal(run(1), run(None))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_big_step_in_passes_of_the_layers_is_bitwise_one_pass(tmp_path, dtype, threads):
    # sf_forward takes a big step's tokens through the layers in passes that fit the cache
    from superfluid.engine import Feed, load
    from superfluid.engine.tiny import write_tiny

    threads(2)
    write_tiny(tmp_path, arch="qwen3", seed=4, tokenizer=False)

    def rows(budget: int | None, one_call: bool = True):
        cpu.pass_bytes(budget)
        try:
            rt = load(tmp_path, "torch", kv_cells=2048, dtype=dtype)
            if not one_call:
                rt.model.stack = None
            a, b, c, d = (rt.seq_create() for _ in range(4))
            out = rt.step_rows([Feed(a, list(range(1, 200))), Feed(b, [7, 8, 9]),
                                Feed(c, [(5 * i) % 290 + 1 for i in range(300)])])
            out += rt.step_rows([Feed(d, [(3 * i) % 250 + 2 for i in range(150)]), Feed(a, [4, 5, 6, 7]),
                                 Feed(b, [(11 * i) % 200 + 1 for i in range(260)])])
            return out
        finally:
            cpu.pass_bytes(None)

    layered = rows(None, one_call=False)
    # 1 byte: passes of one token each; ~60 tokens; the default (at 2 threads: passes of >= 384 tokens)
    for budget in (1, 100_000, None):
        got = rows(budget)
        assert len(got) == len(layered) == 6 and all(np.array_equal(g, w) for g, w in zip(got, layered)), budget


def test_bad_shapes_and_layouts_are_refused_before_the_c_side():
    p = cpu.pack(torch.randn(32, 16))
    with pytest.raises(ValueError, match="rows of 16"):
        cpu.linear(torch.randn(3, 17), p)
    with pytest.raises(ValueError, match="out must be"):
        cpu.linear(torch.randn(3, 16), p, out=torch.empty(3, 31))
    with pytest.raises(ValueError, match="w"):
        cpu.rmsnorm(torch.randn(2, 16), torch.rand(15), 1e-6)
    with pytest.raises(ValueError, match="2 \\* inter"):
        cpu.silu_mul(torch.randn(2, 7))
    page, d = 4, 8
    kp, vp = torch.zeros(1, 3, page, d), torch.zeros(1, 3, page, d)
    q, k, v = torch.randn(1, 1, d), torch.randn(1, 1, d), torch.randn(1, 1, d)
    cos, sin = torch.ones(4, d // 2), torch.zeros(4, d // 2)
    with pytest.raises(ValueError, match="past the rope tables"):
        _attend(q, k, v, [([1, 2], 4, 1)], kp, vp, cos, sin)  # position 4 of a 4-row table
    with pytest.raises(ValueError, match="outside the pool"):
        _attend(q, k, v, [([3], 0, 1)], kp, vp, cos, sin)  # block 3 of 3
    with pytest.raises(ValueError, match="pools"):
        _attend(q, k, v, [([1], 0, 1)], kp, vp.to(torch.bfloat16), cos, sin)


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 6), v=st.integers(1, 70), seed=st.integers(0, 2**16),
       nan=st.floats(0, 0.5), inf=st.floats(0, 0.3), ties=st.booleans())
def test_greedy_picks_what_greedy_sampling_picks_and_flags_what_the_step_flags(b, v, seed, nan, inf, ties):
    """The decode steps' fast path (cpu.greedy) against the sampler it
    replaces: the same token for every finite row (the first maximum; NaN
    ranked as -inf), and the same non-finite flag (a NaN, or a max of +-inf)."""
    from superfluid.kernels.sampling import sample_torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, v, generator=g)
    if ties:
        x = x.round()
    r = torch.rand(b, v, generator=g)
    x[r < nan] = float("nan")
    x[(r >= nan) & (r < nan + inf)] = float("inf") if seed % 2 else float("-inf")
    tok, bad = cpu.greedy(x)
    assert bad == (~torch.isfinite(x.amax(1))).tolist()
    want = sample_torch(x.clone(), [0.0] * b, [0] * b, [0.0] * b, [0.0] * b, [0] * b).tolist()
    assert [t for t, f in zip(tok, bad) if not f] == [t for t, f in zip(want, bad) if not f]
    if not any(bad):
        assert tok == want


def test_the_read_probe_reads_every_word():
    """sf_read_probe (the benches' bandwidth probe) xors every word once, so
    it cannot skip memory: its result is the words' xor, at any thread count."""
    words = torch.randint(-2**62, 2**62, (3 * 16384 + 5,), dtype=torch.int64)
    want = 0
    for w in words.tolist():
        want ^= w & (2**64 - 1)
    for threads in (1, 2, 3):
        got = cpu.lib.sf_read_probe(cpu.ffi.cast("void *", words.data_ptr()), words.numel() * 8, threads)
        assert got == want
    words[-1] ^= 1  # the tail counts too
    assert cpu.lib.sf_read_probe(cpu.ffi.cast("void *", words.data_ptr()), words.numel() * 8, 2) == want ^ 1


def test_the_stacks_greedy_picks_are_its_rows_greedy_pick(tmp_path, threads):
    """step_sampled's all-greedy steps take their tokens from the stack's one
    call (sf_greedy in C after the LM head): they must be cpu.greedy of the
    rows the same steps give (another runtime, same weights and feeds)."""
    from superfluid.engine import Feed, SampleSpec, load
    from superfluid.engine.tiny import write_tiny

    threads(2)
    write_tiny(tmp_path, seed=4, tokenizer=False)
    picker, rower = load(tmp_path, "torch", kv_cells=1024), load(tmp_path, "torch", kv_cells=1024)
    assert picker.model.takes_ids
    sa, sb = [picker.seq_create() for _ in range(3)], [rower.seq_create() for _ in range(3)]
    feeds = [list(range(1, 20)), [5, 6], [9]]
    got: list[int] = []
    for _ in range(4):
        toks = picker.step_sampled([Feed(s, f, True) for s, f in zip(sa, feeds)], [SampleSpec()] * 3)
        rows = rower.step([Feed(s, f, True) for s, f in zip(sb, feeds)])
        want, bad = cpu.greedy(torch.from_numpy(np.stack(rows)))
        assert toks == want and not any(bad)
        got += toks
        feeds = [[t] for t in toks]
    assert len(set(got)) > 1  # (the picks are not one constant)


def test_the_stack_refuses_a_bad_row_id_or_head(tmp_path):
    from superfluid.engine import Feed, load
    from superfluid.engine.tiny import write_tiny

    write_tiny(tmp_path, seed=5, tokenizer=False)
    rt = load(tmp_path, "torch", kv_cells=256)
    s = rt.seq_create()
    rt.step([Feed(s, [1, 2, 3], True)])
    stack, pools = rt.model.stack, rt.model._pools
    page = rt.pool.page
    lay = cpu.step_layout([([0], 0, 1)], page, [4])
    with pytest.raises(IndexError, match="row outside"):
        stack.forward_head(None, lay, pools[2], pools[3], rows=torch.tensor([1]))
    with pytest.raises(IndexError, match="outside the embedding"):
        stack.forward_head(None, cpu.step_layout([([0], 0, 1)], page, [10**6]), pools[2], pools[3])
    with pytest.raises(ValueError, match="neither embeddings nor"):
        stack.forward_head(None, cpu.step_layout([([0], 0, 1)], page), pools[2], pools[3])
    hidden = rt.model.cfg.hidden_size
    with pytest.raises(ValueError, match="the norm must be"):
        stack.set_head(rt.model.embed, torch.ones(hidden + 1), rt.model.lm_head)
    with pytest.raises(ValueError, match="packed whole"):
        stack.set_head(rt.model.embed, torch.ones(hidden), cpu.pack_parts(torch.randn(8, hidden), 2))
    assert stack.forward_head(None, lay, pools[2], pools[3]).shape == (1, rt.model.cfg.vocab_size)  # still fine
