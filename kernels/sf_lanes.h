/* The lane arithmetic the CPU kernels share (sf_cpu.c's RMSNorm,
 * sf_attn.c's attention): a dot product or sum is 8 lane chains (element i
 * in lane i % 8, zero-padded) and one fixed tree; exp is our polynomial.
 * The scalar forms do the same operations one lane at a time. Private to
 * kernels/sf_*.c. */
#ifndef SF_LANES_H
#define SF_LANES_H

#include "sf_internal.h"

/* sum_i a[i] * b[i] (b as bf16 when bb), 8 lane chains and tree8. */
static inline float dot_scalar(const float *a, const void *b, int bb, int d) {
    float acc[8] = {0};
    for (int i = 0; i < d; i++) {
        float bv = bb ? bf16_to_f32(((const uint16_t *)b)[i]) : ((const float *)b)[i];
        acc[i % 8] = fmaf(a[i], bv, acc[i % 8]);
    }
    return tree8(acc);
}

#if SF_X86
__attribute__((target("avx2,fma"))) static inline float dot_avx2(const float *a, const void *b, int bb, int d) {
    __m256 acc = _mm256_setzero_ps();
    if (bb) {
        const uint16_t *p = (const uint16_t *)b;
        for (int i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load_bf16x8(p + i), acc);
    } else {
        const float *p = (const float *)b;
        for (int i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(p + i), acc);
    }
    return tree8_avx2(acc);
}


/* sum of x[0..n) (n a multiple of 8), lane chains by plain adds. */
__attribute__((target("avx2,fma"))) static inline float sum_avx2(const float *x, int n) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + i));
    return tree8_avx2(acc);
}
#endif

static inline float dot(const float *a, const void *b, int bb, int d, int isa) {
#if SF_X86
    if (isa >= 1 && d % 8 == 0) return dot_avx2(a, b, bb, d);
#endif
    (void)isa;
    return dot_scalar(a, b, bb, d);
}

static inline float sum_scalar(const float *x, int n) {
    float acc[8] = {0};
    for (int i = 0; i < n; i++) acc[i % 8] = acc[i % 8] + x[i];
    return tree8(acc);
}

#if SF_X86
__attribute__((target("avx2,fma"))) static inline void exp_shift_avx2(float *x, int n, float m) {
    __m256 mm = _mm256_set1_ps(m);
    for (int i = 0; i < n; i += 8) _mm256_storeu_ps(x + i, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), mm)));
}
#endif

/* x[0..n) in place to exp(x - m); n a multiple of 8. */
static inline void exp_shift(float *x, int n, float m, int isa) {
#if SF_X86
    if (isa >= 1) {
        exp_shift_avx2(x, n, m);
        return;
    }
#endif
    (void)isa;
    for (int i = 0; i < n; i++) x[i] = exp_scalar(x[i] - m);
}

#endif
