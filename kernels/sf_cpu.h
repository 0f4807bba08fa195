/* The CPU kernels' interface (kernels/sf_*.c): the records sf_forward
 * takes and every exported function. The cffi build reads this file as
 * its cdef, so keep it plain declarations (no macros but the guard). */
#ifndef SF_CPU_H
#define SF_CPU_H
#include <stdint.h>

/* One decoder layer: packed linears (float32 or bf16, all alike), their
 * biases or NULL, float32 norm weights (q/k norms NULL but for Qwen3), and
 * this layer's heads-major K/V pool. */
typedef struct {
    const void *qkv, *o, *gate_up, *down;
    const float *qkv_b, *o_b, *gate_up_b, *down_b;
    const float *attn_norm, *mlp_norm, *q_norm, *k_norm;
    void *k_pool, *v_pool;
    int swiglu; /* gate_up packed in (gate, up) panel pairs: sf_linear_swiglu */
} sf_layer;

/* parts: the pieces o and down reduce over (sf_linear_parts; each panel's
 * pieces side by side). wtype: the linears' packing (sf_linear's). */
typedef struct {
    int n_layers, hidden, nh, nkv, hd, inter, parts, wtype, kv_bf16, page;
    long head_stride;
    float eps, scale;
    const float *cos, *sin;
    const sf_layer *layers;
} sf_model;

/* What sf_forward_head adds to the layers: the embedding table (float32 or
 * bf16, embed_rows rows of hidden), the final norm's weight and the LM head
 * (packed as the layers' linears, vocab outputs). */
typedef struct {
    const void *embed;
    int embed_bf16;
    long embed_rows;
    const float *norm;
    const void *w;
    int vocab;
} sf_head;

/* Kernel paths, lowest first (sf_cpu_isa: the one running), and what the
 * CPU offers (sf_cpu_features). */
enum { SF_ISA_SCALAR = 0, SF_ISA_AVX2 = 1, SF_ISA_AVX512 = 2, SF_ISA_AVX512_BF16 = 3, SF_ISA_AMX_BF16 = 4 };
enum {
    SF_FEAT_AVX2 = 1,           /* AVX2 and FMA */
    SF_FEAT_AVX512 = 2,         /* AVX-512 F, DQ, BW and VL */
    SF_FEAT_AVX512_BF16 = 4,    /* vdpbf16ps */
    SF_FEAT_AMX_BF16 = 8,       /* AMX tiles with bf16 */
    SF_FEAT_AMX_PERMITTED = 16, /* the OS granted this process the tile state */
    SF_FEAT_AMX_VERIFIED = 32,  /* the tile kernel passed its check in a child process (sf_gemm_dot.c) */
    SF_FEAT_BF16_DIFFERS = 64,  /* vdpbf16ps failed its check against the bf16-dot class: not used */
    SF_FEAT_AMX_EMULATED = 128  /* a test build: AMX's tiles in C (sf_amx_emu.h), never shipped */
};
int sf_cpu_isa(void);
int sf_cpu_isa_max(void);
unsigned sf_cpu_features(void);
void sf_cpu_force_isa(int isa);
/* The activation bytes a pass of sf_forward's layers may keep (0: the
 * default, 8 MiB); tests set a small one to run many passes. */
void sf_cpu_pass_bytes(long bytes);
/* The pool's helpers sleep now rather than spin for a next job (sf_pool.c). */
void sf_pool_park(void);
/* wtype: how w is packed, 0 float32, 1 bf16, 2 and 3 bf16 in pairs (the
 * bf16-dot and bf16-amx classes; sf_gemm.h says each layout). SF_ERR_PATH:
 * weights of a class the running path cannot compute (bf16-amx below amx). */
enum { SF_ERR_PATH = -100 };
int sf_linear(const float *x, long ldx, int n, int K, const void *w, int wtype, int out, const float *bias,
              float *y, long ldy, int resid, int nthreads);
int sf_linear_parts(const float *x, long ldx, int n, int K, int parts, const void *w, int wtype, int out, float *y,
                    int nthreads);
int sf_combine(const float *parts, int g, int n, int out, const float *bias, float *y, long ldy, int nthreads);
/* act [n, inter] = silu(gate) * up of x W.T (+ bias), W's 2 inter outputs
 * packed in (gate, up) pairs of panels (inter a multiple of 16): the bits of
 * sf_linear then sf_silu_mul on the unpaired weight, without gate_up's
 * outputs in memory. */
int sf_linear_swiglu(const float *x, long ldx, int n, int K, const void *w, int wtype, int inter, const float *bias,
                     float *act, long ldact, int nthreads);
