/* sf_linear: y = x W.T (+ b) (+ y), W packed in 16-output panels: the
 * entry points, and the AVX2 and scalar paths of float32 and bf16 weights. */
#include "sf_gemm.h"

#include <stdlib.h>

static void tile_scalar(const void *w, int bf16, const float *x, long ldx, int nt, int kn, float *acc) {
    for (int t = 0; t < nt; t++) {
        const float *xr = x + t * ldx;
        float *c = acc + t * PANEL;
        for (int k = 0; k < kn; k++) {
            float xv = xr[k];
            if (bf16) {
                const uint16_t *wk = (const uint16_t *)w + (long)k * PANEL;
                for (int i = 0; i < PANEL; i++) c[i] = fmaf(bf16_to_f32(wk[i]), xv, c[i]);
            } else {
                const float *wk = (const float *)w + (long)k * PANEL;
                for (int i = 0; i < PANEL; i++) c[i] = fmaf(wk[i], xv, c[i]);
            }
        }
    }
}

#if SF_X86
__attribute__((target("avx2,fma"))) static inline void load_w_f32(const void *w, __m256 *w0, __m256 *w1) {
    *w0 = _mm256_loadu_ps((const float *)w);
    *w1 = _mm256_loadu_ps((const float *)w + 8);
}

__attribute__((target("avx2,fma"))) static inline void load_w_bf16(const void *w, __m256 *w0, __m256 *w1) {
    __m256i raw = _mm256_loadu_si256((const __m256i *)w);
    *w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)), 16));
    *w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1)), 16));
}

/* T tokens x PANEL outputs over k in [k0, k1): acc holds the chains. One
 * function per (T, weight type), with named accumulators (GCC spills an
 * array of vectors to the stack every iteration). */
#define TROW_LOAD(i)                                                                                          \
    __m256 c##i##0 = _mm256_setzero_ps(), c##i##1 = c##i##0;                                                 \
    const float *x##i = x;                                                                                    \
    if (T > i) {                                                                                              \
        c##i##0 = _mm256_loadu_ps(acc + i * PANEL);                                                           \
        c##i##1 = _mm256_loadu_ps(acc + i * PANEL + 8);                                                       \
        x##i = x + i * ldx;                                                                                   \
    }
