"""The torch sampler's CPU mask application (integer ops on the floats' bits,
few or many tokens allowed, reused buffers) gives bitwise what the generic torch
path gives: every row or some, NaN, infinities and -0.0 kept where allowed,
the caller's x unwritten."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from superfluid.kernels import bitmask, cpu
from superfluid.kernels.reference_sampler import mask_allowed
from superfluid.kernels.sampling import apply_bitmask_torch, sample_torch
from superfluid.testing.kernels import random_masks


def _rows(rng, B, V):
    x = rng.standard_normal((B, V)).astype(np.float32)
    for val, share in ((np.nan, 0.02), (np.inf, 0.01), (-np.inf, 0.02), (-0.0, 0.02)):
        x[rng.random((B, V)) < share] = val
    return torch.from_numpy(x)


def _generic(x, bits, rows):
    # float64 x takes the device-generic torch path; its values are float32's
    return apply_bitmask_torch(x.double(), bits, rows).float()


@pytest.mark.parametrize("V", [1, 31, 32, 33, 1000, 32000])
def test_cpu_application_is_the_generic_paths_bitwise(V):
    rng = np.random.default_rng(V)
    B = 6
    x = _rows(rng, B, V)
    before = x.clone()
    for density in (0.0005, 0.01, 0.5, 0.99, "mixed"):
        if density == "mixed":  # a few tokens allowed in some rows (sparse), most in others (dense)
            every = torch.from_numpy(np.concatenate([random_masks(rng, 1, V, d)
                                                     for d in (0.0005, 0.9, 0.001, 0.0, 0.6, 0.3)]))
        else:
            every = torch.from_numpy(random_masks(rng, B, V, density))
        for reuse in (False, True):
            got = apply_bitmask_torch(x, every, None, reuse=reuse)
            assert torch.equal(got.view(torch.int32), _generic(x, every, None).view(torch.int32))
            allowed = mask_allowed(every[2].numpy(), V)
            assert np.isneginf(got[2].numpy()[~allowed]).all()
        some = [4, 1, 3]
        sub = every[[0, 1, 4]].contiguous()
        rows = torch.tensor(some)
        for reuse in (False, True):
            got = apply_bitmask_torch(x, sub, rows, reuse=reuse)
            assert torch.equal(got.view(torch.int32), _generic(x, sub, rows).view(torch.int32))
            assert torch.equal(got[[0, 2, 5]].view(torch.int32), x[[0, 2, 5]].view(torch.int32))
    assert torch.equal(x.view(torch.int32), before.view(torch.int32))  # the caller's rows are not written


def test_a_reused_buffer_is_not_what_a_plain_call_returns():
    rng = np.random.default_rng(0)
    x = _rows(rng, 3, 100)
    bits = torch.from_numpy(random_masks(rng, 3, 100, 0.3))
    kept = apply_bitmask_torch(x, bits)
    want = kept.clone()
    apply_bitmask_torch(x, torch.from_numpy(random_masks(rng, 3, 100, 0.3)), reuse=True)
    apply_bitmask_torch(x, torch.from_numpy(random_masks(rng, 3, 100, 0.3)))
    assert torch.equal(kept.view(torch.int32), want.view(torch.int32))


def test_mask_rows_naming_every_row_in_order_is_no_mask_rows():
    rng = np.random.default_rng(1)
    B, V = 5, 300
    x = _rows(rng, B, V)
    bits = random_masks(rng, B, V, 0.2)
    args = ([1.0, 0.0, 0.7, 1.0, 2.0], [0, 0, 5, 0, 0], [0.0, 0.0, 0.9, 0.0, 0.0], [0.0] * B, [11, 12, 13, 14, 15])
    a = sample_torch(x, *args, bits, list(range(B)))
    b = sample_torch(x, *args, bits, None)
    c = sample_torch(x, *args, bits, torch.arange(B))
    assert a.tolist() == b.tolist() == c.tolist()


@pytest.mark.skipif(not cpu.available(), reason="the CPU kernels are not built")
@pytest.mark.parametrize("V", [33, 32000])
def test_the_c_kernel_and_the_numpy_fallback_agree(V, monkeypatch):
    rng = np.random.default_rng(V + 1)
    x = _rows(rng, 5, V)
    bits = torch.from_numpy(np.concatenate([random_masks(rng, 1, V, d) for d in (0.0, 0.001, 0.5, 0.999, 1.0)]))
    rows = torch.tensor([3, 0])
    c = [apply_bitmask_torch(x, bits, None).clone(), apply_bitmask_torch(x, bits[:2].contiguous(), rows).clone()]
    monkeypatch.setattr(bitmask, "lib", None)
    py = [apply_bitmask_torch(x, bits, None), apply_bitmask_torch(x, bits[:2].contiguous(), rows)]
    for a, b in zip(c, py):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert not torch.equal(c[0].view(torch.int32), x.view(torch.int32))  # the masks banned something


@pytest.mark.skipif(not cpu.available(), reason="the CPU kernels are not built")
def test_the_c_kernel_refuses_bad_shapes():
    x = np.zeros((2, 40), np.float32)
    out = np.empty_like(x)
    with pytest.raises(ValueError, match="bits int32"):
        bitmask.apply_bitmask(x, np.zeros((2, 1), np.int32), None, out)
    with pytest.raises(ValueError, match="distinct rows"):
        bitmask.apply_bitmask(x, np.zeros((2, 2), np.int32), [1, 1], out)
    with pytest.raises(ValueError, match="no rows"):
        bitmask.apply_bitmask(x, np.zeros((1, 2), np.int32), None, out)
    with pytest.raises(RuntimeError, match="sf_apply_bitmask"):
        bitmask.apply_bitmask(x, np.zeros((1, 2), np.int32), [2], out)
