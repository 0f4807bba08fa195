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

/* This rank's pieces [m->parts][n][hidden] to every rank; every rank's in
 * `every` [world * m->parts][n][hidden], in piece order. */
static int gather_parts(sf_tp_comm *c, const sf_model *m, int n, const float *parts, float *every) {
    int64_t nbytes = (int64_t)m->parts * n * m->hidden * (int64_t)sizeof(float);
    c->seq += 1;
    double t0 = now_s();
    int rc = sf_comm_all_gather(c->seg, c->world, c->rank, c->seq, parts, nbytes, every, c->timeout_s, &c->missing);
    c->comm_s += now_s() - t0;
    return rc;
}

int sf_forward_tp(const sf_model *m, sf_tp_comm *c, float *x, int n, const int64_t *pos, const int64_t *cells,
                  const int64_t *feed_of, const int64_t *tables, int width, float *h, float *qkv, float *att,
                  float *gu, float *act, float *parts, float *every, int nthreads) {
    int H = m->hidden, q = m->nh * m->hd, qkvw = (m->nh + 2 * m->nkv) * m->hd, g = m->parts, all = g * c->world;
    for (int l = 0; l < m->n_layers; l++) {
        const sf_layer *L = &m->layers[l];
        int rc = sf_rmsnorm(x, H, n, H, L->attn_norm, m->eps, h, H, nthreads);
        rc |= sf_linear(h, H, n, H, L->qkv, m->bf16, qkvw, L->qkv_b, qkv, qkvw, 0, nthreads);
        rc |= sf_attention(qkv, qkvw, n, m->nh, m->nkv, m->hd, pos, cells, feed_of, tables, width, m->cos, m->sin,
                           L->q_norm, L->k_norm, m->eps, L->k_pool, L->v_pool, m->kv_bf16, m->head_stride,
                           m->page, m->scale, att, q, nthreads);
        rc |= sf_linear_parts(att, q, n, q / g, g, L->o, m->bf16, H, parts, nthreads);
        if (rc) return -1;
        if ((rc = gather_parts(c, m, n, parts, every))) return rc;
        rc |= sf_combine(every, all, n, H, L->o_b, x, H, nthreads);
        rc |= sf_rmsnorm(x, H, n, H, L->mlp_norm, m->eps, h, H, nthreads);
        rc |= sf_linear(h, H, n, H, L->gate_up, m->bf16, 2 * m->inter, L->gate_up_b, gu, 2 * m->inter, 0, nthreads);
        rc |= sf_silu_mul(gu, 2 * m->inter, n, m->inter, act, m->inter, nthreads);
        rc |= sf_linear_parts(act, m->inter, n, m->inter / g, g, L->down, m->bf16, H, parts, nthreads);
        if (rc) return -1;
        if ((rc = gather_parts(c, m, n, parts, every))) return rc;
        if (sf_combine(every, all, n, H, L->down_b, x, H, nthreads)) return -1;
    }
    return 0;
}
