"""cffi build of sf_cpu.c into superfluid.kernels._cpu (the torch backend's
CPU kernels, with their own task pool on pthreads)."""

from __future__ import annotations

import os

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))

PROTOS = """
int sf_cpu_isa(void);
void sf_cpu_force_isa(int isa);
int sf_linear(const float *x, long ldx, int n, int K, const void *w, int bf16, int out, const float *bias,
              float *y, long ldy, int resid, int nthreads);
int sf_rmsnorm(const float *x, long ldx, int n, int d, const float *w, float eps, float *y, long ldy,
               int nthreads);
int sf_silu_mul(const float *gu, long ldg, int n, int inter, float *out, long ldo, int nthreads);
int sf_attention(float *qkv, long ldqkv, int n, int nh, int nkv, int hd, const int64_t *pos,
                 const int64_t *cells, const int64_t *feed_of, const int64_t *tables, int width, const float *cos,
                 const float *sin, const float *qn, const float *kn, float eps, void *kp, void *vp, int kv_bf16,
                 long head_stride, int page, float scale, float *out, long ldo, int nthreads);
int sf_embed(const void *table, int bf16, int d, const int64_t *ids, int n, float *out);
int sf_forward(const sf_model *m, float *x, int n, const int64_t *pos, const int64_t *cells,
               const int64_t *feed_of, const int64_t *tables, int width, float *h, float *qkv, float *att,
               float *gu, float *act, int nthreads);
"""


def _types() -> str:
    with open(os.path.join(HERE, "sf_cpu.h"), encoding="utf-8") as f:
        return "\n".join(line for line in f.read().splitlines() if not line.lstrip().startswith("#"))


def make_builder() -> FFI:
    ffi = FFI()
    ffi.cdef(_types() + PROTOS)
    rel = "kernels" if os.path.abspath(os.getcwd()) == os.path.dirname(HERE) else HERE
    ffi.set_source(
        "superfluid.kernels._cpu",
        '#include "sf_cpu.h"\n' + PROTOS,  # the prototypes: floats must not be promoted to double
        sources=[os.path.join(rel, "sf_cpu.c")],
        include_dirs=[rel],
        # -ffp-contract=off: no a*b+c the source did not write as fma (rounding is the contract).
        extra_compile_args=["-O3", "-std=gnu11", "-pthread", "-ffp-contract=off", "-fno-math-errno", "-Wall"],
        extra_link_args=["-pthread"],
    )
    return ffi


ffibuilder = make_builder()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
