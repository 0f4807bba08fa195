/* What the GEMM's files share (sf_gemm.c: the AVX2 and scalar paths and
 * the entry points; sf_gemm_wide.c: AVX-512; sf_gemm_dot.c: the bf16 dot
 * classes).
 * Private to kernels/sf_gemm*.c. */
#ifndef SF_GEMM_H
#define SF_GEMM_H

#include "sf_cpu.h"
#include "sf_internal.h"

#define PANEL 16 /* output features per packed panel */
#define TILE_T 6 /* tokens per AVX2 micro tile */
#define BLOCK_T 96 /* tokens per cache block (a multiple of the tiles' heights) */
#define BLOCK_K 256 /* reduction steps per cache block */
#define PANELS_PER_TASK 4
#define SMALL_N 4 /* tokens up to which a GEMM is a GEMV: memory-bound */
#define TILE_W 12 /* tokens per AVX-512 tile */
#define BLOCK_K2 (BLOCK_K / 2) /* reduction pairs per cache block */
#define GROUP 4 /* panels whose accumulators a dot task keeps at once */
#define TASK_BYTES (48L << 10) /* weight bytes a memory-bound task streams, at least */
#define STREAM_FLOATS (2L << 20) /* outputs from which a GEMM's plain stores bypass the caches (8 MiB) */

/* How a weight is packed (sf_linear's `wtype`):
 *   F32, BF16: [ceil(out / PANEL)][K][PANEL], rows past out zero;
 *   BF16_PAIRS: [ceil(out / PANEL)][ceil(K / 2)][PANEL][2], the reduction's
 *     steps 2i and 2i+1 of an output side by side (K odd: a zero step
 *     added), for the bf16-dot class (sf_gemm_dot.c);
 *   BF16_AMX: the same layout, for the bf16-amx class (what AMX's tdpbf16ps
 *     computes; only the amx-bf16 path runs it).
 * In parts (sf_linear_parts), each panel's parts one after another: [panel]
 * [part][...], so a decode step streams a panel's whole reduction at once. */
enum { WT_F32 = 0, WT_BF16 = 1, WT_BF16_PAIRS = 2, WT_BF16_AMX = 3 };

/* y[t, o] = (sum_k x[t, k] * W[o, k]) (+ bias[o]) (+ y[t, o] when resid). */
typedef struct {
    const float *x;
    long ldx;
    int n, K, out;
    const void *w;
    int wtype;
    const float *bias;
    float *y;
    long ldy;
    int resid;
    long ps; /* weight elements from one panel to the next */
    int stream; /* an output too big to stay cached: written with non-temporal stores (2: 64 bytes a store) */
    int wide; /* the epilogue's whole panels in 64-byte vectors (an AVX-512 path) */
    int swiglu; /* 1 + the path: panels in (gate, up) pairs, y the SwiGLU's output (sf_linear_swiglu) */
    float *fy; /* the last piece of a fold (sf_linear_parts_add): fy += (y + acc) (+ fbias) */
    long fldy;
    const float *fbias;
} gemm_args;

typedef struct {
    gemm_args a;
    int panels, chunks, per, isa; /* per: panels a task */
    long blocks; /* token blocks */
    int parts; /* reduction parts (sf_linear_parts; 1 for sf_linear) */
    int all_parts; /* a task takes its panels' every part (few tokens: a panel's parts are one stream) */
    long wpart; /* weight elements of one part of one panel */
    uint32_t *xb; /* WT_BF16_PAIRS: x as bf16 pairs [parts][n][ceil(K / 2)] */
    float *fold_y; /* sf_linear_parts_add: the pieces folded into a.y [n][out], then added into fold_y */
    long fold_ldy;
    const float *fold_bias;
} linear_job;

/* A task's share: its token block, its panel range and its parts [q0, q1)
 * (one part, or all of them when all_parts). */
static inline void task_share(const linear_job *j, long task, int *b0, int *bn, int *p0, int *p1, int *q0,
                              int *q1) {
    long per_part = j->blocks * j->chunks;
    *q0 = j->all_parts ? 0 : (int)(task / per_part);
    *q1 = j->all_parts ? j->parts : *q0 + 1;
    task %= per_part;
    *b0 = (int)(task / j->chunks) * BLOCK_T;
    *bn = j->a.n - *b0 < BLOCK_T ? j->a.n - *b0 : BLOCK_T;
    *p0 = (int)(task % j->chunks) * j->per;
    *p1 = *p0 + j->per < j->panels ? *p0 + j->per : j->panels;
}

/* Part q's arguments: it reads x's columns [q K, (q + 1) K), its weights
 * start wpart elements into each panel's, and it writes y + q n ldy. In a
 * fold every part writes y: the first its sums, the next ones y + theirs,
 * the last fold_y + ((y + its) + bias) (sf_combine's adds, in its order). */
