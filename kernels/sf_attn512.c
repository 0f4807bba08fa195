/* Attention's AVX-512 path (sf_attn.c's phase 2 calls it): a block of up to
 * ATTN_QMAX queries (consecutive tokens of one feed x the query heads of one
 * KV head) reads each key and value once. The arithmetic is sf_attn.c's,
 * operation for operation, so a row's bits are the same on every path:
 * - a score is 8 lane chains over the dims (lane l takes dims l, l+8, ...,
 *   fma from 0) and tree8, times the scale. Two queries share a register
 *   (one 8-lane half each), and tree8 runs on 16 scores at once;
 * - max, exp and the 8-lane sum per query as sf_attn.c does them;
 * - an output element is one fma chain over its query's keys in order,
 *   from 0, then divided by the sum: 16 elements a register.
 * Masked keys (past a query's position) never enter its chains. */
#include "sf_attn.h"
#include "sf_lanes.h"

#include <stdlib.h>

#if SF_X86

/* dims [i, i + 8) of a key, in both halves */
__attribute__((always_inline, target(T512))) static inline __m512 key_x2(const void *k, int bb, int i) {
    if (bb) {
        __m256i h = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)((const uint16_t *)k + i)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_broadcast_f32x8(_mm256_loadu_ps((const float *)k + i));
}

/* tree8 of 16 chains' 8 lanes at once. x[2i + u] holds unit u's key i, each
 * register two queries' chains (low half, high half); block b of the result
 * is unit b >> 1, half b & 1, keys 0..3 in its lanes. Every add is one of
 * tree8_avx2's, its operands in the same order (lanes l + (l+4), then
 * (l) + (l+2), then 0 + 1). */
