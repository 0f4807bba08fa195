"""SwiGLU: silu(gate) * up over a fused [n, 2 * inter] projection."""

from __future__ import annotations

import torch

from superfluid.kernels.triton_import import tl, triton

_BLOCK = 1024


def silu(x: torch.Tensor) -> torch.Tensor:
    # Not torch.nn.functional.silu: its CPU kernel rounds a vector body and a
    # scalar tail differently, so a value's result would depend on where it
    # sits in the tensor. exp, add and divide do not.
    return x / (1 + torch.exp(-x))


def swiglu_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [n, 2 * inter] (gate first) -> [n, inter] (the reference)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return silu(gate) * up


if triton is not None:

    @triton.jit
    def _swiglu_kernel(gu_ptr, out_ptr, stride_g, stride_o, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < inter
        g = tl.load(gu_ptr + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_g + inter + cols, mask=m, other=0.0).to(tl.float32)
        # The reference's x / (1 + exp(-x)) * up; div_rn: an IEEE divide, not the fast one.
        y = tl.math.div_rn(g, 1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + row * stride_o + cols, y, mask=m)


def swiglu_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """swiglu_torch's contract; each element on its own, in float32 (a
    low-precision input is rounded once at the end, not after each op)."""
    if triton is None:
        raise RuntimeError("swiglu_triton needs triton (pip install superfluid[triton]); use swiglu_torch")
    n, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up: expected an even last dim (gate then up), got {width}")
    inter = width // 2
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        block = min(_BLOCK, triton.next_power_of_2(inter))
        _swiglu_kernel[(n, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), out.stride(0), inter,
                                                       BLOCK=block, enable_fp_fusion=False)
    return out
