/* Attention over the paged KV pool (sf_attention; the layer stack in
 * sf_cpu.c calls it): q/k norm and RoPE in place, this step's K/V into their
 * cells, then each (token, KV head) over cells 0..pos of its own sequence,
 * keys in order: scores, max, exp, an ordered 8-lane sum, then a value fma
 * chain over the keys. A row's bits depend only on its own keys. */
#include "sf_attn.h"
#include "sf_lanes.h"

#include <stdatomic.h>
#include <stdlib.h>

#if SF_X86
/* Four of dot_avx2 side by side (one a, four b): the same chains, four
 * times the work in flight (one dot's chain is latency-bound). */
__attribute__((target("avx2,fma"))) static void dot4_avx2(const float *a, const void *const *b, int bb, int d,
                                                          float *out) {
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    if (bb) {
        const uint16_t *p0 = (const uint16_t *)b[0], *p1 = (const uint16_t *)b[1], *p2 = (const uint16_t *)b[2],
                       *p3 = (const uint16_t *)b[3];
        for (int i = 0; i < d; i += 8) {
            __m256 av = _mm256_loadu_ps(a + i);
            c0 = _mm256_fmadd_ps(av, load_bf16x8(p0 + i), c0);
            c1 = _mm256_fmadd_ps(av, load_bf16x8(p1 + i), c1);
            c2 = _mm256_fmadd_ps(av, load_bf16x8(p2 + i), c2);
            c3 = _mm256_fmadd_ps(av, load_bf16x8(p3 + i), c3);
        }
    } else {
        const float *p0 = (const float *)b[0], *p1 = (const float *)b[1], *p2 = (const float *)b[2],
                    *p3 = (const float *)b[3];
        for (int i = 0; i < d; i += 8) {
            __m256 av = _mm256_loadu_ps(a + i);
            c0 = _mm256_fmadd_ps(av, _mm256_loadu_ps(p0 + i), c0);
            c1 = _mm256_fmadd_ps(av, _mm256_loadu_ps(p1 + i), c1);
            c2 = _mm256_fmadd_ps(av, _mm256_loadu_ps(p2 + i), c2);
            c3 = _mm256_fmadd_ps(av, _mm256_loadu_ps(p3 + i), c3);
        }
    }
    out[0] = tree8_avx2(c0);
    out[1] = tree8_avx2(c1);
    out[2] = tree8_avx2(c2);
    out[3] = tree8_avx2(c3);
}
#endif

#if SF_X86
/* norm_rope's multiplies and adds, 8 elements at a time (no fma: the same
 * roundings as the scalar loop); returns how many of `half` it did. */
__attribute__((target("avx2,fma"))) static int norm_rope_avx2(float *v, int hd, const float *nw, float inv,
                                                              const float *c, const float *s) {
    int i = 0, half = hd / 2;
    if (nw) {
        __m256 iv = _mm256_set1_ps(inv);
        for (; i + 8 <= hd; i += 8)
            _mm256_storeu_ps(v + i, _mm256_mul_ps(_mm256_loadu_ps(nw + i), _mm256_mul_ps(_mm256_loadu_ps(v + i), iv)));
        for (; i < hd; i++) v[i] = nw[i] * (v[i] * inv);
    }
    for (i = 0; i + 8 <= half; i += 8) {
        __m256 x1 = _mm256_loadu_ps(v + i), x2 = _mm256_loadu_ps(v + i + half), cv = _mm256_loadu_ps(c + i),
               sv = _mm256_loadu_ps(s + i);
        _mm256_storeu_ps(v + i, _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv)));
        _mm256_storeu_ps(v + i + half, _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv)));
    }
    return i;
}
#endif

static void norm_rope(const attn_args *a, float *v, int64_t p, const float *nw, int isa) {
    int hd = a->hd, half = hd / 2, i = 0;
    float inv = nw ? 1.0f / sqrtf(dot(v, v, 0, hd, isa) / (float)hd + a->eps) : 0.0f;
    const float *c = a->cos + p * half, *s = a->sin + p * half;
#if SF_X86
    if (isa >= 1) {
        i = norm_rope_avx2(v, hd, nw, inv, c, s);
        nw = NULL;
    }
#endif
    if (nw)
        for (int e = 0; e < hd; e++) v[e] = nw[e] * (v[e] * inv);
    for (; i < half; i++) {
        float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c[i] - x2 * s[i];
        v[i + half] = x2 * c[i] + x1 * s[i];
    }
}

