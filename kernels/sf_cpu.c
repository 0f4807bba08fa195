/* CPU kernels of the torch backend (this file: RMSNorm, SwiGLU, the
 * embedding, the layer stack; sf_lanes.h the dots and sums; sf_attn.c
 * attention; sf_gemm*.c the GEMM; sf_pool.c the threads): batch invariant
 * by construction.
 *
 * Every output element is one fixed sequence of float operations that
 * depends only on its own inputs, never on how many rows share the call,
 * where the row sits, how the work is split across threads, or which ISA
 * runs it:
 *   - a GEMM output is one fma chain over k = 0..K-1 in order, started
 *     from 0, then + bias, then + residual. Tiles only decide which chains
 *     run side by side; threads take whole output panels, never a share of
 *     a reduction; K blocking stores and reloads the chain exactly;
 *   - a dot product or sum of squares is 8 lane chains (element i in lane
 *     i % 8, zero-padded) and one fixed tree over the lanes;
 *   - exp is our own polynomial, the same ops in the vector body and for
 *     padding-filled tails;
 *   - attention takes a row's keys 0..pos in order (scores, max, exp, an
 *     ordered 8-lane sum, then a value fma chain over the keys in order).
 * The scalar path does the same operations one lane at a time (fmaf for
 * fma), so it gives the same bits as the AVX2 path; tests check both.
 * Threads share work as numbered tasks (sf_parallel, sf_pool.c): which thread
 * runs a task never changes what the task computes.
 */
#include "sf_cpu.h"
#include "sf_internal.h"
#include "sf_lanes.h"

#include <stdatomic.h>
#include <stdlib.h>

/* ------------------------------------------------------------ RMSNorm */

/* y[t] = w * (x[t] * (1 / sqrt(mean(x[t]^2) + eps))), rows of d. */
/* Rows per task of a row-wise kernel: enough work to outweigh a claim. */
static inline int rows_per_task(int width) { return width >= 8192 ? 1 : 8192 / (width > 0 ? width : 1); }

typedef struct {
    const float *x, *w;
    long ldx, ldy;
    int n, d, isa, rows;
    float eps;
    float *y;
} norm_job;

static void rmsnorm_task(const void *ctx, long task) {
    const norm_job *j = (const norm_job *)ctx;
    for (long t = task * j->rows; t < j->n && t < (task + 1) * j->rows; t++) {
        const float *xr = j->x + t * j->ldx;
        float *yr = j->y + t * j->ldy;
        float inv = 1.0f / sqrtf(dot(xr, xr, 0, j->d, j->isa) / (float)j->d + j->eps);
        for (int i = 0; i < j->d; i++) yr[i] = j->w[i] * (xr[i] * inv);
    }
}

int sf_rmsnorm(const float *x, long ldx, int n, int d, const float *w, float eps, float *y, long ldy,
               int nthreads) {
    norm_job j = {x, w, ldx, ldy, n, d, sf_cpu_isa(), rows_per_task(d), eps, y};
    sf_parallel(rmsnorm_task, &j, (n + j.rows - 1) / j.rows, nthreads);
    return 0;
}

/* ------------------------------------------------------------- SwiGLU */

#if SF_X86
__attribute__((target("avx2,fma"))) static inline __m256 silu_mul8(__m256 g, __m256 u) {
    __m256 e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

__attribute__((target("avx2,fma"))) static void silu_mul_row_avx2(const float *g, const float *u, float *o, int inter) {
    int i = 0;
    for (; i + 8 <= inter; i += 8) _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    if (i < inter) { /* the tail through the same vector code, zero-padded */
        float gb[8] = {0}, ub[8] = {0}, ob[8];
        memcpy(gb, g + i, sizeof(float) * (inter - i));
        memcpy(ub, u + i, sizeof(float) * (inter - i));
        _mm256_storeu_ps(ob, silu_mul8(_mm256_loadu_ps(gb), _mm256_loadu_ps(ub)));
        memcpy(o + i, ob, sizeof(float) * (inter - i));
    }
}
#endif

#if SF_X86
/* silu_mul_row_avx2, 16 at a time (exp512: the same operations); the last
 * < 16 through the 8-wide code. */
__attribute__((target(T512))) static void silu_mul_row512(const float *g, const float *u, float *o, int inter) {
    int i = 0;
    for (; i + 16 <= inter; i += 16) {
        __m512 gv = _mm512_loadu_ps(g + i), e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)),
                                              _mm512_loadu_ps(u + i)));
    }
    if (i < inter) silu_mul_row_avx2(g + i, u + i, o + i, inter - i);
}
#endif

/* out[t, i] = silu(g) * u, g = gu[t, i], u = gu[t, inter + i];
 * silu(g) = g / (1 + exp(-g)). */
