"""SwiGLU: silu(gate) * up over a fused [n, 2 * inter] projection."""

from __future__ import annotations

import torch


def silu(x: torch.Tensor) -> torch.Tensor:
    # Not torch.nn.functional.silu: its CPU kernel rounds a vector body and a
    # scalar tail differently, so a value's result would depend on where it
    # sits in the tensor. exp, add and divide do not.
    return x / (1 + torch.exp(-x))


def swiglu_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [n, 2 * inter] (gate first) -> [n, inter] (the reference)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return silu(gate) * up
