/* The GEMM's bf16 dot classes (weights packed WT_BF16_PAIRS / WT_BF16_AMX).
 *
 * bf16-dot: the activations are rounded to bf16 (nearest even) and each
 * output is, over the pairs of reduction steps i = 0, 1, ... in order,
 *     acc = acc + x[2i+1] w[2i+1];  acc = acc + x[2i] w[2i]
 * in float32 with denormals taken and given as zero: what vdpbf16ps does
 * for a lane (the odd step first). A bf16 product is exact in float32, so
 * an fma with MXCSR's FTZ and DAZ set does the same, and the AVX2 and
 * scalar paths here compute this class too, more slowly: workers of the
 * class agree on any x86 CPU. They differ from hardware only where a
 * product overflows float32 (the row is not finite either way) or where
 * denormal terms sum to a zero (its sign).
 *
 * bf16-amx: what AMX's tdpbf16ps gives (its own class; the amx-bf16 path
 * only). */
#include "sf_gemm.h"

#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#if SF_X86
/* ---------------------------------------------- the bf16 dot class, native */

/* T tokens x NP panels of pairs over pairs [0, kn2); xb: [T][ldxb] pairs
 * (low half the even step); acc [T][lda]. */
__attribute__((always_inline, target(T512 ",avx512bf16"))) static inline void
tile_dp(const uint16_t *w0, const uint16_t *w1, int NP, int T, const uint32_t *xb, int ldxb, int kn2, float *acc,
        int lda) {
    __m512 c0[TILE_W], c1[TILE_W];
#pragma GCC unroll 12
    for (int t = 0; t < T; t++) {
        c0[t] = _mm512_loadu_ps(acc + t * lda);
        c1[t] = NP > 1 ? _mm512_loadu_ps(acc + t * lda + PANEL) : c0[t];
    }
    for (int k = 0; k < kn2; k++, w0 += 2 * PANEL, w1 += 2 * PANEL) {
        if (T <= 2) {
            _mm_prefetch((const char *)(w0 + 64 * 2 * PANEL), _MM_HINT_T0);
            if (NP > 1) _mm_prefetch((const char *)(w1 + 64 * 2 * PANEL), _MM_HINT_T0);
        }
        __m512bh wa = (__m512bh)_mm512_loadu_si512(w0), wb = NP > 1 ? (__m512bh)_mm512_loadu_si512(w1) : wa;
#pragma GCC unroll 12
        for (int t = 0; t < T; t++) {
            __m512bh xp = (__m512bh)_mm512_set1_epi32((int)xb[t * ldxb + k]);
            c0[t] = _mm512_dpbf16_ps(c0[t], wa, xp);
            if (NP > 1) c1[t] = _mm512_dpbf16_ps(c1[t], wb, xp);
        }
    }
#pragma GCC unroll 12
    for (int t = 0; t < T; t++) {
        _mm512_storeu_ps(acc + t * lda, c0[t]);
        if (NP > 1) _mm512_storeu_ps(acc + t * lda + PANEL, c1[t]);
    }
}

typedef void (*tile_dp_fn)(const uint16_t *, const uint16_t *, const uint32_t *, int, int, float *, int);
#define DEFDP(T, NP)                                                                                          \
    __attribute__((target(T512 ",avx512bf16"))) static void tdp_##T##_##NP(                                   \
        const uint16_t *w0, const uint16_t *w1, const uint32_t *xb, int ldxb, int kn2, float *acc, int lda) { \
        tile_dp(w0, w1, NP, T, xb, ldxb, kn2, acc, lda);                                                      \
    }
