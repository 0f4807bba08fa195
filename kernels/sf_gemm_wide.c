/* The GEMM's AVX-512 path of float32 and bf16 (bf16-fma) weights: a zmm
 * holds a whole panel, so a tile covers two panels x up to TILE_W tokens
 * (one token: four panels' chains at once). Each output is still one fma
 * chain over k in order from the same start, then the same epilogue: the
 * bits are the AVX2 path's (tests run both). The bf16 dot classes are
 * sf_gemm_dot.c's. */
#include "sf_gemm.h"

#if SF_X86

/* ------------------------------------------------- AVX-512, float chains */

__attribute__((always_inline, target(T512))) static inline __m512 w16(const void *w, int bf16) {
    if (bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(w)), 16));
    return _mm512_loadu_ps(w);
}

/* T tokens x NP panels over k in [0, kn); acc [T][2 PANEL] holds the chains. */
__attribute__((always_inline, target(T512))) static inline void tile512(const void *w0, const void *w1, int bf16,
                                                                     int NP, int T, const float *x, long ldx,
                                                                     int kn, float *acc) {
    __m512 c0[TILE_W], c1[TILE_W];
    long es = bf16 ? 2 : 4;
#pragma GCC unroll 12
    for (int t = 0; t < T; t++) {
        c0[t] = _mm512_loadu_ps(acc + t * 2 * PANEL);
        c1[t] = NP > 1 ? _mm512_loadu_ps(acc + t * 2 * PANEL + PANEL) : c0[t];
    }
    const char *a = (const char *)w0, *b = (const char *)w1;
    for (int k = 0; k < kn; k++, a += PANEL * es, b += PANEL * es) {
        if (T <= 2) { /* few tokens: memory-bound */
            _mm_prefetch(a + 64 * PANEL * es, _MM_HINT_T0);
            if (NP > 1) _mm_prefetch(b + 64 * PANEL * es, _MM_HINT_T0);
        }
        __m512 wa = w16(a, bf16), wb = NP > 1 ? w16(b, bf16) : wa;
#pragma GCC unroll 12
        for (int t = 0; t < T; t++) {
            __m512 xb = _mm512_set1_ps(x[t * ldx + k]);
            c0[t] = _mm512_fmadd_ps(wa, xb, c0[t]);
            if (NP > 1) c1[t] = _mm512_fmadd_ps(wb, xb, c1[t]);
        }
    }
#pragma GCC unroll 12
    for (int t = 0; t < T; t++) {
        _mm512_storeu_ps(acc + t * 2 * PANEL, c0[t]);
        if (NP > 1) _mm512_storeu_ps(acc + t * 2 * PANEL + PANEL, c1[t]);
    }
}

/* One token x four panels over all of K (a decode step's GEMV): four
 * chains in flight for the fma's latency; each output's chain as tile512's.
 * The next panel's weights are `ps` elements on. */
__attribute__((always_inline, target(T512))) static inline void gemv512(const void *w, long ps, int bf16,
                                                                     const float *x, int K, float *acc) {
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    long es = bf16 ? 2 : 4, step = PANEL * es;
    const char *a = (const char *)w, *b = a + ps * es, *c = b + ps * es, *d = c + ps * es;
    for (int k = 0; k < K; k++, a += step, b += step, c += step, d += step) {
        __m512 xb = _mm512_set1_ps(x[k]);
        c0 = _mm512_fmadd_ps(w16(a, bf16), xb, c0);
        c1 = _mm512_fmadd_ps(w16(b, bf16), xb, c1);
        c2 = _mm512_fmadd_ps(w16(c, bf16), xb, c2);
        c3 = _mm512_fmadd_ps(w16(d, bf16), xb, c3);
    }
    _mm512_storeu_ps(acc, c0);
    _mm512_storeu_ps(acc + PANEL, c1);
    _mm512_storeu_ps(acc + 2 * PANEL, c2);
    _mm512_storeu_ps(acc + 3 * PANEL, c3);
}
__attribute__((target(T512))) static void gemv512_f32(const void *w, long ps, const float *x, int K, float *acc) {
    gemv512(w, ps, 0, x, K, acc);
}
__attribute__((target(T512))) static void gemv512_bf16(const void *w, long ps, const float *x, int K, float *acc) {
    gemv512(w, ps, 1, x, K, acc);
}

typedef void (*tile512_fn)(const void *, const void *, const float *, long, int, float *);
#define DEF512(T, NP, BF)                                                                                     \
    __attribute__((target(T512))) static void t512_##T##_##NP##_##BF(const void *w0, const void *w1,          \
                                                                     const float *x, long ldx, int kn,        \
                                                                     float *acc) {                            \
        tile512(w0, w1, BF, NP, T, x, ldx, kn, acc);                                                          \
    }