typedef struct {
    const float *gu;
    long ldg, ldo;
    int n, inter, isa, rows;
    float *out;
} silu_job;

void sf_silu_mul_row(const float *g, const float *u, float *o, int n, int isa) {
#if SF_X86
    if (isa >= SF_ISA_AVX512) {
        silu_mul_row512(g, u, o, n);
        return;
    }
    if (isa >= 1) {
        silu_mul_row_avx2(g, u, o, n);
        return;
    }
#endif
    (void)isa;
    for (int i = 0; i < n; i++) o[i] = (g[i] / (1.0f + exp_scalar(0.0f - g[i]))) * u[i];
}

static void silu_task(const void *ctx, long task) {
    const silu_job *j = (const silu_job *)ctx;
    for (long t = task * j->rows; t < j->n && t < (task + 1) * j->rows; t++) {
        const float *g = j->gu + t * j->ldg;
        sf_silu_mul_row(g, g + j->inter, j->out + t * j->ldo, j->inter, j->isa);
    }
}

int sf_silu_mul(const float *gu, long ldg, int n, int inter, float *out, long ldo, int nthreads) {
    silu_job j = {gu, ldg, ldo, n, inter, sf_cpu_isa(), rows_per_task(inter), out};
    sf_parallel(silu_task, &j, (n + j.rows - 1) / j.rows, nthreads);
    return 0;
}

/* ---------------------------------------------------------- embedding */

/* out[t] = table[ids[t]] as float32 (table float32 or bf16, `rows` rows of
 * d); -3, nothing written, when an id is outside the table. */
int sf_embed(const void *table, int bf16, int d, long rows, const int64_t *ids, int n, float *out) {
    for (int t = 0; t < n; t++)
        if (ids[t] < 0 || ids[t] >= rows) return -3;
    for (int t = 0; t < n; t++) {
        if (bf16) {
            const uint16_t *r = (const uint16_t *)table + ids[t] * (long)d;
            for (int i = 0; i < d; i++) out[(long)t * d + i] = bf16_to_f32(r[i]);
        } else {
            memcpy(out + (long)t * d, (const float *)table + ids[t] * (long)d, sizeof(float) * d);
        }
    }
    return 0;
}

/* ------------------------------------------------------ the whole stack */

/* Every decoder layer of a step in one call (one Python call a step instead
 * of seven a layer: at batch 1 those calls were a third of the step). The
 * same kernels, in the same order, as the layer-by-layer path. x [n, hidden]
 * is the residual stream, in and out; the rest is scratch (parts: [m->parts,
 * n, hidden], the row-parallel layers' pieces). */
/* A layer's two halves up to their row-parallel pieces in `parts` (the
 * caller adds them into x: gathered across ranks in sf_tp.c), or with
 * add_to, added into it here (sf_linear_parts_add: sf_combine's bits):
 * attention (norm, qkv, attention, o's pieces) and the MLP (norm, gate_up,
 * SwiGLU, down's pieces). */
int sf_layer_attn(const sf_model *m, const sf_layer *L, const float *x, int n, const int64_t *pos,
                  const int64_t *cells, const int64_t *feed_of, const int64_t *tables, int width, float *h,
                  float *qkv, float *att, float *parts, float *add_to, int nthreads) {
    int H = m->hidden, q = m->nh * m->hd, qkvw = (m->nh + 2 * m->nkv) * m->hd, g = m->parts;
    SF_TRY(sf_rmsnorm(x, H, n, H, L->attn_norm, m->eps, h, H, nthreads));
    SF_TRY(sf_linear(h, H, n, H, L->qkv, m->wtype, qkvw, L->qkv_b, qkv, qkvw, 0, nthreads));
    SF_TRY(sf_attention(qkv, qkvw, n, m->nh, m->nkv, m->hd, pos, cells, feed_of, tables, width, m->cos, m->sin,
                        L->q_norm, L->k_norm, m->eps, L->k_pool, L->v_pool, m->kv_bf16, m->head_stride, m->page,
                        m->scale, att, q, nthreads));
    if (add_to)
        SF_TRY(sf_linear_parts_add(att, q, n, q / g, g, L->o, m->wtype, H, parts, L->o_b, add_to, H, nthreads));
    else
        SF_TRY(sf_linear_parts(att, q, n, q / g, g, L->o, m->wtype, H, parts, nthreads));
    return 0;
}

