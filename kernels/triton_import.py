"""Triton for the kernels, imported once: `from superfluid.kernels.triton_import import triton, tl`.

Without CUDA, Triton runs only through its interpreter, which it reads from
TRITON_INTERPRET when a @triton.jit kernel is defined: so it is turned on
here (unless set) before any kernel module defines one. Without Triton
installed both names are None, and each kernel's launcher says so when called.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

__all__ = ["tl", "triton"]