#define DEFDP_T(T) DEFDP(T, 1) DEFDP(T, 2)
DEFDP_T(1) DEFDP_T(2) DEFDP_T(3) DEFDP_T(4) DEFDP_T(5) DEFDP_T(6)
DEFDP_T(7) DEFDP_T(8) DEFDP_T(9) DEFDP_T(10) DEFDP_T(11) DEFDP_T(12)
#define ROWDP(NP)                                                                                              \
    {0, tdp_1_##NP, tdp_2_##NP, tdp_3_##NP, tdp_4_##NP, tdp_5_##NP, tdp_6_##NP, tdp_7_##NP, tdp_8_##NP,        \
     tdp_9_##NP, tdp_10_##NP, tdp_11_##NP, tdp_12_##NP}
static const tile_dp_fn TILES_DP[2][TILE_W + 1] = {ROWDP(1), ROWDP(2)};

/* One token x four panels (a decode step's GEMV): four chains in flight
 * instead of two, for the instruction's latency; each output's chain as
 * tile_dp's. w: the first panel's pairs, the next ones `ps` elements on. */
__attribute__((target(T512 ",avx512bf16"))) static void gemv_dp4(const void *wv, long ps, const uint32_t *xb,
                                                                 int kn2, float *acc) {
    const uint16_t *w = (const uint16_t *)wv;
    __m512 c0 = _mm512_loadu_ps(acc), c1 = _mm512_loadu_ps(acc + PANEL), c2 = _mm512_loadu_ps(acc + 2 * PANEL),
           c3 = _mm512_loadu_ps(acc + 3 * PANEL);
    const uint16_t *w1 = w + ps, *w2 = w + 2 * ps, *w3 = w + 3 * ps;
    for (int k = 0; k < kn2; k++) {
        long o = (long)k * 2 * PANEL;
        __m512bh xp = (__m512bh)_mm512_set1_epi32((int)xb[k]);
        c0 = _mm512_dpbf16_ps(c0, (__m512bh)_mm512_loadu_si512(w + o), xp);
        c1 = _mm512_dpbf16_ps(c1, (__m512bh)_mm512_loadu_si512(w1 + o), xp);
        c2 = _mm512_dpbf16_ps(c2, (__m512bh)_mm512_loadu_si512(w2 + o), xp);
        c3 = _mm512_dpbf16_ps(c3, (__m512bh)_mm512_loadu_si512(w3 + o), xp);
    }
    _mm512_storeu_ps(acc, c0);
    _mm512_storeu_ps(acc + PANEL, c1);
    _mm512_storeu_ps(acc + 2 * PANEL, c2);
    _mm512_storeu_ps(acc + 3 * PANEL, c3);
}

/* ------------------------------------ the bf16 dot class, by fma (AVX2) */

/* One token x one panel: 16 outputs as two ymm halves. Under FTZ/DAZ. */
__attribute__((target("avx2,fma"))) static void tile_dp_avx2(const uint16_t *w, const uint32_t *xb, int kn2,
                                                             float *acc) {
    __m256 c0 = _mm256_loadu_ps(acc), c1 = _mm256_loadu_ps(acc + 8);
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    for (int k = 0; k < kn2; k++, w += 2 * PANEL) {
        __m256i v0 = _mm256_loadu_si256((const __m256i *)w), v1 = _mm256_loadu_si256((const __m256i *)(w + PANEL));
        __m256 xo = _mm256_castsi256_ps(_mm256_set1_epi32((int)(xb[k] & 0xffff0000u)));
        __m256 xe = _mm256_castsi256_ps(_mm256_set1_epi32((int)(xb[k] << 16)));
        c0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v0, hi)), xo, c0);
        c0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)), xe, c0);
        c1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v1, hi)), xo, c1);
        c1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v1, 16)), xe, c1);
    }
    _mm256_storeu_ps(acc, c0);
    _mm256_storeu_ps(acc + 8, c1);
}
#endif

/* A denormal as a zero of its sign (the class's DAZ and FTZ, in software). */
static inline float flush(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
    memcpy(&v, &u, 4);
    return v;
}

/* The same, one lane at a time: fmaf with the flushes done in software, so
 * it needs no MXCSR (and gives the class on any CPU). */
static void tile_dp_scalar(const uint16_t *w, const uint32_t *xb, int kn2, float *acc) {
    for (int k = 0; k < kn2; k++, w += 2 * PANEL) {
        float xe = flush(bf16_to_f32((uint16_t)(xb[k] & 0xffff))), xo = flush(bf16_to_f32((uint16_t)(xb[k] >> 16)));
        for (int i = 0; i < PANEL; i++) {
            float v = flush(fmaf(flush(bf16_to_f32(w[2 * i + 1])), xo, flush(acc[i])));
            acc[i] = flush(fmaf(flush(bf16_to_f32(w[2 * i])), xe, v));
        }
    }
}

/* vdpbf16ps against the class's fma form on a probe, in process (the
 * instruction cannot fault where cpuid has it): a CPU or an emulator whose
 * instruction rounds otherwise runs the fma form instead. */