static void store_cell(const attn_args *a, void *pool, int g, int64_t cell, const float *src, int isa) {
    long at = g * a->head_stride + cell * a->hd;
    if (a->kv_bf16) {
        uint16_t *d = (uint16_t *)pool + at;
        int i = 0;
#if SF_X86
        if (isa >= 1) i = to_bf16_avx2(src, d, a->hd);
#endif
        (void)isa;
        for (; i < a->hd; i++) d[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)pool + at, src, sizeof(float) * a->hd);
    }
}


#if SF_X86
/* Columns [c0, c0 + 8 NV) of o = sum_j e[j] v_j: NV accumulators kept in
 * registers across the keys (the same fma chain per element as below). */
#define VSUM_PASS(NV, NAME)                                                                                   \
    __attribute__((target("avx2,fma"))) static void NAME(const attn_args *a, int g, const int64_t *table,      \
                                                         int keys, const float *e, float *o, int c0) {        \
        __m256 r0 = _mm256_setzero_ps(), r1 = r0, r2 = r0, r3 = r0;                                           \
        for (int j = 0, b = 0, off = 0; j < keys; j++) {                                                      \
            int64_t cell = table[b] * a->page + off;                                                          \
            if (++off == a->page) off = 0, b++;                                                               \
            long at = g * a->head_stride + cell * a->hd + c0;                                                 \
            __m256 ev = _mm256_set1_ps(e[j]);                                                                 \
            if (a->kv_bf16) {                                                                                 \
                const uint16_t *v = (const uint16_t *)a->vp + at;                                             \
                r0 = _mm256_fmadd_ps(ev, load_bf16x8(v), r0);                                                 \
                if (NV > 1) r1 = _mm256_fmadd_ps(ev, load_bf16x8(v + 8), r1);                                 \
                if (NV > 2) r2 = _mm256_fmadd_ps(ev, load_bf16x8(v + 16), r2);                                \
                if (NV > 3) r3 = _mm256_fmadd_ps(ev, load_bf16x8(v + 24), r3);                                \
            } else {                                                                                          \
                const float *v = (const float *)a->vp + at;                                                   \
                r0 = _mm256_fmadd_ps(ev, _mm256_loadu_ps(v), r0);                                             \
                if (NV > 1) r1 = _mm256_fmadd_ps(ev, _mm256_loadu_ps(v + 8), r1);                             \
                if (NV > 2) r2 = _mm256_fmadd_ps(ev, _mm256_loadu_ps(v + 16), r2);                            \
                if (NV > 3) r3 = _mm256_fmadd_ps(ev, _mm256_loadu_ps(v + 24), r3);                            \
            }                                                                                                 \
        }                                                                                                     \
        _mm256_storeu_ps(o + c0, r0);                                                                         \
        if (NV > 1) _mm256_storeu_ps(o + c0 + 8, r1);                                                         \
        if (NV > 2) _mm256_storeu_ps(o + c0 + 16, r2);                                                        \
        if (NV > 3) _mm256_storeu_ps(o + c0 + 24, r3);                                                        \
    }
VSUM_PASS(4, vsum4)
VSUM_PASS(1, vsum1)
#endif

