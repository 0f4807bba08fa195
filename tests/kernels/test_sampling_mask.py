"""The grammar mask on the device samplers (contract §5: the mask comes first): the
torch sampler with a bitmask gives the host's token for the masked row, the
Triton kernel (under the interpreter without a GPU: small cases) gives the
torch sampler's, rows without a mask draw as if no mask were given, the
caller's logits are not written, and a malformed mask is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from superfluid.kernels import sampling as ks
from superfluid.kernels.reference_sampler import apply_bitmask, greedy, mask_allowed, sample
from superfluid.kernels.sampling import sample_torch
from superfluid.testing.kernels import KDEV, U64, needs_triton, random_masks


def _batch(rng, B, V):
    rows = (rng.standard_normal((B, V)) * rng.choice([0.5, 3.0], (B, 1))).astype(np.float32)
    rows[rng.random((B, V)) < 0.05] = -np.inf
    rows[rng.random((B, V)) < 0.01] = np.nan
    T = rng.choice([0.0, 0.5, 1.0, 2.0], B)
    K = rng.choice([0, 1, 3, V // 2], B)
    P = rng.choice([0.0, 0.5, 0.9], B)
    M = rng.choice([0.0, 0.05], B)
    pos = rng.integers(0, U64, B, dtype=np.uint64, endpoint=True).tolist()
    return rows, T, K, P, M, pos


def _host(rows, T, K, P, M, pos, bits, mask_rows) -> list[int]:
    out = []
    for i in range(rows.shape[0]):
        r = rows[i].copy()
        if i in mask_rows:
            apply_bitmask(r, bits[mask_rows.index(i)])
        out.append(sample(r, float(T[i]), int(K[i]), float(P[i]), float(M[i]), int(pos[i])) if T[i] > 0
                   else greedy(r))
    return out


def test_mask_layout_is_llguidances():
    bits = np.zeros(2, dtype=np.int32)
    bits[0] = (1 << 3) - (1 << 31)  # token 3 and token 31 (the sign bit)
    bits[1] = 1 << 4  # token 36
    assert np.flatnonzero(mask_allowed(bits, 40)).tolist() == [3, 31, 36]
    with pytest.raises(ValueError):
        mask_allowed(bits, 65)  # 3 words wanted


@pytest.mark.parametrize("V", [1, 31, 32, 33, 100, 1000])
def test_torch_with_masks_matches_the_host(V):
    rng = np.random.default_rng(V)
    for density in (0.02, 0.3, 0.9):
        B = 24
        batch = _batch(rng, B, V)
        mask_rows = sorted(rng.choice(B, B // 2, replace=False).tolist())
        bits = random_masks(rng, len(mask_rows), V, density)
        got = sample_torch(torch.from_numpy(batch[0]), *batch[1:], bits, mask_rows).tolist()
        assert got == _host(*batch, bits, mask_rows), (V, density)
        for i, t in enumerate(got):
            if i in mask_rows:
                ok = mask_allowed(bits[mask_rows.index(i)], V)
                # (every allowed logit -inf or NaN: greedy's 0, as for any row with no candidate)
                assert ok[t] or not np.isfinite(batch[0][i][ok]).any()


def test_one_mask_row_per_row_and_unmasked_rows_as_without_a_mask():
    rng = np.random.default_rng(3)
    V, B = 200, 16
    batch = _batch(rng, B, V)
    bits = random_masks(rng, B, V, 0.1)
    rows_t = torch.from_numpy(batch[0])
    assert sample_torch(rows_t, *batch[1:], bits).tolist() == _host(*batch, bits, list(range(B)))
    plain = sample_torch(rows_t, *batch[1:]).tolist()
    some = sample_torch(rows_t, *batch[1:], bits[[2, 9]], [2, 9]).tolist()
    others = [i for i in range(B) if i not in (2, 9)]
    assert [some[i] for i in others] == [plain[i] for i in others]
    none = sample_torch(rows_t, *batch[1:], bits[:0], []).tolist()
    assert none == plain


def test_negative_control_the_mask_changes_tokens():
    rng = np.random.default_rng(4)
    V, B = 300, 32
    batch = _batch(rng, B, V)
    bits = random_masks(rng, B, V, 0.05)
    rows_t = torch.from_numpy(batch[0])
    masked = sample_torch(rows_t, *batch[1:], bits).tolist()
    plain = sample_torch(rows_t, *batch[1:]).tolist()
    assert sum(a != b for a, b in zip(masked, plain)) > B // 2


def test_the_callers_logits_are_not_written():
    rng = np.random.default_rng(5)
    batch = _batch(rng, 4, 64)
    rows_t = torch.from_numpy(batch[0].copy())
    before = rows_t.clone()
    sample_torch(rows_t, *batch[1:], random_masks(rng, 4, 64, 0.1))
    assert torch.equal(torch.nan_to_num(rows_t, nan=7.0), torch.nan_to_num(before, nan=7.0))


@pytest.mark.parametrize("bad, rows", [
    (np.zeros((2, 3), dtype=np.int64), None),  # dtype
    (np.zeros((2, 2), dtype=np.int32), None),  # width (V=100: 4 words)
    (np.zeros((3, 4), dtype=np.int32), None),  # rows without mask_rows
    (np.zeros((1, 4), dtype=np.int32), [0, 1]),  # mask_rows of another length
    (np.zeros((2, 4), dtype=np.int32), [1, 1]),  # twice
    (np.zeros((1, 4), dtype=np.int32), [2]),  # outside the batch
])
def test_a_malformed_mask_is_refused(bad, rows):
    x = torch.zeros(2, 100)
    with pytest.raises(ValueError):
        sample_torch(x, [1.0, 1.0], [0, 0], [0.0, 0.0], [0.0, 0.0], [1, 2], bad, rows)


@needs_triton
@pytest.mark.parametrize("V, block", [(33, 16), (100, 32), (257, 64)])
def test_triton_with_masks_matches_torch(V, block):
    rng = np.random.default_rng(V + block)
    B = 10
    batch = _batch(rng, B, V)
    mask_rows = [0, 3, 4, 8]
    bits = random_masks(rng, len(mask_rows), V, 0.2)
    want = sample_torch(torch.from_numpy(batch[0]), *batch[1:], bits, mask_rows).tolist()
    got = ks.sample_triton(torch.from_numpy(batch[0]).to(KDEV), *batch[1:], bits, mask_rows, block=block)
    assert got.cpu().tolist() == want
    plain = ks.sample_triton(torch.from_numpy(batch[0]).to(KDEV), *batch[1:], block=block).cpu().tolist()
    assert plain == sample_torch(torch.from_numpy(batch[0]), *batch[1:]).tolist()
    assert plain != want  # negative control: the mask mattered


@needs_triton
def test_triton_with_a_mask_on_every_row_and_a_single_allowed_token():
    rng = np.random.default_rng(9)
    V, B = 70, 4
    batch = _batch(rng, B, V)
    only = [5, 69, 0, 33]
    keep = np.zeros((B, 96), dtype=bool)
    keep[np.arange(B), only] = True
    bits = np.packbits(keep, axis=1, bitorder="little").view("<i4").astype(np.int32)
    got = ks.sample_triton(torch.from_numpy(batch[0]).to(KDEV), *batch[1:], bits, block=32).cpu().tolist()
    want = [t if np.isfinite(batch[0][i, t]) else 0 for i, t in enumerate(only)]  # all masked: greedy's 0
    assert got == want == sample_torch(torch.from_numpy(batch[0]), *batch[1:], bits).tolist()