int sf_dp_verify(void) {
#if SF_X86
    enum { T = 3, K2 = 40, N = 2 * PANEL };
    static uint16_t w[2][K2 * 2 * PANEL];
    static uint32_t xb[T * K2];
    static float native[T * N], by_fma[T * N];
    uint32_t s = 777;
    for (int p = 0; p < 2; p++)
        for (int i = 0; i < K2 * 2 * PANEL; i++) {
            s = s * 1103515245u + 12345u; /* sign, exponent 2^-20..2^20, 7 mantissa bits */
            w[p][i] = (uint16_t)(((s >> 31) << 15) | ((107 + (s >> 20) % 41) << 7) | ((s >> 8) & 0x7f));
        }
    for (int i = 0; i < T * K2; i++) {
        uint32_t v[2];
        for (int h = 0; h < 2; h++) {
            s = s * 1103515245u + 12345u;
            v[h] = ((s >> 31) << 15) | ((107 + (s >> 20) % 41) << 7) | ((s >> 8) & 0x7f);
        }
        xb[i] = v[0] | v[1] << 16;
    }
    memset(native, 0, sizeof native);
    memset(by_fma, 0, sizeof by_fma);
    unsigned csr = _mm_getcsr();
    _mm_setcsr((csr & ~0x6000u) | 0x8040u);
    TILES_DP[1][T](w[0], w[1], xb, K2, K2, native, N);
    for (int p = 0; p < 2; p++)
        for (int t = 0; t < T; t++) tile_dp_avx2(w[p], xb + t * K2, K2, by_fma + t * N + p * PANEL);
    _mm_setcsr(csr);
    return memcmp(native, by_fma, sizeof native) == 0;
#else
    return 0;
#endif
}

/* ------------------------------------------------ the bf16-amx class (AMX) */

#if SF_X86
#ifdef SF_AMX_EMULATE
#include "sf_amx_emu.h" /* a test build: the tile instructions in C */
#else
#define AMX_LOADCONFIG(c) _tile_loadconfig(c)
#define AMX_RELEASE() _tile_release()
#define AMX_LOADD(t, p, s) _tile_loadd(t, p, s)
#define AMX_STORED(t, p, s) _tile_stored(t, p, s)
#define AMX_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
#endif

/* Tiles: 0-1 accumulators (tokens x 16 outputs, float32), 4 x as pairs
 * (tokens x up to 16 pairs), 6-7 weights (pairs x 16 outputs' pairs). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* The tile shapes this thread loaded, within one task: a task starts by
 * forgetting them (another library may have configured or released the
 * tiles since) and ends by releasing the tiles. */
static _Thread_local int t_cfg_m = -1, t_cfg_k = -1;

static void amx_begin(void) { t_cfg_m = t_cfg_k = -1; }

__attribute__((target("amx-tile"))) static void amx_end(void) {
    AMX_RELEASE();
    t_cfg_m = t_cfg_k = -1;
}

__attribute__((target("amx-tile"))) static void amx_shape(int m, int k2) {
    if (t_cfg_m == m && t_cfg_k == k2) return;
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 2; i++) c.rows[i] = (uint8_t)m, c.colsb[i] = 4 * PANEL;
    c.rows[4] = (uint8_t)m, c.colsb[4] = (uint16_t)(4 * k2);
    for (int i = 6; i < 8; i++) c.rows[i] = (uint8_t)k2, c.colsb[i] = 4 * PANEL;
    AMX_LOADCONFIG(&c); /* (zeroes every tile) */
    t_cfg_m = m, t_cfg_k = k2;
}

/* tn (<= 16) tokens x np panels over pairs [0, kn2), 16 pairs an instruction
 * from the block's start (a fixed grouping: it depends on K only). */
__attribute__((target("amx-tile,amx-bf16"))) static void tile_amx(const uint16_t *w0, const uint16_t *w1, int np,
                                                                int tn, const uint32_t *xb, int ldxb, int kn2,
                                                                float *acc, int lda) {
    for (int k0 = 0; k0 < kn2; k0 += 16) {
        int kn = kn2 - k0 < 16 ? kn2 - k0 : 16;
        if (t_cfg_m != tn || t_cfg_k != kn || k0 == 0) {
            amx_shape(tn, kn);
            AMX_LOADD(0, acc, 4L * lda);
            if (np > 1) AMX_LOADD(1, acc + PANEL, 4L * lda);
        }
        AMX_LOADD(4, xb + k0, 4L * ldxb);
        AMX_LOADD(6, w0 + (long)k0 * 2 * PANEL, 4 * PANEL);
        AMX_DPBF16PS(0, 4, 6);
        if (np > 1) {
            AMX_LOADD(7, w1 + (long)k0 * 2 * PANEL, 4 * PANEL);
            AMX_DPBF16PS(1, 4, 7);
        }
        if (k0 + 16 >= kn2 || kn2 - (k0 + 16) < 16) { /* the last, or a tail of another shape next */
            AMX_STORED(0, acc, 4L * lda);
            if (np > 1) AMX_STORED(1, acc + PANEL, 4L * lda);
        }
    }
}

