"""The elementwise Triton kernels and the KV write match their torch references.

Without a GPU they run under Triton's interpreter (conftest.py turns it on),
so the shapes are small; they include non-power-of-two sizes and strided
views like the slices of the fused projections the model passes.
"""

from __future__ import annotations

import pytest
import torch

from superfluid.kernels import kv_write as kvw
from superfluid.kernels.kv_write import kv_write_torch, kv_write_triton
from superfluid.kernels.rmsnorm import rmsnorm_torch, rmsnorm_triton
from superfluid.kernels.rope import rope_torch, rope_triton
from superfluid.kernels.swiglu import swiglu_torch, swiglu_triton

pytestmark = pytest.mark.skipif(kvw.triton is None, reason="triton is not installed")

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the interpreter
TOL = dict(atol=1e-5, rtol=1e-5)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("shape", [(1, 64), (7, 100), (5, 3, 24), (2, 2, 2, 40)])
def test_rmsnorm_matches_reference(shape):
    g = _gen(len(shape) * 100 + shape[-1])
    x = (torch.randn(shape, generator=g) * 3).to(DEV)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(DEV)
    torch.testing.assert_close(rmsnorm_triton(x, w, 1e-6), rmsnorm_torch(x, w, 1e-6), **TOL)


def test_rmsnorm_takes_a_strided_view():
    # Qwen3's q_norm: heads of q sliced out of the fused qkv projection.
    g = _gen(1)
    qkv = torch.randn(6, 5 * 24 + 7, generator=g).to(DEV)
    q = qkv[:, :5 * 24].reshape(6, 5, 24)
    w = torch.randn(24, generator=g).to(DEV)
    torch.testing.assert_close(rmsnorm_triton(q, w, 1e-5), rmsnorm_torch(q, w, 1e-5), **TOL)


@pytest.mark.parametrize("n,heads,head_dim", [(1, 1, 16), (7, 3, 24), (13, 6, 40)])
def test_rope_matches_reference(n, heads, head_dim):
    g = _gen(n * heads + head_dim)
    half = head_dim // 2
    angles = torch.rand(300, half, generator=g, dtype=torch.float64) * 50
    cos, sin = angles.cos().float().to(DEV), angles.sin().float().to(DEV)
    pos = torch.randint(0, 300, (n,), generator=g).to(DEV)
    # A strided view, as q comes out of the fused projection.
    fused = torch.randn(n, heads * head_dim + 8, generator=g).to(DEV)
    x = fused[:, :heads * head_dim].reshape(n, heads, head_dim)
    torch.testing.assert_close(rope_triton(x, cos, sin, pos), rope_torch(x, cos, sin, pos), **TOL)


@pytest.mark.parametrize("n,inter", [(1, 8), (5, 37), (3, 1100)])
def test_swiglu_matches_reference(n, inter):
    g = _gen(n + inter)
    gate_up = torch.randn(n, 2 * inter, generator=g) * 4
    gate_up[0, :4] = torch.tensor([-30.0, 30.0, 0.0, -0.0])  # saturated and zero gates
    gate_up = gate_up.to(DEV)
    torch.testing.assert_close(swiglu_triton(gate_up), swiglu_torch(gate_up), **TOL)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_kv_write_equals_reference_exactly(cache_dtype):
    g = _gen(7)
    blocks, page, n_kv, head_dim = 6, 4, 3, 24
    n = 9
    k_cache = torch.randn(blocks, page, n_kv, head_dim, generator=g).to(DEV, cache_dtype)
    v_cache = torch.randn(blocks, page, n_kv, head_dim, generator=g).to(DEV, cache_dtype)
    cells = torch.randperm(blocks * page, generator=g)[:n].to(DEV)
    # k and v as the model passes them: views of the fused qkv rows.
    qkv = torch.randn(n, 2 * n_kv * head_dim + 5, generator=g).to(DEV)
    k = qkv[:, :n_kv * head_dim].reshape(n, n_kv, head_dim)
    v = qkv[:, n_kv * head_dim:2 * n_kv * head_dim].reshape(n, n_kv, head_dim)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    kv_write_torch(want_k, want_v, cells, k, v)
    kv_write_triton(k_cache, v_cache, cells, k, v)
    assert torch.equal(k_cache, want_k)
    assert torch.equal(v_cache, want_v)
