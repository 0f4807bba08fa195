/* The records sf_forward takes (kernels/sf_cpu.c); the cffi build reads
 * this file for its cdef, so keep it plain declarations. */
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
} sf_layer;

typedef struct {
    int n_layers, hidden, nh, nkv, hd, inter, bf16, kv_bf16, page;
    long head_stride;
    float eps, scale;
    const float *cos, *sin;
    const sf_layer *layers;
} sf_model;

#endif
