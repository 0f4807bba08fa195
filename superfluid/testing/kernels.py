"""Kernel tests' shared parts: where the Triton kernels can run here, and
random grammar bitmasks in llguidance's layout."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from superfluid.kernels import sampling as ks

U64 = 2**64 - 1


def _kernel_device() -> str | None:
    """Where the kernel can run here: the interpreter takes CPU tensors."""
    if ks.triton is None:
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


KDEV = _kernel_device()
needs_triton = pytest.mark.skipif(KDEV is None, reason="no triton, or no GPU and no interpreter")


def random_masks(rng: np.random.Generator, n: int, V: int, density: float) -> np.ndarray:
    """int32 [n, ceil(V/32)] masks allowing about `density` of the tokens, at least one each;
    the bits past V are set too (they must be ignored)."""
    keep = rng.random((n, V)) < density
    keep[np.arange(n), rng.integers(0, V, n)] = True
    W = (V + 31) // 32
    full = np.ones((n, W * 32), dtype=bool)
    full[:, :V] = keep
    return np.packbits(full, axis=1, bitorder="little").view("<i4").reshape(n, W).astype(np.int32)