/* o[0..d) = sum_j e[j] * v_j in key order, one fma chain per element from 0. */
static void value_sum(const attn_args *a, int g, const int64_t *table, int keys, const float *e, float *o,
                      int isa) {
    int hd = a->hd;
#if SF_X86
    if (isa >= 1 && hd % 8 == 0) {
        int c = 0;
        for (; c + 32 <= hd; c += 32) vsum4(a, g, table, keys, e, o, c);
        for (; c < hd; c += 8) vsum1(a, g, table, keys, e, o, c);
        return;
    }
#endif
    (void)isa;
    for (int i = 0; i < hd; i++) o[i] = 0.0f;
    for (int j = 0, b = 0, off = 0; j < keys; j++) {
        int64_t cell = table[b] * a->page + off;
        if (++off == a->page) off = 0, b++;
        const void *vp = cell_ptr(a, a->vp, g, cell);
        float ej = e[j];
        if (a->kv_bf16) {
            const uint16_t *v = (const uint16_t *)vp;
            for (int i = 0; i < hd; i++) o[i] = fmaf(ej, bf16_to_f32(v[i]), o[i]);
        } else {
            const float *v = (const float *)vp;
            for (int i = 0; i < hd; i++) o[i] = fmaf(ej, v[i], o[i]);
        }
    }
}

static _Thread_local float *t_scores;
static _Thread_local long t_cap;

static float *scores_buf(long n) {
    if (n > t_cap) {
        free(t_scores);
        t_scores = (float *)malloc(sizeof(float) * n);
        t_cap = t_scores ? n : 0;
    }
    return t_scores;
}

/* One layer: q/k norm (Qwen3) and RoPE in place, this step's K/V written
 * to their cells, then each (token, kv head) attends over cells 0..pos of
 * its own sequence. Returns -1 when scratch memory cannot be had. */
typedef struct {
    attn_args a;
    int isa, chunk; /* tokens per phase-2 task */
    int block_t; /* tokens a block of sf_attend512, 0: the path per query */
    _Atomic int failed;
} attn_job;

#define STORE_CHUNK 16

static void store_token(const attn_job *j, long t);

/* Phase 1, STORE_CHUNK tokens: q/k norm and RoPE in place, K/V into their cells. */
static void attn_store_task(const void *ctx, long task) {
    const attn_job *j = (const attn_job *)ctx;
    for (long t = task * STORE_CHUNK; t < j->a.n && t < (task + 1) * STORE_CHUNK; t++) store_token(j, t);
}

static void store_token(const attn_job *j, long t) {
    const attn_args *a = &j->a;
    int hd = a->hd;
    float *q = a->qkv + t * a->ldqkv, *k = q + (long)a->nh * hd, *v = k + (long)a->nkv * hd;
    for (int h = 0; h < a->nh; h++) norm_rope(a, q + (long)h * hd, a->pos[t], a->qn, j->isa);
    for (int g = 0; g < a->nkv; g++) {
        norm_rope(a, k + (long)g * hd, a->pos[t], a->kn, j->isa);
        store_cell(a, a->kp, g, a->cells[t], k + (long)g * hd, j->isa);
        store_cell(a, a->vp, g, a->cells[t], v + (long)g * hd, j->isa);
    }
}

static void attend(attn_job *j, int t, int g);

/* Phase 2, (a chunk of tokens, a kv head): their query heads over cells 0..pos. */
static void attn_task(const void *ctx, long task) {
    attn_job *j = (attn_job *)ctx;
    const attn_args *a = &j->a;
    long chunks = (a->n + j->chunk - 1) / j->chunk, t = (task % chunks) * j->chunk;
    long end = t + j->chunk < a->n ? t + j->chunk : a->n;
    int g = (int)(task / chunks);
    if (j->block_t) { /* the AVX-512 path: blocks of tokens of one feed x query heads */
        int g_per = a->nh / a->nkv, hb = g_per < ATTN_QMAX ? g_per : ATTN_QMAX;
        while (t < end) {
            int nt = 1;
            while (nt < j->block_t && t + nt < end && a->feed_of[t + nt] == a->feed_of[t]) nt++;
            for (int h = g * g_per; h < (g + 1) * g_per; h += hb)
                if (sf_attend512(a, (int)t, nt, g, h, (g + 1) * g_per - h < hb ? (g + 1) * g_per - h : hb))
                    atomic_store(&j->failed, 1);
            t += nt;
        }
        return;
    }
    for (; t < end; t++) attend(j, (int)t, g);
}