#define DEF512_T(T) DEF512(T, 1, 0) DEF512(T, 2, 0) DEF512(T, 1, 1) DEF512(T, 2, 1)
DEF512_T(1) DEF512_T(2) DEF512_T(3) DEF512_T(4) DEF512_T(5) DEF512_T(6)
DEF512_T(7) DEF512_T(8) DEF512_T(9) DEF512_T(10) DEF512_T(11) DEF512_T(12)
#define ROW512(NP, BF)                                                                                        \
    {0, t512_1_##NP##_##BF, t512_2_##NP##_##BF, t512_3_##NP##_##BF, t512_4_##NP##_##BF, t512_5_##NP##_##BF,  \
     t512_6_##NP##_##BF, t512_7_##NP##_##BF, t512_8_##NP##_##BF, t512_9_##NP##_##BF, t512_10_##NP##_##BF,    \
     t512_11_##NP##_##BF, t512_12_##NP##_##BF}
static const tile512_fn TILES512[2][2][TILE_W + 1] = {{ROW512(1, 0), ROW512(2, 0)}, {ROW512(1, 1), ROW512(2, 1)}};

/* Task: a block of BLOCK_T tokens x `per` panels of its parts, two panels at
 * a time (a lone token: four). */
void linear_task_avx512(const void *ctx, long task) {
    const linear_job *j = (const linear_job *)ctx;
    int b0, bn, p0, p1, q0, q1;
    task_share(j, task, &b0, &bn, &p0, &p1, &q0, &q1);
    float acc[BLOCK_T * 2 * PANEL];
    float wf[2][BLOCK_K * PANEL]; /* bf16 slices widened once for all their tiles (exact) */
    int K = j->a.K, bf16 = j->a.wtype == WT_BF16, wide = bf16 && bn > 16;
    if (bn == 1) /* four chains at a time while four panels are left; a panel's parts in order */
        for (; p0 + 4 <= p1; p0 += 4)
            for (int q = q0; q < q1; q++) {
                gemm_args a = part_args(j, q);
                (bf16 ? gemv512_bf16 : gemv512_f32)(panel_at(&a, p0, 0), a.ps, a.x + (long)b0 * a.ldx, K, acc);
                for (int i = 0; i < 4; i++) epilogue(&a, acc + i * PANEL, PANEL, b0, 1, (p0 + i) * PANEL);
            }
    for (int p = p0; p < p1; p += 2)
        for (int q = q0; q < q1; q++) {
            gemm_args a = part_args(j, q);
            int np = p1 - p < 2 ? 1 : 2;
            memset(acc, 0, sizeof(float) * bn * 2 * PANEL);
            for (int k0 = 0; k0 < K; k0 += BLOCK_K) {
                int kn = K - k0 < BLOCK_K ? K - k0 : BLOCK_K;
                const void *ws[2];
                for (int i = 0; i < np; i++) {
                    ws[i] = panel_at(&a, p + i, k0);
                    if (wide) {
                        const uint16_t *src = (const uint16_t *)ws[i];
                        for (int e = 0; e < kn * PANEL; e++) wf[i][e] = bf16_to_f32(src[e]);
                        ws[i] = wf[i];
                    }
                }
                if (np == 1) ws[1] = ws[0];
                for (int t0 = 0; t0 < bn; t0 += TILE_W) {
                    int tn = bn - t0 < TILE_W ? bn - t0 : TILE_W;
                    TILES512[bf16 && !wide][np - 1][tn](ws[0], ws[1], a.x + (long)(b0 + t0) * a.ldx + k0, a.ldx, kn,
                                                        acc + t0 * 2 * PANEL);
                }
            }
            for (int i = 0; i < np; i++) epilogue(&a, acc + i * PANEL, 2 * PANEL, b0, bn, (p + i) * PANEL);
        }
}

/* epilogue() for a whole panel, its operations in its order (elementwise:
 * the same bits at any width), 16 outputs a vector: a prefill's epilogues
 * were 4-wide loops behind a branch per row. */
__attribute__((target(T512))) void epilogue_panel512(const gemm_args *a, const float *acc, int lda, int t0, int nt,
                                                     int o0) {
    if (a->fy) { /* a fold's last piece: f + ((y + c) + fb) */
        __m512 fb = a->fbias ? _mm512_loadu_ps(a->fbias + o0) : _mm512_setzero_ps();
        for (int t = 0; t < nt; t++) {
            float *f = a->fy + (long)(t0 + t) * a->fldy + o0;
            __m512 s = _mm512_loadu_ps(acc + t * lda);
            if (a->resid) s = _mm512_add_ps(_mm512_loadu_ps(a->y + (long)(t0 + t) * a->ldy + o0), s);
            if (a->fbias) s = _mm512_add_ps(s, fb);
            _mm512_storeu_ps(f, _mm512_add_ps(_mm512_loadu_ps(f), s));
        }
        return;
    }
    __m512 b = a->bias ? _mm512_loadu_ps(a->bias + o0) : _mm512_setzero_ps();
    for (int t = 0; t < nt; t++) {
        float *y = a->y + (long)(t0 + t) * a->ldy + o0;
        __m512 c = _mm512_loadu_ps(acc + t * lda);
        if (a->bias) c = _mm512_add_ps(c, b);
        if (a->resid) c = _mm512_add_ps(_mm512_loadu_ps(y), c);
        _mm512_storeu_ps(y, c);
    }
}

/* An epilogue's rows (a plain copy of nt rows of a panel) with 64-byte
 * non-temporal stores: each fills a write-combining line at once; y and
 * ldy * 4 are multiples of 64 (epilogue checked). */
__attribute__((target(T512))) void stream_panel512(float *y, long ldy, const float *acc, int lda, int nt) {
    for (int t = 0; t < nt; t++) _mm512_stream_ps(y + t * ldy, _mm512_loadu_ps(acc + t * lda));
    _mm_sfence();
}
#endif