/* The check sf_amx_verify runs: 2 panels x K = 77 (pairs in a full group
 * and a tail), 16 tokens, then one alone, then 16 again, against float64
 * sums; the row alone and the second pass must equal the first bit for bit. */
static int amx_probe(void) {
    enum { T = 16, K2 = 39, N = 2 * PANEL };
    static uint16_t w[2][K2 * 2 * PANEL];
    static uint32_t xb[T * K2];
    static float acc[T * N], again[T * N], one[N];
    uint32_t s = 12345;
    for (int p = 0; p < 2; p++)
        for (int i = 0; i < K2 * 2 * PANEL; i++) {
            s = s * 1103515245u + 12345u;
            w[p][i] = f32_to_bf16((float)((int)(s >> 16) % 2001 - 1000) / 997.0f);
        }
    for (int i = 0; i < T * K2; i++) {
        s = s * 1103515245u + 12345u;
        uint16_t lo = f32_to_bf16((float)((int)(s >> 16) % 2001 - 1000) / 331.0f);
        s = s * 1103515245u + 12345u;
        uint16_t hi = (i % K2 == K2 - 1) ? 0 : f32_to_bf16((float)((int)(s >> 16) % 2001 - 1000) / 331.0f);
        xb[i] = lo | (uint32_t)hi << 16;
    }
    memset(acc, 0, sizeof acc);
    memset(again, 0, sizeof again);
    memset(one, 0, sizeof one);
    amx_begin();
    tile_amx(w[0], w[1], 2, T, xb, K2, K2, acc, N);
    tile_amx(w[0], w[1], 2, 1, xb + 5 * K2, K2, K2, one, N); /* another shape: reconfigured */
    tile_amx(w[0], w[1], 2, T, xb, K2, K2, again, N);        /* and back */
    amx_end();
    if (memcmp(again, acc, sizeof acc) != 0) return 0;
    for (int t = 0; t < T; t++)
        for (int o = 0; o < N; o++) {
            const uint16_t *wp = w[o / PANEL] + (o % PANEL) * 2;
            double ref = 0, mag = 0;
            for (int k = 0; k < K2; k++) {
                uint32_t x = xb[t * K2 + k];
                double a = (double)bf16_to_f32((uint16_t)(x & 0xffff)) * bf16_to_f32(wp[k * 2 * PANEL]);
                double b = (double)bf16_to_f32((uint16_t)(x >> 16)) * bf16_to_f32(wp[k * 2 * PANEL + 1]);
                ref += a + b, mag += fabs(a) + fabs(b);
            }
            if (!(fabs(acc[t * N + o] - ref) <= 1e-4 * mag + 1e-30)) return 0; /* a wrong layout: ~mag */
        }
    return memcmp(one, acc + 5 * N, sizeof one) == 0;
}
#endif

int sf_amx_verify(void) {
#if SF_X86
    pid_t pid = fork();
    if (pid < 0) return 0;
    if (pid == 0) {
        signal(SIGALRM, SIG_DFL); /* not the parent's handler: a hung probe dies */
        alarm(10);
        _exit(amx_probe() ? 0 : 1);
    }
    int st = 0;
    while (waitpid(pid, &st, 0) < 0)
        if (errno != EINTR) return 0; /* (ECHILD: SIGCHLD ignored, the status lost: not verified) */
    return WIFEXITED(st) && WEXITSTATUS(st) == 0;
#else
    return 0;
#endif
}


/* x's rows as bf16 pairs (as uint16: x's elements in order, a zero after an
 * odd K), a task a (part, row block). */
static void pairs_task(const void *ctx, long task) {
    const linear_job *j = (const linear_job *)ctx;
    int K = j->a.K, K2 = (K + 1) / 2, n = j->a.n, rows = 16;
    long blocks = (n + rows - 1) / rows, part = task / blocks;
    for (int t = (int)(task % blocks) * rows; t < n && t < (int)(task % blocks + 1) * rows; t++) {
        const float *xr = j->a.x + (long)t * j->a.ldx + part * K;
        uint16_t *d = (uint16_t *)(j->xb + (part * n + t) * (long)K2);
        int i = 0;
#if SF_X86
        if (j->isa >= SF_ISA_AVX512) i = to_bf16_512(xr, d, K);
        else if (j->isa >= SF_ISA_AVX2) i = to_bf16_avx2(xr, d, K);
#endif
        for (; i < K; i++) d[i] = f32_to_bf16(xr[i]);
        if (K % 2) d[K] = 0;
    }
}

