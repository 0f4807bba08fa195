/* What the CPU kernels' files share: the ISA switch, the task pool's
 * interface, and the arithmetic every path must do the same way (bf16
 * conversion, exp, the lane tree). Private to kernels/sf_*.c. */
#ifndef SF_INTERNAL_H
#define SF_INTERNAL_H

#include "sf_cpu.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SF_X86 1
/* the AVX-512 paths' target: what SF_ISA_AVX512 requires of the CPU */
#define T512 "avx512f,avx512dq,avx512bw,avx512vl"
#else
#define SF_X86 0
#endif


int sf_cpu_isa(void);
/* Whether the AMX tile kernel runs and gives sane, row-invariant sums: tried
 * in a child process, so a fault there costs the path, not the process. */
int sf_amx_verify(void);
/* Whether vdpbf16ps gives the bf16-dot class's bits here (sf_gemm_dot.c). */
int sf_dp_verify(void);

/* o[0..n) = silu(g) * u on path `isa`, the same bits on every path; o may be g (sf_cpu.c). */
void sf_silu_mul_row(const float *g, const float *u, float *o, int n, int isa);

/* Tokens from which sf_linear_parts_add folds its pieces in cache (sf_gemm.c). */
int sf_fold_tokens(int nthreads);

/* A layer's halves up to their row-parallel pieces, or added into add_to (sf_cpu.c). */
int sf_layer_attn(const sf_model *m, const sf_layer *L, const float *x, int n, const int64_t *pos,
                  const int64_t *cells, const int64_t *feed_of, const int64_t *tables, int width, float *h,
                  float *qkv, float *att, float *parts, float *add_to, int nthreads);
int sf_layer_mlp(const sf_model *m, const sf_layer *L, const float *x, int n, float *h, float *gu, float *act,
                 float *parts, float *add_to, int nthreads);

/* A layer's kernel call in sf_forward(_tp): the first failure ends the step
 * (nothing after it runs on a stale buffer), SF_ERR_PATH kept, any other -1. */
#define SF_TRY(call)                                                                                          \
    do {                                                                                                      \
        int rc_ = (call);                                                                                     \
        if (rc_) return rc_ == SF_ERR_PATH ? SF_ERR_PATH : -1;                                                \
    } while (0)

/* A job: fn(ctx, task) for task 0..ntasks-1, on up to nthreads threads (sf_pool.c). */
typedef void (*task_fn)(const void *ctx, long task);
#define MAX_TASKS 0x1fffff
void sf_parallel(task_fn fn, const void *ctx, long ntasks, int nthreads);

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch's .to(torch.bfloat16); NaN stays NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* ------------------------------------------------------------------ exp */

#define EXP_HI 88.0f
#define EXP_LO -87.3f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
#define EP0 1.9875691500E-4f
#define EP1 1.3981999507E-3f
#define EP2 8.3334519073E-3f
#define EP3 4.1665795894E-2f
#define EP4 1.6666665459E-1f
#define EP5 5.0000001201E-1f

static inline float exp_scalar(float x) {
    if (!(x >= EXP_LO)) return 0.0f; /* also -inf */
    if (x > EXP_HI) x = EXP_HI;
    float n = nearbyintf(x * LOG2E);
    float r = fmaf(n, -LN2_HI, x);
    r = fmaf(n, -LN2_LO, r);
    float p = EP0;
    p = fmaf(p, r, EP1);
    p = fmaf(p, r, EP2);
    p = fmaf(p, r, EP3);
    p = fmaf(p, r, EP4);
    p = fmaf(p, r, EP5);
    float y = fmaf(p, r * r, r) + 1.0f;
    uint32_t b = (uint32_t)((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &b, 4);
    return y * s;
}

#if SF_X86
__attribute__((target("avx2,fma"))) static inline __m256 exp_avx2(__m256 x) {
    __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_GE_OQ);
    x = _mm256_min_ps(x, _mm256_set1_ps(EXP_HI));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
    __m256 p = _mm256_set1_ps(EP0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EP1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EP2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EP3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EP4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EP5));
    __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i b = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(b)), keep);
}
#endif

#if SF_X86
/* exp_avx2, 16 lanes: the same operations (min and roundscale as min_ps and
 * round_ps), so the same bits. */
__attribute__((always_inline, target(T512))) static inline __m512 exp512(__m512 x) {
    __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_LO), _CMP_GE_OQ);
    x = _mm512_min_ps(x, _mm512_set1_ps(EXP_HI));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
    __m512 p = _mm512_set1_ps(EP0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EP1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EP2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EP3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EP4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EP5));
    __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    __m512i b = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps(keep, _mm512_mul_ps(y, _mm512_castsi512_ps(b)));
}
#endif

/* ------------------------------------------------------- lane reductions */

/* Lanes l, l+4 then l, l+2 then 0, 1: the tree both paths use. */
static inline float tree8(const float a[8]) {
    float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
    return (s0 + s2) + (s1 + s3);
}

#if SF_X86
__attribute__((target("avx2,fma"))) static inline float tree8_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* l + (l+4) */
    __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));                                  /* l + (l+2) */
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#endif

#if SF_X86
/* f32_to_bf16 of x[0..k) 8 at a time, in integer ops (the same bits); returns
 * how many it did (k rounded down to 8). */
__attribute__((target("avx2,fma"))) static inline int to_bf16_avx2(const float *x, uint16_t *d, int k) {
    const __m256i abs = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000),
                  half = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1), quiet = _mm256_set1_epi32(0x40);
    int i = 0;
    for (; i + 8 <= k; i += 8) {
        __m256i u = _mm256_loadu_si256((const __m256i *)(x + i));
        __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs), inf);
        __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, half), _mm256_and_si256(_mm256_srli_epi32(u, 16), one));
        r = _mm256_blendv_epi8(_mm256_srli_epi32(r, 16), _mm256_or_si256(_mm256_srli_epi32(u, 16), quiet), nan);
        __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08); /* 8 halves, in order */
        _mm_storeu_si128((__m128i *)(d + i), _mm256_castsi256_si128(p));
    }
    return i;
}
#endif

#if SF_X86
/* to_bf16_avx2, 16 at a time. */
__attribute__((target(T512))) static inline int to_bf16_512(const float *x, uint16_t *d, int k) {
    const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000),
                  half = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1), quiet = _mm512_set1_epi32(0x40);
    int i = 0;
    for (; i + 16 <= k; i += 16) {
        __m512i u = _mm512_loadu_si512((const void *)(x + i));
        __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, abs), inf);
        __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(_mm512_add_epi32(u, half), _mm512_and_si512(_mm512_srli_epi32(u, 16), one)), 16);
        r = _mm512_mask_blend_epi32(nan, r, _mm512_or_si512(_mm512_srli_epi32(u, 16), quiet));
        _mm256_storeu_si256((__m256i *)(d + i), _mm512_cvtepi32_epi16(r));
    }
    return i + to_bf16_avx2(x + i, d + i, k - i);
}
#endif

#if SF_X86
__attribute__((target("avx2,fma"))) static inline __m256 load_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

#endif
