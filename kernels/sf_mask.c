/* Sampler rows (kernels/sampling.py): grammar masks and the greedy pick.
 *
 * Grammar masks: a banned token's
 * logit becomes -inf before anything else reads the row (contract §5).
 *
 * One pass, integer ops on the floats' bits, so the result is exact and
 * the time does not depend on which tokens a mask allows (a per-token
 * select mispredicts where allowed and banned tokens alternate). A word of
 * 32 banned tokens writes -inf without reading the row: a grammar usually
 * allows a handful of a vocabulary's tokens, so most words are all zero. */
#include "sf_cpu.h"
#include "sf_internal.h"

#include <stdlib.h>
#include <string.h>

#define NEG_INF_BITS 0xff800000u

/* out[r] = x[r] for every row r < B; then for mask row j (row rows[j], or j
 * when rows is NULL), out's tokens whose bit in bits[j] is clear are -inf.
 * bits: int32 [n, W] little-endian words, token t at bit t % 32 of word t / 32,
 * W = ceil(V / 32). out may be x. rows must be distinct rows of 0..B-1. */
int sf_apply_bitmask(const float *x, long ldx, int B, int V, const int32_t *bits, int W, const int64_t *rows,
                     int n, float *out, long ldo) {
    if (B < 0 || V < 0 || n < 0 || n > B || W != (V + 31) / 32 || ldx < V || ldo < V || (rows == NULL && n != B))
        return -1;
    unsigned char *masked = calloc((size_t)B + 1, 1);
    if (masked == NULL) return -2;
    for (int j = 0; j < n; j++) {
        long r = rows ? rows[j] : j;
        if (r < 0 || r >= B || masked[r]) {
            free(masked);
            return -1;
        }
        masked[r] = 1;
    }
    if (out != x)
        for (int r = 0; r < B; r++)
            if (!masked[r]) memcpy(out + r * ldo, x + r * ldx, (size_t)V * sizeof(float));
    free(masked);
    /* A masked row is written once, word by word, reading x only where a word allows something. */
    for (int j = 0; j < n; j++) {
        long r = rows ? rows[j] : j;
        uint32_t *o = (uint32_t *)(out + r * ldo);
        const uint32_t *xr = (const uint32_t *)(x + r * ldx);
        const uint32_t *wj = (const uint32_t *)(bits + (long)j * W);
        for (int k = 0; k < W; k++) {
            uint32_t w = wj[k];
            int base = k * 32, cnt = V - base < 32 ? V - base : 32;
            uint32_t *ok = o + base;
            const uint32_t *xk = xr + base;
            if (w == 0) {
                for (int i = 0; i < cnt; i++) ok[i] = NEG_INF_BITS;
            } else if (w == 0xffffffffu) {
                if (ok != xk) memcpy(ok, xk, (size_t)cnt * sizeof(uint32_t));
            } else {
                for (int i = 0; i < cnt; i++) {
                    uint32_t keep = 0u - ((w >> i) & 1u);
                    ok[i] = (xk[i] & keep) | (NEG_INF_BITS & ~keep);
                }
            }
        }
    }
    return 0;
}

/* ------------------------------------------------------------ greedy */

#if SF_X86
/* The max of r[0..V) past NaNs, and whether one was seen; whole vectors only (returns where it stopped). */
__attribute__((target("avx2,fma"))) static int max_avx2(const float *r, int V, float *m, int *nan) {
    __m256 mx = _mm256_set1_ps(-INFINITY), un = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= V; i += 8) {
        __m256 v = _mm256_loadu_ps(r + i);
        un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        mx = _mm256_max_ps(v, mx); /* a NaN in v yields mx's lane: NaNs never enter */
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, mx);
    for (int l = 0; l < 8; l++)
        if (lanes[l] > *m) *m = lanes[l];
    *nan |= _mm256_movemask_ps(un) != 0;
    return i;
}
#endif

/* Each row's greedy token (the first maximum, a NaN ranked as -inf: what
 * sampling's greedy picks) and whether the row is not finite (a NaN, or a
 * max of +-inf: step_sampled's NONFINITE rule), in two passes. */
int sf_greedy(const float *x, long ldx, int B, int V, int64_t *tok, uint8_t *bad) {
    if (B < 0 || V <= 0) return -1;
    for (int b = 0; b < B; b++) {
        const float *r = x + (long)b * ldx;
        float m = -INFINITY;
        int nan = 0, i = 0;
#if SF_X86
        if (sf_cpu_isa() >= SF_ISA_AVX2) i = max_avx2(r, V, &m, &nan);
#endif
        for (; i < V; i++) {
            if (r[i] != r[i]) nan = 1;
            else if (r[i] > m) m = r[i];
        }
        int at = 0, low = m == -INFINITY; /* max -inf: a NaN counts as -inf too (argmax over NaN -> -inf) */
        for (int j = 0; j < V; j++)
            if (r[j] == m || (low && r[j] != r[j])) {
                at = j;
                break;
            }
        tok[b] = at;
        bad[b] = (uint8_t)(nan || isinf(m));
    }
    return 0;
}