__attribute__((always_inline, target(T512))) static inline __m512 tree8_x16(const __m512 x[8]) {
    __m512 s[4];
    for (int m = 0; m < 4; m++)
        s[m] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * m], x[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(x[2 * m], x[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 t0 = _mm512_add_ps(_mm512_shuffle_ps(s[0], s[1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(s[0], s[1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 t1 = _mm512_add_ps(_mm512_shuffle_ps(s[2], s[3], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(s[2], s[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The cells of keys 0, 1, ... of a table, in order. */
typedef struct {
    const attn_args *a;
    const int64_t *table;
    int g, b, off;
} key_walk;

static inline const void *next_key(key_walk *w, const void *pool) {
    int64_t cell = w->table[w->b] * w->a->page + w->off;
    if (++w->off == w->a->page) w->off = 0, w->b++;
    return cell_ptr(w->a, pool, w->g, cell);
}

/* Scores of P query pairs (qp: [P][hd / 8][16], a pair's dims side by side)
 * against keys 0..kmax-1, KG groups of 4 keys a pass (P * KG <= 4 units of
 * 4 registers): s[q * ss + j], scaled. Keys past kmax in a pass repeat the
 * last and are not stored. */
__attribute__((always_inline, target(T512))) static inline void scores_x(const attn_args *a, key_walk w,
                                                                         const float *qp, const int P, const int KG,
                                                                         int nq, int kmax, float *s, long ss) {
    const int NU = P * KG, hd = a->hd, bb = a->kv_bf16;
    const __m512 sc = _mm512_set1_ps(a->scale);
    for (int j0 = 0; j0 < kmax; j0 += 4 * KG) {
        const void *kp[16];
        for (int k = 0; k < 4 * KG; k++) kp[k] = j0 + k < kmax ? next_key(&w, a->kp) : kp[k - 1];
        __m512 acc[4][4];
        for (int u = 0; u < NU; u++)
            for (int k = 0; k < 4; k++) acc[u][k] = _mm512_setzero_ps();
        for (int i = 0; i < hd; i += 8) {
            for (int kg = 0; kg < KG; kg++)
                for (int k = 0; k < 4; k++) {
                    __m512 kv = key_x2(kp[4 * kg + k], bb, i);
                    for (int p = 0; p < P; p++)
                        acc[p * KG + kg][k] = _mm512_fmadd_ps(_mm512_loadu_ps(qp + (long)p * 2 * hd + 2 * i), kv,
                                                              acc[p * KG + kg][k]);
                }
        }
        for (int u = 0; u < NU; u += 2) {
            __m512 x[8];
            for (int k = 0; k < 4; k++) {
                x[2 * k] = acc[u][k];
                x[2 * k + 1] = u + 1 < NU ? acc[u + 1][k] : _mm512_setzero_ps();
            }
            __m512 r = _mm512_mul_ps(tree8_x16(x), sc);
            for (int blk = 0; blk < 4; blk++) {
                int unit = u + (blk >> 1), q = 2 * (unit / KG) + (blk & 1), j = j0 + 4 * (unit % KG);
                if (unit >= NU || q >= nq || j >= kmax) continue;
                __m128 v = blk == 0   ? _mm512_castps512_ps128(r)
                           : blk == 1 ? _mm512_extractf32x4_ps(r, 1)
                           : blk == 2 ? _mm512_extractf32x4_ps(r, 2)
                                      : _mm512_extractf32x4_ps(r, 3);
                _mm_storeu_ps(s + q * ss + j, v);
            }
        }
    }
}

__attribute__((target(T512))) static void scores(const attn_args *a, key_walk w, const float *qp, int nq,
                                                  int kmax, float *s, long ss) {
    switch ((nq + 1) / 2) {
    case 1: scores_x(a, w, qp, 1, 4, nq, kmax, s, ss); break;
    case 2: scores_x(a, w, qp, 2, 2, nq, kmax, s, ss); break;
    case 3: scores_x(a, w, qp, 3, 1, nq, kmax, s, ss); break;
    default: scores_x(a, w, qp, 4, 1, nq, kmax, s, ss); break;
    }
}

/* dims [c, c + 16) of a value row, lanes past hd zero */
__attribute__((always_inline, target(T512))) static inline __m512 value16(const void *v, int bb, int c, int hd) {
    __mmask16 m = hd - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (hd - c)) - 1);
    if (bb)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)v + c)), 16));
    return _mm512_maskz_loadu_ps(m, (const float *)v + c);
}

/* o_q = (sum_j e_q[j] v_j) / l_q for NQ queries, dims [c0, c0 + 16 NV):
 * NQ x NV chains in registers, each value row read once. */
__attribute__((always_inline, target(T512))) static inline void values_x(const attn_args *a, key_walk w,
                                                                         const int NQ, const int NV, int c0,
                                                                         const float *s, long ss, const int *keys,
                                                                         const float *l, float *const *o) {
    const int hd = a->hd, bb = a->kv_bf16;
    int kmax = 0;
    for (int u = 0; u < NQ; u++) kmax = keys[u] > kmax ? keys[u] : kmax;
    __m512 acc[4][4];
    for (int u = 0; u < NQ; u++)
        for (int v = 0; v < NV; v++) acc[u][v] = _mm512_setzero_ps();
    for (int j = 0; j < kmax; j++) {
        const void *vp = next_key(&w, a->vp);
        __m512 vv[4];
        for (int v = 0; v < NV; v++) vv[v] = value16(vp, bb, c0 + 16 * v, hd);
        for (int u = 0; u < NQ; u++) {
            if (j >= keys[u]) continue;
            __m512 e = _mm512_set1_ps(s[u * ss + j]);
            for (int v = 0; v < NV; v++) acc[u][v] = _mm512_fmadd_ps(e, vv[v], acc[u][v]);
        }
    }
    for (int u = 0; u < NQ; u++) {
        __m512 lv = _mm512_set1_ps(l[u]);
        for (int v = 0; v < NV; v++) {
            int c = c0 + 16 * v;
            __mmask16 m = hd - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (hd - c)) - 1);
            _mm512_mask_storeu_ps(o[u] + c, m, _mm512_div_ps(acc[u][v], lv));
        }
    }
}

#define VALUES_NV(NQ)                                                                                         \
    switch (nv) {                                                                                             \
    case 1: values_x(a, w, NQ, 1, c0, s, ss, keys, l, o); break;                                              \
    case 2: values_x(a, w, NQ, 2, c0, s, ss, keys, l, o); break;                                              \
    case 3: values_x(a, w, NQ, 3, c0, s, ss, keys, l, o); break;                                              \
    default: values_x(a, w, NQ, 4, c0, s, ss, keys, l, o); break;                                             \
    }

__attribute__((target(T512))) static void values(const attn_args *a, key_walk w, int nq, const float *s, long ss,
                                                  const int *keys, const float *l, float *const *o) {
    for (int c0 = 0; c0 < a->hd; c0 += 64) {
        int nv = (a->hd - c0 + 15) / 16;
        switch (nq) {
        case 1: VALUES_NV(1) break;
        case 2: VALUES_NV(2) break;
        case 3: VALUES_NV(3) break;
        default: VALUES_NV(4) break;
        }
    }
}

/* Queries q and q + 1's dims side by side, 8 each: [(nq + 1) / 2][hd / 8][16]
 * (a missing second query: zeros). */
__attribute__((target(T512))) static void pack_pairs(const float *const *qs, int nq, int hd, float *qp) {
    for (int q = 0; q < nq; q += 2)
        for (int i = 0; i < hd; i += 8) {
            __m256 lo = _mm256_loadu_ps(qs[q] + i), hi = q + 1 < nq ? _mm256_loadu_ps(qs[q + 1] + i) : _mm256_setzero_ps();
            _mm512_storeu_ps(qp + (long)q * hd + 2 * i, _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1));
        }
}

/* s[0..k) to exp(s - max), the tail to its multiple of 8 zeroed; returns
 * their 8-lane sum (sf_attn.c's, with its max: NaN scores never the max, and
 * which zero is the max cannot change exp(s - max), bit for bit). */
__attribute__((target(T512))) static float softmax_num(float *s, int k) {
    int padded = (k + 7) / 8 * 8, j = 0;
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= k; j += 16) mv = _mm512_max_ps(_mm512_loadu_ps(s + j), mv); /* a NaN in s: mv kept */
    float m = _mm512_reduce_max_ps(mv);
    for (; j < k; j++)
        if (s[j] > m) m = s[j];
    for (j = k; j < padded; j++) s[j] = -INFINITY;
    exp_shift(s, padded, m, SF_ISA_AVX2);
    return sum_avx2(s, padded);
}

static _Thread_local float *t_buf;
static _Thread_local long t_cap;

int sf_attend512(const attn_args *a, int t, int nt, int g, int h0, int nh) {
    int hd = a->hd, nq = nt * nh, keys[ATTN_QMAX], kmax = 0;
    for (int u = 0; u < nt; u++) {
        int k = (int)a->pos[t + u] + 1;
        for (int hh = 0; hh < nh; hh++) keys[u * nh + hh] = k;
        kmax = k > kmax ? k : kmax;
    }
    long ss = (kmax + 7) / 8 * 8, need = ATTN_QMAX * 2L * hd + nq * ss;
    if (need > t_cap) {
        free(t_buf);
        t_buf = (float *)malloc(sizeof(float) * need);
        t_cap = t_buf ? need : 0;
        if (!t_buf) return -1;
    }
    float *qp = t_buf, *s = t_buf + ATTN_QMAX * 2L * hd;
    const float *qs[ATTN_QMAX];
    float l[ATTN_QMAX], *o[ATTN_QMAX];
    /* query q = (token u, head hh) at u * nh + hh */
    for (int q = 0; q < nq; q++) {
        qs[q] = a->qkv + (long)(t + q / nh) * a->ldqkv + (long)(h0 + q % nh) * hd;
        o[q] = a->out + (long)(t + q / nh) * a->ldo + (long)(h0 + q % nh) * hd;
    }
    pack_pairs(qs, nq, hd, qp);
    key_walk w = {a, a->tables + a->feed_of[t] * (long)a->width, g, 0, 0};
    scores(a, w, qp, nq, kmax, s, ss);
    for (int q = 0; q < nq; q++) l[q] = softmax_num(s + q * ss, keys[q]);
    for (int q0 = 0; q0 < nq; q0 += 4)
        values(a, w, nq - q0 < 4 ? nq - q0 : 4, s + q0 * ss, ss, keys + q0, l + q0, o + q0);
    return 0;
}

#else

int sf_attend512(const attn_args *a, int t, int nt, int g, int h0, int nh) {
    (void)a, (void)t, (void)nt, (void)g, (void)h0, (void)nh;
    return -1;
}

#endif