int sf_layer_mlp(const sf_model *m, const sf_layer *L, const float *x, int n, float *h, float *gu, float *act,
                 float *parts, float *add_to, int nthreads) {
    int H = m->hidden, g = m->parts;
    SF_TRY(sf_rmsnorm(x, H, n, H, L->mlp_norm, m->eps, h, H, nthreads));
    if (L->swiglu) { /* gate_up's panels in (gate, up) pairs: act straight from its epilogue */
        SF_TRY(sf_linear_swiglu(h, H, n, H, L->gate_up, m->wtype, m->inter, L->gate_up_b, act, m->inter, nthreads));
    } else {
        SF_TRY(sf_linear(h, H, n, H, L->gate_up, m->wtype, 2 * m->inter, L->gate_up_b, gu, 2 * m->inter, 0,
                         nthreads));
        SF_TRY(sf_silu_mul(gu, 2 * m->inter, n, m->inter, act, m->inter, nthreads));
    }
    if (add_to)
        SF_TRY(sf_linear_parts_add(act, m->inter, n, m->inter / g, g, L->down, m->wtype, H, parts, L->down_b, add_to,
                                   H, nthreads));
    else
        SF_TRY(sf_linear_parts(act, m->inter, n, m->inter / g, g, L->down, m->wtype, H, parts, nthreads));
    return 0;
}

/* A big step's tokens go through the layers in passes whose activations
 * (gate_up's outputs, SwiGLU's, q/k/v, the residual: PASS_BYTES) stay in
 * the last-level cache; one 4096-token pass sent gate_up's 50 MB to DRAM
 * and back. Rows are batch-invariant, so a pass changes no bit, as long as
 * no token reads a cell that a later pass writes (passes_safe), and of at
 * least the fold's tokens (o's and down's pieces stay folded in cache). */
#define PASS_BYTES (8L << 20)
static _Atomic long g_pass_bytes; /* 0: PASS_BYTES (sf_cpu_pass_bytes) */

void sf_cpu_pass_bytes(long bytes) { atomic_store(&g_pass_bytes, bytes > 0 ? bytes : 0); }

typedef struct {
    int64_t block, feed;
} written;

static int by_block(const void *a, const void *b) {
    int64_t x = ((const written *)a)->block, y = ((const written *)b)->block;
    return (x > y) - (x < y);
}

/* Whether every key a token reads from this step is written by its pass or
 * an earlier one: feeds in order, each feed's positions increasing (its
 * later tokens write only later positions), each token writing the cell its
 * table names, and no block this step writes in another feed's table (the
 * engine's copy-on-write keeps them apart; a step that shares one runs in
 * one pass, every write before any read). */
static int passes_safe(const sf_model *m, int n, const int64_t *pos, const int64_t *cells, const int64_t *feed_of,
                       const int64_t *tables, int width) {
    int page = m->page;
    for (int t = 0; t < n; t++) {
        if (t && (feed_of[t] < feed_of[t - 1] || (feed_of[t] == feed_of[t - 1] && pos[t] <= pos[t - 1]))) return 0;
        const int64_t *row = tables + feed_of[t] * (long)width;
        if (pos[t] < 0 || pos[t] / page >= width || cells[t] != row[pos[t] / page] * page + pos[t] % page) return 0;
    }
    written *w = (written *)malloc(sizeof(written) * n);
    if (!w) return 0;
    for (int t = 0; t < n; t++) w[t] = (written){cells[t] / page, feed_of[t]};
    qsort(w, n, sizeof(written), by_block);
    int ok = 1;
    for (int a = 0, b; a < n && ok; a = b) { /* feed_of[a..b): one feed; its keys' blocks 0..pos[b-1] / page */
        for (b = a + 1; b < n && feed_of[b] == feed_of[a];) b++;
        const int64_t *row = tables + feed_of[a] * (long)width;
        for (int64_t i = 0; i <= pos[b - 1] / page && ok; i++) {
            written key = {row[i], 0}, *hit = (written *)bsearch(&key, w, n, sizeof(written), by_block);
            if (!hit) continue;
            while (hit > w && hit[-1].block == row[i]) hit--;
            for (; hit < w + n && hit->block == row[i]; hit++)
                if (hit->feed != feed_of[a]) ok = 0;
        }
    }
    free(w);
    return ok;
}

static int pass_tokens(const sf_model *m, int n, const int64_t *pos, const int64_t *cells, const int64_t *feed_of,
                       const int64_t *tables, int width, int nthreads) {
    long budget = atomic_load(&g_pass_bytes), per = 4L * (3L * m->inter + (long)(m->nh + 2 * m->nkv) * m->hd +
                                                          2L * m->hidden);
    long ch = (budget ? budget : PASS_BYTES) / per, least = budget ? 1 : sf_fold_tokens(nthreads);
    if (ch < least) ch = least;
    if (n < 2 * ch || !passes_safe(m, n, pos, cells, feed_of, tables, width)) return n;
    long passes = n / ch;
    return (int)((n + passes - 1) / passes); /* even passes, none under ch */
}

