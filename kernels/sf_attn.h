/* What attention's files share (sf_attn.c: the phases, the scalar and AVX2
 * paths; sf_attn512.c: the AVX-512 path). Private to kernels/sf_attn*.c. */
#ifndef SF_ATTN_H
#define SF_ATTN_H

#include "sf_cpu.h"
#include "sf_internal.h"

typedef struct {
    float *qkv; /* [n, (nh + 2 nkv) hd], q and k rotated in place */
    long ldqkv;
    int n, nh, nkv, hd;
    const int64_t *pos, *cells, *feed_of, *tables;
    int width; /* columns of tables */
    const float *cos, *sin; /* [max_len, hd / 2] */
    const float *qn, *kn; /* per-head RMSNorm weights [hd], or NULL */
    float eps;
    void *kp, *vp; /* one layer's pool, heads-major [nkv][cells][hd] */
    int kv_bf16;
    long head_stride; /* elements between kv heads */
    int page;
    float scale;
    float *out; /* [n, nh hd] */
    long ldo;
} attn_args;

static inline const void *cell_ptr(const attn_args *a, const void *pool, int g, int64_t cell) {
    long at = g * a->head_stride + cell * a->hd;
    return a->kv_bf16 ? (const void *)((const uint16_t *)pool + at) : (const void *)((const float *)pool + at);
}

/* Queries per AVX-512 block: tokens x query heads of one KV head. */
#define ATTN_QMAX 8

/* Tokens t..t+nt-1 (one feed, so one table) x query heads h0..h0+nh-1 (of
 * KV head g; nt * nh <= ATTN_QMAX): each key and value read once for all of
 * them, every output the bits of sf_attn.c's path. hd % 8 == 0; an AVX-512
 * CPU. -1 when scratch memory cannot be had. */
int sf_attend512(const attn_args *a, int t, int nt, int g, int h0, int nh);

#endif
