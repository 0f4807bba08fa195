"""cffi build of sf_cpu.c, sf_attn.c, sf_attn512.c, sf_gemm.c, sf_gemm_wide.c and
sf_gemm_dot.c, sf_pool.c, sf_mask.c, sf_comm.c and sf_tp.c into
superfluid.kernels._cpu (the torch backend's CPU kernels, with their own
task pool on pthreads; sf_comm.c, the tensor-parallel ranks'
shared-memory collective; sf_tp.c, a rank's forward over it). sf_cpu.h,
their interface, is the cdef."""

from __future__ import annotations

import os

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))


def _cdef() -> str:
    with open(os.path.join(HERE, "sf_cpu.h"), encoding="utf-8") as f:
        return "\n".join(line for line in f.read().splitlines() if not line.lstrip().startswith("#"))


def make_builder(amx_emulated: bool = False) -> FFI:
    """amx_emulated: a test build whose AMX tiles are C (sf_amx_emu.h), so
    the amx-bf16 path runs on a CPU with avx512_bf16 but no AMX
    (tests/kernels/test_amx_emulated.py); never installed."""
    ffi = FFI()
    ffi.cdef(_cdef())
    rel = "kernels" if os.path.abspath(os.getcwd()) == os.path.dirname(HERE) else HERE
    ffi.set_source(
        "superfluid.kernels._cpu",
        '#include "sf_cpu.h"\n',  # with the prototypes: floats must not be promoted to double
        sources=[os.path.join(rel, f) for f in ("sf_cpu.c", "sf_attn.c", "sf_attn512.c", "sf_gemm.c", "sf_gemm_wide.c",
                                                "sf_gemm_dot.c", "sf_pool.c", "sf_mask.c", "sf_comm.c", "sf_tp.c")],
        include_dirs=[rel],
        # -ffp-contract=off: no a*b+c the source did not write as fma (rounding is the contract).
        extra_compile_args=["-O3", "-std=gnu11", "-pthread", "-ffp-contract=off", "-fno-math-errno", "-Wall"],
        extra_link_args=["-pthread"],
        define_macros=[("SF_AMX_EMULATE", "1")] if amx_emulated else [],
    )
    return ffi


ffibuilder = make_builder()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