int sf_forward(const sf_model *m, float *x, int n, const int64_t *pos, const int64_t *cells,
               const int64_t *feed_of, const int64_t *tables, int width, float *h, float *qkv, float *att,
               float *gu, float *act, float *parts, int nthreads) {
    int ch = pass_tokens(m, n, pos, cells, feed_of, tables, width, nthreads);
    for (int t0 = 0; t0 < n; t0 += ch) {
        int tn = n - t0 < ch ? n - t0 : ch;
        float *xc = x + (long)t0 * m->hidden;
        for (int l = 0; l < m->n_layers; l++) {
            const sf_layer *L = &m->layers[l];
            SF_TRY(sf_layer_attn(m, L, xc, tn, pos + t0, cells + t0, feed_of + t0, tables, width, h, qkv, att, parts,
                                 xc, nthreads));
            SF_TRY(sf_layer_mlp(m, L, xc, tn, h, gu, act, parts, xc, nthreads));
        }
    }
    return 0;
}

/* A step's whole forward in one call: the embedding of ids (NULL: x holds
 * the embeddings already), sf_forward, the final RMSNorm of the rows wanted
 * (rows: nrows indices of the step's tokens; NULL: every token, in order)
 * and the LM head into logits [nrows, vocab]; with picks, each row's greedy
 * token and non-finite flag (sf_greedy). One call, not five: Python between
 * them runs on a cache the weights have just flushed. -3: an id outside the
 * table or a row outside the step; nothing run. */
int sf_forward_head(const sf_model *m, const sf_head *hd, float *x, const int64_t *ids, int n, const int64_t *pos,
                    const int64_t *cells, const int64_t *feed_of, const int64_t *tables, int width, float *h,
                    float *qkv, float *att, float *gu, float *act, float *parts, const int64_t *rows, int nrows,
                    float *logits, int64_t *picks, uint8_t *bad, int nthreads) {
    int H = m->hidden;
    if (rows) {
        if (nrows > n) return -3;
        for (int i = 0; i < nrows; i++)
            if (rows[i] < 0 || rows[i] >= n) return -3;
    } else if (nrows != n && nrows != 0) {
        return -3;
    }
    if (ids && sf_embed(hd->embed, hd->embed_bf16, H, hd->embed_rows, ids, n, x)) return -3;
    SF_TRY(sf_forward(m, x, n, pos, cells, feed_of, tables, width, h, qkv, att, gu, act, parts, nthreads));
    if (nrows == 0) return 0;
    if (rows) /* row by row (a norm's row depends on that row only) */
        for (int i = 0; i < nrows; i++)
            SF_TRY(sf_rmsnorm(x + rows[i] * H, H, 1, H, hd->norm, m->eps, h + (long)i * H, H, 1));
    else
        SF_TRY(sf_rmsnorm(x, H, n, H, hd->norm, m->eps, h, H, nthreads));
    SF_TRY(sf_linear(h, H, nrows, H, hd->w, m->wtype, hd->vocab, NULL, logits, hd->vocab, 0, nthreads));
    return picks ? sf_greedy(logits, hd->vocab, nrows, hd->vocab, picks, bad) : 0;
}

/* ------------------------------------------------- the memory's read rate */

typedef struct {
    const uint64_t *p;
    long words, per; /* per task */
    uint64_t *sink;
} probe_job;

/* A task's share as four interleaved streams (what the GEMV does), xor-summed. */
static void probe_task(const void *ctx, long task) {
    const probe_job *j = (const probe_job *)ctx;
    long at = task * j->per, n = j->words - at < j->per ? j->words - at : j->per, q = n / 4;
    const uint64_t *a = j->p + at;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (long i = 0; i < q; i++) s0 ^= a[i], s1 ^= a[q + i], s2 ^= a[2 * q + i], s3 ^= a[3 * q + i];
    for (long i = 4 * q; i < n; i++) s0 ^= a[i];
    j->sink[task] = s0 ^ s1 ^ s2 ^ s3;
}

/* Reads `bytes` at p once on nthreads threads, in 128 KiB tasks (the
 * benches' read-bandwidth probe: a GEMV's access pattern, not a library's
 * reduction). Returns an xor of the words, or 0 without memory. */
uint64_t sf_read_probe(const void *p, long bytes, int nthreads) {
    probe_job j = {(const uint64_t *)p, bytes / 8, 16384, NULL};
    long tasks = (j.words + j.per - 1) / j.per;
    j.sink = (uint64_t *)calloc(tasks > 0 ? tasks : 1, sizeof(uint64_t));
    if (!j.sink) return 0;
    sf_parallel(probe_task, &j, tasks, nthreads);
    uint64_t s = 0;
    for (long t = 0; t < tasks; t++) s ^= j.sink[t];
    free(j.sink);
    return s;
}

