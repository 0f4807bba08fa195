"""cffi build of sf_cpu.c into superfluid.kernels._cpu (the torch backend's
CPU kernels). OpenMP by soname: the process then has one libgomp, torch's,
and our parallel regions run on torch's threads instead of a second pool
competing with them for the cores."""

from __future__ import annotations

import os

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))

CDEF = """
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
"""


def make_builder() -> FFI:
    ffi = FFI()
    ffi.cdef(CDEF)
    rel = "kernels" if os.path.abspath(os.getcwd()) == os.path.dirname(HERE) else HERE
    ffi.set_source(
        "superfluid.kernels._cpu",
        "#include <stdint.h>\n" + CDEF,  # the prototypes: floats must not be promoted to double
        sources=[os.path.join(rel, "sf_cpu.c")],
        # -ffp-contract=off: no a*b+c the source did not write as fma (rounding is the contract).
        extra_compile_args=["-O3", "-std=gnu11", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-Wall"],
        extra_link_args=["-fopenmp"],
    )
    return ffi


ffibuilder = make_builder()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
