"""Weights packed for the CPU kernels' GEMM (sf_gemm.h says each layout):
whole, in reduction pieces (a row-parallel layer), or a gate_up in (gate,
up) pairs of panels (SwiGLU from the GEMM's epilogue)."""

from __future__ import annotations

import dataclasses

import torch

from superfluid.kernels.isa import BF16_CLASSES, ISA_LEVELS, WTYPES, bf16_class, isa

try:
    from superfluid.kernels._cpu import lib
except ImportError:  # pragma: no cover - a build without the extension
    lib = None

PANEL = 16


@dataclasses.dataclass
class Packed:
    """A linear layer's weight [out, in] packed for sf_linear, and its bias."""

    w: torch.Tensor  # [panels * parts, in / parts, PANEL] (pairs: [.., in / parts / 2, PANEL, 2]), float32 or bf16
    out: int
    inp: int
    bias: torch.Tensor | None  # float32 [out]
    parts: int = 1  # pieces the reduction is split into (pack_parts)
    wtype: int = 0  # sf_linear's: 0 float32, 1 bf16, 2 and 3 bf16 in pairs (the bf16-dot, bf16-amx classes)
    swiglu: bool = False  # a gate_up whose panels alternate gate, up (pack_gate_up): linear_swiglu only

    @property
    def numeric_class(self) -> str:
        return ("fp32", "bf16-fma", "bf16-dot", "bf16-amx")[self.wtype]

    @property
    def nbytes(self) -> int:
        b = 0 if self.bias is None else self.bias.numel() * 4
        return self.w.numel() * self.w.element_size() + b


def _pack_w(w: torch.Tensor, pairs: bool) -> torch.Tensor:
    out, inp = w.shape
    pad = (-out) % PANEL
    wp = torch.cat([w, w.new_zeros(pad, inp)]) if pad else w
    if not pairs:  # [panels, in, PANEL]
        return wp.reshape(-1, PANEL, inp).transpose(1, 2).contiguous()
    if inp % 2:  # a zero step: x's pad is zero too
        wp = torch.cat([wp, wp.new_zeros(wp.shape[0], 1)], 1)
    # [panels, in / 2, PANEL, 2]: steps 2i and 2i+1 of an output side by side
    return wp.reshape(-1, PANEL, wp.shape[1] // 2, 2).transpose(1, 2).contiguous()


def _wtype(w: torch.Tensor, numeric: str | None) -> int:
    if w.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"pack: weights must be float32 or bfloat16, not {w.dtype}")
    if w.dtype == torch.float32:
        return 0
    cls = numeric or bf16_class()
    if cls not in BF16_CLASSES:
        raise ValueError(f"pack: unknown bf16 numeric class {cls!r}")
    if cls == "bf16-amx" and lib.sf_cpu_isa() < ISA_LEVELS["amx-bf16"]:
        raise ValueError(f"pack: the bf16-amx class runs only on the amx-bf16 path; this process runs {isa()!r}")
    return WTYPES[cls]


def pack(w: torch.Tensor, bias: torch.Tensor | None = None, *, numeric: str | None = None) -> Packed:
    """w [out, in] packed for sf_linear; bf16 weights in `numeric`'s layout
    (default: this process's bf16_class())."""
    wtype = _wtype(w, numeric)
    out, inp = w.shape
    return Packed(_pack_w(w, wtype >= 2), out, inp, None if bias is None else bias.float().contiguous(), 1, wtype)


def pack_parts(w: torch.Tensor, parts: int, bias: torch.Tensor | None = None, *,
               numeric: str | None = None) -> Packed:
    """A weight [out, in] whose reduction runs as `parts` pieces of in / parts
    inputs (linear_parts, then combine): each piece packed as `pack` does,
    a panel's pieces side by side."""
    wtype = _wtype(w, numeric)
    out, inp = w.shape
    if parts < 1 or inp % parts:
        raise ValueError(f"pack_parts: {inp} inputs do not split into {parts} pieces")
    step = inp // parts
    pieces = [_pack_w(w[:, i * step:(i + 1) * step].contiguous(), wtype >= 2) for i in range(parts)]
    # each panel's pieces one after another ([panel][piece][...]): a decode step reads a panel's
    # whole reduction as one stream
    packed = torch.stack(pieces, 1)
    return Packed(packed.reshape(-1, *packed.shape[2:]).contiguous(), out, inp,
                  None if bias is None else bias.float().contiguous(), parts, wtype)


def pack_gate_up(w: torch.Tensor, bias: torch.Tensor | None = None, *, numeric: str | None = None) -> Packed:
    """A gate_up weight [2 inter, in] (gate rows first) packed for
    linear_swiglu: where inter is a multiple of 16, its rows reordered so
    that panels alternate gate and up (the GEMM's epilogue then makes the
    SwiGLU's output, never writing gate_up's); otherwise as `pack` does."""
    out = w.shape[0]
    if out % (2 * PANEL):
        return pack(w, bias, numeric=numeric)
    inter = out // 2
    gate = torch.arange(inter).view(-1, PANEL)
    order = torch.stack([gate, gate + inter], 1).reshape(-1)  # gate panel i, then up panel i
    p = pack(w[order].contiguous(), None if bias is None else bias[order], numeric=numeric)
    p.swiglu = True
    return p
