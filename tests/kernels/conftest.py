"""Kernel tests run Triton through its interpreter where there is no GPU.

Triton reads TRITON_INTERPRET when a @triton.jit decorator runs, so it must be
set before any kernel module is imported; superfluid.kernels.* set it
themselves too (without CUDA), for modules imported before this conftest.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
