/* sf_forward_tp: every decoder layer of a step on one tensor-parallel rank,
 * in one call, the row-parallel layers' pieces gathered through the shared-
 * memory collective (sf_comm.c) between the kernels, so a step costs no
 * Python a layer. The same kernels in the same order as the layer-by-layer
 * path of engine/parallel/tp_model.py, hence the same bits. */
#include "sf_cpu.h"
#include "sf_internal.h"

#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Rows of pieces a gather moves at once: the rank's pieces of `rows` tokens
 * fit a slot and the chunk (what every rank sends stays in cache). */
static long chunk_rows(const sf_tp_comm *c, const sf_model *m) {
    long row = (long)m->parts * m->hidden * (long)sizeof(float), rows = c->chunk_bytes / row;
    return rows < 1 ? 1 : rows;
}

/* x += every rank's pieces [m->parts][n][hidden] of this layer, added in piece
 * order (then the bias), a chunk of rows at a time: this rank's pieces of the
 * chunk to every rank (packed into `stage` unless the chunk is all of n),
 * every rank's back in `every` [world * parts][rows][hidden], combined. */
static int gather_combine(sf_tp_comm *c, const sf_model *m, int n, const float *parts, float *stage,
                          float *every, const float *bias, float *x, int nthreads) {
    int H = m->hidden, g = m->parts;
    long rows = chunk_rows(c, m);
    for (int t0 = 0; t0 < n; t0 += (int)rows) {
        int r = n - t0 < rows ? n - t0 : (int)rows;
        const float *src = parts;
        if (r != n) {
            for (int p = 0; p < g; p++)
                memcpy(stage + (long)p * r * H, parts + ((long)p * n + t0) * H, sizeof(float) * (size_t)r * H);
            src = stage;
        }
        c->seq += 1;
        double t = now_s();
        int rc = sf_comm_all_gather(c->seg, c->world, c->rank, c->seq, src, (int64_t)g * r * H * (int64_t)sizeof(float),
                                    every, c->timeout_s, &c->missing);
        c->comm_s += now_s() - t;
        if (rc) return rc;
        if (sf_combine(every, g * c->world, r, H, bias, x + (long)t0 * H, H, nthreads)) return -1;
    }
    return 0;
}

int sf_forward_tp(const sf_model *m, sf_tp_comm *c, float *x, int n, const int64_t *pos, const int64_t *cells,
                  const int64_t *feed_of, const int64_t *tables, int width, float *h, float *qkv, float *att,
                  float *gu, float *act, float *parts, float *stage, float *every, int nthreads) {
    for (int l = 0; l < m->n_layers; l++) {
        const sf_layer *L = &m->layers[l];
        int rc;
        SF_TRY(sf_layer_attn(m, L, x, n, pos, cells, feed_of, tables, width, h, qkv, att, parts, NULL, nthreads));
        if ((rc = gather_combine(c, m, n, parts, stage, every, L->o_b, x, nthreads))) return rc;
        SF_TRY(sf_layer_mlp(m, L, x, n, h, gu, act, parts, NULL, nthreads));
        if ((rc = gather_combine(c, m, n, parts, stage, every, L->down_b, x, nthreads))) return rc;
    }
    return 0;
}