static void attend(attn_job *j, int t, int g) {
    const attn_args *a = &j->a;
    int isa = j->isa, hd = a->hd, page = a->page, g_per = a->nh / a->nkv;
    int keys = (int)a->pos[t] + 1, padded = (keys + 7) / 8 * 8;
    const int64_t *table = a->tables + a->feed_of[t] * (long)a->width;
    float *s = scores_buf(padded);
    if (!s) {
        atomic_store(&j->failed, 1);
        return;
    }
    for (int h = g * g_per; h < (g + 1) * g_per; h++) {
        const float *q = a->qkv + (long)t * a->ldqkv + (long)h * hd;
        float m = -INFINITY;
        int i = 0, b = 0, off = 0;
#if SF_X86
        if (isa >= 1 && hd % 8 == 0)
            for (; i + 4 <= keys; i += 4) { /* four keys at once: the same dot per key */
                const void *kp[4];
                for (int u = 0; u < 4; u++) {
                    kp[u] = cell_ptr(a, a->kp, g, table[b] * page + off);
                    if (++off == page) off = 0, b++;
                }
                dot4_avx2(q, kp, a->kv_bf16, hd, s + i);
                for (int u = 0; u < 4; u++) {
                    s[i + u] = s[i + u] * a->scale;
                    if (s[i + u] > m) m = s[i + u];
                }
            }
#endif
        for (; i < keys; i++) {
            int64_t cell = table[b] * page + off;
            if (++off == page) off = 0, b++;
            float si = dot(q, cell_ptr(a, a->kp, g, cell), a->kv_bf16, hd, isa) * a->scale;
            s[i] = si;
            if (si > m) m = si;
        }
        for (int i = keys; i < padded; i++) s[i] = -INFINITY;
        exp_shift(s, padded, m, isa);
#if SF_X86
        float l = isa >= 1 ? sum_avx2(s, padded) : sum_scalar(s, padded);
#else
        float l = sum_scalar(s, padded);
#endif
        float *o = a->out + (long)t * a->ldo + (long)h * hd;
        value_sum(a, g, table, keys, s, o, isa);
        for (int i = 0; i < hd; i++) o[i] = o[i] / l;
    }
}

/* One layer: phase 1 for every token, then phase 2 (every cell of the step
 * is written before any is read). Returns -1 when scratch memory cannot be had. */
int sf_attention(float *qkv, long ldqkv, int n, int nh, int nkv, int hd, const int64_t *pos,
                 const int64_t *cells, const int64_t *feed_of, const int64_t *tables, int width, const float *cos,
                 const float *sin, const float *qn, const float *kn, float eps, void *kp, void *vp, int kv_bf16,
                 long head_stride, int page, float scale, float *out, long ldo, int nthreads) {
    if (n <= 0) return 0;
    attn_job j = {{qkv, ldqkv, n, nh, nkv, hd, pos, cells, feed_of, tables, width, cos, sin, qn, kn, eps, kp, vp,
                   kv_bf16, head_stride, page, scale, out, ldo},
                  sf_cpu_isa(), 1, 0, 0};
    double keys = 0;
    for (int t = 0; t < n; t++) keys += (double)pos[t] + 1;
    double work = keys / n * hd * (nh / nkv); /* per (token, kv head) */
    j.chunk = work >= 16384 ? 1 : (int)(16384 / work);
    if (j.isa >= SF_ISA_AVX512 && hd % 8 == 0) {
        int g_per = nh / nkv, runs = 0; /* runs: a feed with two tokens or more (a decode's blocks are single) */
        for (int t = 1; t < n && !runs; t++) runs = feed_of[t] == feed_of[t - 1];
        j.block_t = g_per >= ATTN_QMAX || !runs ? 1 : ATTN_QMAX / g_per;
        j.chunk = (j.chunk + j.block_t - 1) / j.block_t * j.block_t; /* whole blocks a task */
    }
    if (j.chunk > n) j.chunk = n;
    sf_parallel(attn_store_task, &j, (n + STORE_CHUNK - 1) / STORE_CHUNK, nthreads);
    sf_parallel(attn_task, &j, (long)((n + j.chunk - 1) / j.chunk) * nkv, nthreads);
    return atomic_load(&j.failed) ? -1 : 0;
}