#define TROW_FMA(i)                                                                                           \
    if (T > i) {                                                                                              \
        __m256 xb = _mm256_broadcast_ss(x##i + k);                                                            \
        c##i##0 = _mm256_fmadd_ps(w0, xb, c##i##0);                                                           \
        c##i##1 = _mm256_fmadd_ps(w1, xb, c##i##1);                                                           \
    }
#define TROW_STORE(i)                                                                                         \
    if (T > i) {                                                                                              \
        _mm256_storeu_ps(acc + i * PANEL, c##i##0);                                                           \
        _mm256_storeu_ps(acc + i * PANEL + 8, c##i##1);                                                       \
    }
#define DEF_TILE(TN, NAME, LOADW, WT)                                                                          \
    __attribute__((target("avx2,fma"))) static void NAME(const void *wv, const float *x, long ldx, int kn,   \
                                                         float *acc) {                                       \
        enum { T = TN };                                                                                      \
        TROW_LOAD(0) TROW_LOAD(1) TROW_LOAD(2) TROW_LOAD(3) TROW_LOAD(4) TROW_LOAD(5)                         \
        const WT *w = (const WT *)wv;                                                                         \
        for (int k = 0; k < kn; k++, w += PANEL) {                                                            \
            __m256 w0, w1;                                                                                    \
            if (T == 1) _mm_prefetch((const char *)(w + 128 * PANEL), _MM_HINT_T0); /* a lone token: memory-bound */ \
            LOADW(w, &w0, &w1);                                                                               \
            TROW_FMA(0) TROW_FMA(1) TROW_FMA(2) TROW_FMA(3) TROW_FMA(4) TROW_FMA(5)                           \
        }                                                                                                     \
        TROW_STORE(0) TROW_STORE(1) TROW_STORE(2) TROW_STORE(3) TROW_STORE(4) TROW_STORE(5)                   \
    }
DEF_TILE(1, tf1, load_w_f32, float)
DEF_TILE(2, tf2, load_w_f32, float)
DEF_TILE(3, tf3, load_w_f32, float)
DEF_TILE(4, tf4, load_w_f32, float)
DEF_TILE(5, tf5, load_w_f32, float)
DEF_TILE(6, tf6, load_w_f32, float)
DEF_TILE(1, tb1, load_w_bf16, uint16_t)
DEF_TILE(2, tb2, load_w_bf16, uint16_t)
DEF_TILE(3, tb3, load_w_bf16, uint16_t)
DEF_TILE(4, tb4, load_w_bf16, uint16_t)
DEF_TILE(5, tb5, load_w_bf16, uint16_t)
DEF_TILE(6, tb6, load_w_bf16, uint16_t)

typedef void (*tile_fn)(const void *, const float *, long, int, float *);
static const tile_fn TILES[2][TILE_T + 1] = {{0, tf1, tf2, tf3, tf4, tf5, tf6}, {0, tb1, tb2, tb3, tb4, tb5, tb6}};
#endif

/* Task: a block of BLOCK_T tokens x `per` panels of its parts. */
static void linear_task(const void *ctx, long task) {
    const linear_job *j = (const linear_job *)ctx;
    int b0, bn, p0, p1, q0, q1;
    task_share(j, task, &b0, &bn, &p0, &p1, &q0, &q1);
    float acc[BLOCK_T * PANEL];
    float wf[BLOCK_K * PANEL]; /* a bf16 slice widened once for all its tiles (exact) */
    int K = j->a.K, bf16 = j->a.wtype == WT_BF16;
    for (int p = p0; p < p1; p++)
        for (int q = q0; q < q1; q++) {
            gemm_args pa = part_args(j, q);
            const gemm_args *a = &pa;
            memset(acc, 0, sizeof(float) * bn * PANEL);
            for (int k0 = 0; k0 < K; k0 += BLOCK_K) {
                int kn = K - k0 < BLOCK_K ? K - k0 : BLOCK_K;
                const void *ws = panel_at(a, p, k0);
                int wide = bf16 && bn > TILE_T;
                if (wide) {
                    const uint16_t *src = (const uint16_t *)ws;
                    for (int i = 0; i < kn * PANEL; i++) wf[i] = bf16_to_f32(src[i]);
                    ws = wf;
                }
                for (int t0 = 0; t0 < bn; t0 += TILE_T) {
                    int tn = bn - t0 < TILE_T ? bn - t0 : TILE_T;
                    const float *xs = a->x + (long)(b0 + t0) * a->ldx + k0;
#if SF_X86
                    if (j->isa >= 1) {
                        TILES[bf16 && !wide][tn](ws, xs, a->ldx, kn, acc + t0 * PANEL);
                        continue;
                    }
#endif
                    tile_scalar(ws, bf16 && !wide, xs, a->ldx, tn, kn, acc + t0 * PANEL);
                }
            }
            epilogue(a, acc, PANEL, b0, bn, p * PANEL);
        }
}

/* Weight elements one panel of K inputs takes, packed as wtype. */
static long panel_elems(int K, int wtype) {
    return wtype >= WT_BF16_PAIRS ? (long)((K + 1) / 2) * 2 * PANEL : (long)K * PANEL;
}

static int run_linear(linear_job *j, int nthreads) {
    int parts = j->parts;
    j->wpart = panel_elems(j->a.K, j->a.wtype);
    j->a.ps = parts * j->wpart;
    j->a.stream = !j->a.resid && !j->a.bias && !j->fold_y && !j->a.swiglu && (long)j->a.n * j->a.out >= STREAM_FLOATS;
    if (j->a.stream && j->isa >= SF_ISA_AVX512) j->a.stream = 2;
    j->a.wide = j->isa >= SF_ISA_AVX512;
    j->blocks = (j->a.n + BLOCK_T - 1) / BLOCK_T;
    j->per = PANELS_PER_TASK;
    j->all_parts = j->a.n <= SMALL_N || j->fold_y; /* (a fold: a task's pieces in order) */
    if (j->all_parts) { /* memory-bound: a task streams at least TASK_BYTES (a short reduction: many panels) */
        long panel_bytes = j->a.ps * (j->a.wtype == WT_F32 ? 4 : 2);
        long chunks = (j->panels * panel_bytes + TASK_BYTES - 1) / TASK_BYTES;
        long per = (j->panels + chunks - 1) / chunks;
        per = (per + PANELS_PER_TASK - 1) / PANELS_PER_TASK * PANELS_PER_TASK;
        if (per > j->per) j->per = (int)per;
    }
    long spread = j->all_parts ? 1 : parts;
    while (spread * j->blocks * ((j->panels + j->per - 1) / j->per) > MAX_TASKS) j->per *= 2; /* the task field */
    j->chunks = (j->panels + j->per - 1) / j->per;
    if (j->a.wtype == WT_BF16_AMX && j->isa < SF_ISA_AMX_BF16) return SF_ERR_PATH; /* that class has no other path */
    int pairs = j->a.wtype == WT_BF16_PAIRS || j->a.wtype == WT_BF16_AMX;
    task_fn fn = pairs                       ? linear_task_pairs
                 : j->isa >= SF_ISA_AVX512   ? linear_task_avx512
                                             : linear_task;
    if (pairs && pairs_prepare(j, parts, nthreads)) return -1;
    sf_parallel(fn, j, spread * j->blocks * j->chunks, nthreads);
    free(j->xb);
    return 0;
}

int sf_linear(const float *x, long ldx, int n, int K, const void *w, int wtype, int out, const float *bias,
              float *y, long ldy, int resid, int nthreads) {
    if (n <= 0 || out <= 0) return 0;
    if (K <= 0 || nthreads < 1 || wtype < WT_F32 || wtype > WT_BF16_AMX) return -1;
    linear_job j = {{x, ldx, n, K, out, w, wtype, bias, y, ldy, resid, 0}, (out + PANEL - 1) / PANEL, 0, 0,
                    sf_cpu_isa(), 0, 1, 0, 0, NULL};
    return run_linear(&j, nthreads);
}

int sf_linear_swiglu(const float *x, long ldx, int n, int K, const void *w, int wtype, int inter, const float *bias,
                     float *act, long ldact, int nthreads) {
    if (n <= 0 || inter <= 0) return 0;
    if (K <= 0 || nthreads < 1 || wtype < WT_F32 || wtype > WT_BF16_AMX || inter % PANEL) return -1;
    /* a task's panels start even and come in order: a pair's gate before its up */
    _Static_assert(PANELS_PER_TASK % 2 == 0, "a task's panels must hold whole (gate, up) pairs");
    linear_job j = {{x, ldx, n, K, 2 * inter, w, wtype, bias, act, ldact, 0, 0}, 2 * inter / PANEL, 0, 0,
                    sf_cpu_isa(), 0, 1, 0, 0, NULL};
    j.a.swiglu = 1 + j.isa;
    return run_linear(&j, nthreads);
}

/* The reduction split into `parts` fixed pieces of K inputs each: y[p] =
 * x[:, p K:(p + 1) K] W_p.T, each piece's sums started from zero, each
 * panel's pieces packed one after another. A tensor-parallel rank computes
 * its pieces with this and every degree adds the same pieces in the same
 * order (sf_combine), so a row-parallel layer's bits do not depend on how
 * many ranks split it. */
int sf_linear_parts(const float *x, long ldx, int n, int K, int parts, const void *w, int wtype, int out, float *y,
                    int nthreads) {
    if (n <= 0 || out <= 0) return 0;
    if (K <= 0 || parts < 1 || nthreads < 1 || wtype < WT_F32 || wtype > WT_BF16_AMX) return -1;
    linear_job j = {{x, ldx, n, K, out, w, wtype, NULL, y, out, 0, 0}, (out + PANEL - 1) / PANEL, 0, 0,
                    sf_cpu_isa(), 0, parts, 0, 0, NULL};
    return run_linear(&j, nthreads);
}

/* y += sf_combine(sf_linear_parts(...), bias), the same bits. From two
 * token blocks a thread, without the pieces in memory: a task takes every
 * piece of its panels in order and folds each into the first scratch plane
 * while its rows are still cached; the last adds the sum (+ bias) into y
 * (a prefill's o and down wrote their g planes and read them back). Fewer
 * tokens: the pieces' tasks spread over the threads, then sf_combine. */
int sf_fold_tokens(int nthreads) { return 2 * BLOCK_T * nthreads; }

int sf_linear_parts_add(const float *x, long ldx, int n, int K, int parts, const void *w, int wtype, int out,
                        float *scratch, const float *bias, float *y, long ldy, int nthreads) {
    if (n <= 0 || out <= 0) return 0;
    if (K <= 0 || parts < 1 || nthreads < 1 || wtype < WT_F32 || wtype > WT_BF16_AMX) return -1;
    if (n < sf_fold_tokens(nthreads)) {
        int rc = sf_linear_parts(x, ldx, n, K, parts, w, wtype, out, scratch, nthreads);
        return rc ? rc : sf_combine(scratch, parts, n, out, bias, y, ldy, nthreads);
    }
    linear_job j = {{x, ldx, n, K, out, w, wtype, NULL, scratch, out, 0, 0}, (out + PANEL - 1) / PANEL, 0, 0,
                    sf_cpu_isa(), 0, parts, 0, 0, NULL};
    j.fold_y = y, j.fold_ldy = ldy, j.fold_bias = bias;
    return run_linear(&j, nthreads);
}

/* y[t, o] = y[t, o] + (((p_0 + p_1) + ...) + p_{g-1}) (+ bias[o]): the pieces
 * of sf_linear_parts [g][n][out] in piece order, then the bias, then the
 * residual; elementwise adds, so any vector width gives the same bits. */
typedef struct {
    const float *parts, *bias;
    float *y;
    long ldy;
    int g, n, out, rows;
} combine_job;

static void combine_task(const void *ctx, long task) {
    const combine_job *j = (const combine_job *)ctx;
    long plane = (long)j->n * j->out;
    float s[256];
    for (long t = task * j->rows; t < j->n && t < (task + 1) * j->rows; t++) {
        const float *p = j->parts + t * j->out;
        float *y = j->y + t * j->ldy;
        for (int o0 = 0; o0 < j->out; o0 += 256) { /* piece by piece over a strip: loops the compiler vectorizes */
            int m = j->out - o0 < 256 ? j->out - o0 : 256;
            memcpy(s, p + o0, sizeof(float) * m);
            for (int c = 1; c < j->g; c++)
                for (int o = 0; o < m; o++) s[o] = s[o] + p[c * plane + o0 + o];
            if (j->bias)
                for (int o = 0; o < m; o++) s[o] = s[o] + j->bias[o0 + o];
            for (int o = 0; o < m; o++) y[o0 + o] = y[o0 + o] + s[o];
        }
    }
}

int sf_combine(const float *parts, int g, int n, int out, const float *bias, float *y, long ldy, int nthreads) {
    if (n <= 0 || out <= 0) return 0;
    if (g < 1 || nthreads < 1) return -1;
    int rows = out >= 8192 ? 1 : 8192 / out;
    combine_job j = {parts, bias, y, ldy, g, n, out, rows};
    sf_parallel(combine_task, &j, (n + rows - 1) / rows, nthreads);
    return 0;
}