/* y += sf_combine of sf_linear_parts's pieces (+ bias): the same bits; a
 * big n folds the pieces in cache instead of writing them (scratch: parts
 * planes [parts][n][out], as sf_linear_parts's y). */
int sf_linear_parts_add(const float *x, long ldx, int n, int K, int parts, const void *w, int wtype, int out,
                        float *scratch, const float *bias, float *y, long ldy, int nthreads);
int sf_rmsnorm(const float *x, long ldx, int n, int d, const float *w, float eps, float *y, long ldy,
               int nthreads);
int sf_silu_mul(const float *gu, long ldg, int n, int inter, float *out, long ldo, int nthreads);
int sf_attention(float *qkv, long ldqkv, int n, int nh, int nkv, int hd, const int64_t *pos,
                 const int64_t *cells, const int64_t *feed_of, const int64_t *tables, int width, const float *cos,
                 const float *sin, const float *qn, const float *kn, float eps, void *kp, void *vp, int kv_bf16,
                 long head_stride, int page, float scale, float *out, long ldo, int nthreads);
int sf_embed(const void *table, int bf16, int d, long rows, const int64_t *ids, int n, float *out);
int sf_forward(const sf_model *m, float *x, int n, const int64_t *pos, const int64_t *cells,
               const int64_t *feed_of, const int64_t *tables, int width, float *h, float *qkv, float *att,
               float *gu, float *act, float *parts, int nthreads);
int sf_forward_head(const sf_model *m, const sf_head *hd, float *x, const int64_t *ids, int n, const int64_t *pos,
                    const int64_t *cells, const int64_t *feed_of, const int64_t *tables, int width, float *h,
                    float *qkv, float *att, float *gu, float *act, float *parts, const int64_t *rows, int nrows,
                    float *logits, int64_t *picks, uint8_t *bad, int nthreads);
int sf_greedy(const float *x, long ldx, int B, int V, int64_t *tok, uint8_t *bad);
uint64_t sf_read_probe(const void *p, long bytes, int nthreads);
int sf_apply_bitmask(const float *x, long ldx, int B, int V, const int32_t *bits, int W, const int64_t *rows,
                     int n, float *out, long ldo);

/* The shared-memory collective of one tensor-parallel group (sf_comm.c,
 * wrapped by comm.py). Codes: 0 ok, else one of these. */
enum {
    SF_COMM_ERRNO = -1,      /* a system call failed: errno says why */
    SF_COMM_TIMEOUT = -2,    /* a peer did not arrive in time (missing: a mask of ranks); nothing sent */
    SF_COMM_TIMEOUT_SENT = -6, /* the same, after this rank had published its part: the call is spent */
    SF_COMM_MISMATCH = -3,   /* a peer's call differs in kind or size (missing: which) */
    SF_COMM_BAD_HEADER = -4, /* not a segment of this version, or shorter than its header says */
    SF_COMM_BAD_ARG = -5
};
int64_t sf_comm_segment_bytes(int world, int64_t slot_bytes);
int sf_comm_create(const char *path, int world, int64_t slot_bytes, void **seg);
int sf_comm_attach(const char *path, double timeout_s, void **seg, int64_t *seg_bytes);
void sf_comm_header(const void *seg, uint64_t *out);
int sf_comm_unmap(void *seg, int64_t seg_bytes);
int sf_comm_all_gather(void *seg, int world, int rank, uint64_t seq, const void *src, int64_t nbytes, void *out,
                       double timeout_s, uint64_t *missing);
int sf_comm_broadcast(void *seg, int world, int rank, uint64_t seq, const void *src, int64_t nbytes, void *out,
                      int64_t cap, int64_t *got, double timeout_s, uint64_t *missing);

/* A tensor-parallel rank's forward (sf_tp.c): sf_forward on the rank's shard
 * (m: its heads, KV heads, intermediate features, pieces), the row-parallel
 * pieces gathered through the collective at seg, chunk_bytes (<= its slots)
 * of this rank's at a time. seq: the collective's last call, advanced by
 * each call made; missing: as sf_comm_all_gather's; comm_s: seconds spent
 * in those calls, added to. Scratch: parts [m->parts][n][hidden], stage and
 * every as sf_tp_chunk_rows rows of this rank's and every rank's pieces. */
typedef struct {
    void *seg;
    int world, rank;
    uint64_t seq;
    double timeout_s;
    uint64_t missing;
    double comm_s;
    int64_t chunk_bytes;
} sf_tp_comm;
int sf_forward_tp(const sf_model *m, sf_tp_comm *c, float *x, int n, const int64_t *pos, const int64_t *cells,
                  const int64_t *feed_of, const int64_t *tables, int width, float *h, float *qkv, float *att,
                  float *gu, float *act, float *parts, float *stage, float *every, int nthreads);

#endif