static inline gemm_args part_args(const linear_job *j, int q) {
    gemm_args a = j->a;
    if (q) {
        a.x += (long)q * a.K;
        a.w = a.wtype == WT_F32 ? (const void *)((const float *)a.w + q * j->wpart)
                                : (const void *)((const uint16_t *)a.w + q * j->wpart);
        if (!j->fold_y) a.y += (long)q * a.n * a.ldy;
    }
    if (j->fold_y) {
        a.resid = q > 0;
        if (q == j->parts - 1) a.fy = j->fold_y, a.fldy = j->fold_ldy, a.fbias = j->fold_bias;
    }
    return a;
}

/* Panel p's weights from k step k0 (pairs: pair k0) on, of part a. */
static inline const void *panel_at(const gemm_args *a, int p, long k0) {
    long at = (long)p * a->ps + k0 * (a->wtype >= WT_BF16_PAIRS ? 2 * PANEL : PANEL);
    return a->wtype == WT_F32 ? (const void *)((const float *)a->w + at) : (const void *)((const uint16_t *)a->w + at);
}

/* sf_gemm_wide.c: nt rows of a panel with 64-byte non-temporal stores;
 * the epilogue of a whole panel in 64-byte vectors. */
void stream_panel512(float *y, long ldy, const float *acc, int lda, int nt);
void epilogue_panel512(const gemm_args *a, const float *acc, int lda, int t0, int nt, int o0);

/* acc [nt][lda] of panel o0 / PANEL's outputs: + bias, + residual, into y
 * (v = acc + bias, then y + v: the branches outside the loops, which the
 * compiler then vectorizes; elementwise, so the same bits); a fold's last
 * piece into fy; a big plain output streamed around the caches. */
static inline void epilogue(const gemm_args *a, const float *acc, int lda, int t0, int nt, int o0) {
    int m = a->out - o0 < PANEL ? a->out - o0 : PANEL;
    const float *b = a->bias ? a->bias + o0 : NULL;
    if (a->swiglu) { /* a gate panel's values wait in y; its up panel's (next, same task) make them silu(g) * u */
        int up = (o0 / PANEL) & 1;
        for (int t = 0; t < nt; t++) {
            float *y = a->y + (long)(t0 + t) * a->ldy + o0 / (2 * PANEL) * PANEL, v[PANEL];
            const float *c = acc + t * lda;
            for (int i = 0; i < PANEL; i++) v[i] = b ? c[i] + b[i] : c[i];
            if (up)
                sf_silu_mul_row(y, v, y, PANEL, a->swiglu - 1);
            else
                memcpy(y, v, sizeof v);
        }
        return;
    }
#if SF_X86
    if (a->wide && m == PANEL && !a->stream) {
        epilogue_panel512(a, acc, lda, t0, nt, o0);
        return;
    }
#endif
    if (a->fy) { /* a fold's last piece */
        const float *fb = a->fbias ? a->fbias + o0 : NULL;
        for (int t = 0; t < nt; t++) {
            const float *y = a->y + (long)(t0 + t) * a->ldy + o0, *c = acc + t * lda;
            float *f = a->fy + (long)(t0 + t) * a->fldy + o0, s[PANEL];
            for (int i = 0; i < m; i++) s[i] = a->resid ? y[i] + c[i] : c[i];
            if (fb)
                for (int i = 0; i < m; i++) s[i] = s[i] + fb[i];
            for (int i = 0; i < m; i++) f[i] = f[i] + s[i];
        }
        return;
    }
#if SF_X86
    if (a->stream == 2 && m == PANEL && (((uintptr_t)(a->y + o0) | (uintptr_t)a->ldy * 4) & 63) == 0) {
        stream_panel512(a->y + (long)t0 * a->ldy + o0, a->ldy, acc, lda, nt);
        return;
    }
#endif
    for (int t = 0; t < nt; t++) {
        float *y = a->y + (long)(t0 + t) * a->ldy + o0;
        const float *c = acc + t * lda;
        if (b && a->resid)
            for (int i = 0; i < m; i++) y[i] = y[i] + (c[i] + b[i]);
        else if (b)
            for (int i = 0; i < m; i++) y[i] = c[i] + b[i];
        else if (a->resid)
            for (int i = 0; i < m; i++) y[i] = y[i] + c[i];
        else if (a->stream && m == PANEL && ((uintptr_t)y & 15) == 0) {
#if SF_X86
            /* no read for ownership of lines the caches would not keep (a prefill's outputs: ~9%) */
            for (int i = 0; i < PANEL; i += 4) _mm_stream_ps(y + i, _mm_loadu_ps(c + i));
#else
            for (int i = 0; i < PANEL; i++) y[i] = c[i];
#endif
        } else
            for (int i = 0; i < m; i++) y[i] = c[i];
    }
#if SF_X86
    if (a->stream) _mm_sfence(); /* this thread's streamed rows, visible before its task ends */
#endif
}

void linear_task_avx512(const void *ctx, long task);
void linear_task_pairs(const void *ctx, long task);
/* WT_BF16_PAIRS: j->xb allocated and filled from x (-1: no memory). */
int pairs_prepare(linear_job *j, int parts, int nthreads);

#endif
