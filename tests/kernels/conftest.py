"""Kernel tests run Triton through its interpreter where there is no GPU:
importing triton_import sets TRITON_INTERPRET (before any @triton.jit runs)."""

import superfluid.kernels.triton_import  # noqa: F401