int pairs_prepare(linear_job *j, int parts, int nthreads) {
    long rows = (long)parts * j->a.n, K2 = (j->a.K + 1) / 2;
    j->xb = (uint32_t *)malloc(sizeof(uint32_t) * rows * K2);
    if (!j->xb) return -1;
    /* a few rows: not worth waking a thread for */
    sf_parallel(pairs_task, j, parts * ((j->a.n + 15) / 16), rows * K2 < (64L << 10) ? 1 : nthreads);
    return 0;
}

/* One part's group of gn panels from g0, for bn tokens: every path's tiles
 * over the reduction in blocks (under the class's MXCSR). */
static void pairs_group(const linear_job *j, const gemm_args *a, int g0, int gn, int bn, const uint32_t *xb,
                        float *acc, int lda) {
    int K2 = (a->K + 1) / 2;
    for (int k20 = 0; k20 < K2; k20 += BLOCK_K2) {
        int kn2 = K2 - k20 < BLOCK_K2 ? K2 - k20 : BLOCK_K2;
        for (int gi = 0; gi < gn; gi += 2) {
            int np = gn - gi < 2 ? 1 : 2;
            const uint16_t *w0 = (const uint16_t *)panel_at(a, g0 + gi, k20);
            const uint16_t *w1 = np > 1 ? (const uint16_t *)panel_at(a, g0 + gi + 1, k20) : w0;
#if SF_X86
            if (a->wtype == WT_BF16_AMX) { /* run_linear saw the path */
                for (int t0 = 0; t0 < bn; t0 += 16) {
                    int tn = bn - t0 < 16 ? bn - t0 : 16;
                    tile_amx(w0, w1, np, tn, xb + (long)t0 * K2 + k20, K2, kn2, acc + t0 * lda + gi * PANEL, lda);
                }
                continue;
            }
            if (j->isa >= SF_ISA_AVX512_BF16) {
                for (int t0 = 0; t0 < bn; t0 += TILE_W) {
                    int tn = bn - t0 < TILE_W ? bn - t0 : TILE_W;
                    TILES_DP[np - 1][tn](w0, w1, xb + (long)t0 * K2 + k20, K2, kn2, acc + t0 * lda + gi * PANEL, lda);
                }
                continue;
            }
#endif
            for (int pi = 0; pi < np; pi++)
                for (int t = 0; t < bn; t++) {
                    const uint16_t *w = pi ? w1 : w0;
                    float *c = acc + t * lda + (gi + pi) * PANEL;
#if SF_X86
                    if (j->isa >= SF_ISA_AVX2) {
                        tile_dp_avx2(w, xb + (long)t * K2 + k20, kn2, c);
                        continue;
                    }
#endif
                    tile_dp_scalar(w, xb + (long)t * K2 + k20, kn2, c);
                }
        }
    }
}

/* Task: a block of tokens x `per` panels of its parts, GROUP panels'
 * accumulators at a time, two panels a tile (a lone token: four). */
void linear_task_pairs(const void *ctx, long task) {
    const linear_job *j = (const linear_job *)ctx;
    int b0, bn, p0, p1, q0, q1;
    task_share(j, task, &b0, &bn, &p0, &p1, &q0, &q1);
    float acc[BLOCK_T * GROUP * PANEL];
    int K2 = (j->a.K + 1) / 2, lda = GROUP * PANEL, amx = j->a.wtype == WT_BF16_AMX;
#if SF_X86
    unsigned csr = _mm_getcsr();
    if (amx) amx_begin();
#endif
    for (int g0 = p0; g0 < p1; g0 += GROUP)
        for (int q = q0; q < q1; q++) { /* (a panel's parts one after another: one stream) */
            gemm_args a = part_args(j, q);
            const uint32_t *xb = j->xb + ((long)q * a.n + b0) * K2;
            int gn = p1 - g0 < GROUP ? p1 - g0 : GROUP;
            for (int t = 0; t < bn; t++) memset(acc + t * lda, 0, sizeof(float) * gn * PANEL);
#if SF_X86
            /* FTZ and DAZ, to nearest even: the class's (the epilogue's adds keep the caller's) */
            _mm_setcsr((csr & ~0x6000u) | 0x8040u);
            if (bn == 1 && gn == GROUP && !amx && j->isa >= SF_ISA_AVX512_BF16)
                gemv_dp4(panel_at(&a, g0, 0), a.ps, xb, K2, acc);
            else
#endif
                pairs_group(j, &a, g0, gn, bn, xb, acc, lda);
#if SF_X86
            _mm_setcsr(csr);
#endif
            for (int gi = 0; gi < gn; gi++) epilogue(&a, acc + gi * PANEL, lda, b0, bn, (g0 + gi) * PANEL);
        }
#if SF_X86
    if (amx) amx_end();
#endif
}
