"""The ops a forward pass is made of, by backend.

`torch` on a CPU is the C kernels of sf_*.c (CpuBackend: packed weights,
a fused attention over the paged pool; the serving path); elsewhere, or with
SUPERFLUID_CPU_KERNELS=0, pure torch (the reference ops). `triton` swaps in
the Triton kernels of this folder for the elementwise ops, the KV write and
attention, keeping torch GEMMs. `invariant=False` is only for measuring what
batch invariance costs: plain GEMMs and a plain masked softmax attention.
"""

from __future__ import annotations

import os

import torch

from superfluid.kernels import attention as _attn
from superfluid.kernels.kv_write import kv_write_torch
from superfluid.kernels.linear import linear as _linear, swiglu_mlp
from superfluid.kernels.rmsnorm import rmsnorm_torch
from superfluid.kernels.rope import rope_torch
from superfluid.kernels.swiglu import swiglu_torch

BACKENDS = ("torch", "triton")
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def machine(device: torch.device) -> str:
    """What a library's arithmetic runs on: torch's CPU capability, or the GPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return str(torch.backends.cpu.get_cpu_capability()).lower()


def library_class(lib: str, device: torch.device, dtype: torch.dtype, machine: str) -> str:
    """A numeric class of arithmetic a library chooses: its name, the device,
    the dtype and the machine (a CPU capability or a GPU's name), at most 48
    bytes (a KV export's field holds 64)."""
    dt = _SHORT.get(dtype, str(dtype).removeprefix("torch."))
    where = "-".join(machine.split())[:24]
    return f"{lib}-{device.type}-{dt}@{where}"


class Backend:
    name = "torch"
    # Whether the model runs the C kernels' forward (packed weights, StepLayout).
    fused_cpu = False
    # The pool stores each layer [kv_heads, blocks, page, head_dim] underneath:
    # a block table then gathers one head's cells as one contiguous run.
    heads_major_kv = True

    def __init__(self, invariant: bool = True):
        self.invariant = invariant

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return _linear(x, w, b, invariant=self.invariant)

    def idle(self) -> None:
        """Nothing to run for a while: threads of the backend's own may sleep."""

    def numeric_class(self, device: torch.device, dtype: torch.dtype) -> str:
        """The arithmetic a model on this backend does (DESCRIBE's `numeric`):
        workers of one class give the same rows. Here: the library's own, which
        torch and Triton pick by shape, CPU and GPU, so the class names the
        machine too (`torch-cpu-fp32@avx512`, `triton-cuda-bf16@NVIDIA-H200`)."""
        return library_class(self.name, device, dtype, self.isa(device))

    def isa(self, device: torch.device) -> str:
        """What the arithmetic runs on: torch's CPU capability, or the GPU."""
        return machine(device)

    def mlp(self, x: torch.Tensor, gate_up: torch.Tensor, gate_up_b: torch.Tensor | None, down: torch.Tensor,
            down_b: torch.Tensor | None) -> torch.Tensor:
        if self.invariant and type(self).swiglu is Backend.swiglu:
            return swiglu_mlp(x, gate_up, gate_up_b, down, down_b)  # bitwise the composition below
        return self.linear(self.swiglu(self.linear(x, gate_up, gate_up_b)), down, down_b)

    def rmsnorm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return rmsnorm_torch(x, w, eps)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return rope_torch(x, cos, sin, positions)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return swiglu_torch(gate_up)

    def kv_write(self, k_cache, v_cache, cells, k, v) -> None:
        kv_write_torch(k_cache, v_cache, cells, k, v)

    def sample(self, logits: torch.Tensor, specs, masks=None, consume: bool = False) -> torch.Tensor:
        """One token per row of logits [b, vocab], drawn per SampleSpec after the
        grammar masks (engine.runtime.TokenMasks, checked by the caller) if any.
        consume: the caller keeps nothing of logits (they may be written)."""
        from superfluid.kernels.sampling import sample_torch

        return sample_torch(logits, *_spec_columns(specs), *_mask_columns(masks), consume=consume)

    # Whether attention can read a group's keys from a DenseKV kept across steps.
    dense_kv = True

    def layout(self, feeds, page: int, q_per_kv: int, device):
        return _attn.build_batch(feeds, page, q_per_kv, device=device)

    def attention(self, q, k_cache, v_cache, batch: _attn.AttnBatch, scale: float,
                  layer: int | None = None) -> torch.Tensor:
        if self.invariant:
            return _attn.attention_torch(q, k_cache, v_cache, batch, scale, layer)
        return _attn.attention_plain(q, k_cache, v_cache, batch, scale, layer)


class CpuBackend(Backend):
    """The CPU serving path: kernels/cpu.py (sf_cpu.c), invariant by
    construction at any width and thread count. The model packs its weights
    once at load and calls the kernels directly (Model._forward_stack)."""

    fused_cpu = True
    dense_kv = False  # attention reads the paged pool in place

    def __init__(self):
        super().__init__(True)
        from superfluid.kernels import cpu

        cpu.check_env()
        self.cpu = cpu

    def layout(self, feeds, page, q_per_kv, device):
        return self.cpu.step_layout(feeds, page)

    def numeric_class(self, device: torch.device, dtype: torch.dtype) -> str:
        return self.cpu.numeric_class(dtype)  # fp32, bf16-fma, bf16-dot (any x86 CPU) or bf16-amx

    def isa(self, device: torch.device) -> str:
        return self.cpu.isa()

    def greedy(self, logits: torch.Tensor) -> tuple[list[int], list[bool]]:
        """Every row's greedy token and whether it is not finite: what
        sample() with greedy specs and step_sampled's check give, in C."""
        return self.cpu.greedy(logits)

    def idle(self) -> None:
        self.cpu.park()


class TritonBackend(Backend):
    name = "triton"
    heads_major_kv = False  # the kernels address cells as [blocks, page, kv_heads, head_dim]

    def __init__(self, invariant: bool = True):
        super().__init__(invariant)
        from superfluid.kernels import triton_ops  # noqa: F401  (fails clearly without triton)

        self._ops = triton_ops

    def rmsnorm(self, x, w, eps):
        return self._ops.rmsnorm(x, w, eps)

    def rope(self, x, cos, sin, positions):
        return self._ops.rope(x, cos, sin, positions)

    def swiglu(self, gate_up):
        return self._ops.swiglu(gate_up)

    def kv_write(self, k_cache, v_cache, cells, k, v) -> None:
        self._ops.kv_write(k_cache, v_cache, cells, k, v)

    dense_kv = False  # the kernels read the paged pool in place

    def attention(self, q, k_cache, v_cache, batch, scale, layer=None):
        return self._ops.attention(q, k_cache, v_cache, batch, scale)

    def sample(self, logits, specs, masks=None, consume: bool = False):
        from superfluid.kernels.sampling import sample_triton

        return sample_triton(logits, *_spec_columns(specs), *_mask_columns(masks))


def _spec_columns(specs) -> tuple[list, list, list, list, list]:
    return ([s.temperature for s in specs], [s.top_k for s in specs], [s.top_p for s in specs],
            [s.min_p for s in specs], [s.rng_position for s in specs])


def _mask_columns(masks) -> tuple:
    if masks is None:
        return None, None
    return masks.bits, (None if masks.rows is None else list(masks.rows))


def cpu_kernels_in_use(name: str, invariant: bool = True, device: str | torch.device = "cpu") -> bool:
    """Whether get_backend(name, invariant, device) runs our C kernels."""
    if name != "torch" or not invariant or torch.device(device).type != "cpu":
        return False
    if os.environ.get("SUPERFLUID_CPU_KERNELS", "1") == "0":
        return False
    from superfluid.kernels import cpu

    return cpu.available()


def get_backend(name: str, invariant: bool = True, device: str | torch.device = "cpu") -> Backend:
    if name == "torch":
        return CpuBackend() if cpu_kernels_in_use(name, invariant, device) else Backend(invariant)
    if name == "triton":
        return TritonBackend(invariant)
    raise ValueError(f"backend {name!r}: expected one of {', '.join(BACKENDS)}")
