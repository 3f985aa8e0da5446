/* The layer object and its two stages, shared by layer.c, attention_block.c, moe_block.c. */
#ifndef Q3_ENGINE_LAYER_INTERNAL_H
#define Q3_ENGINE_LAYER_INTERNAL_H

#include "cache.h"
#include "cpu_dispatch.h"
#include "profile.h"
#include "workspace.h"

typedef struct q3_cuda_state q3_cuda_state; /* a device backend's, opaque here (csrc/cuda/layer.h) */

struct q3_layer {
    q3_config cfg;
    q3_weights w;                     /* borrowed; expert pointer arrays point into experts[] */
    const void **expert_ptrs;         /* [Q3_X_COUNT * E] owned copy of the pointer arrays */
    q3_workspace ws;                  /* host workspace (CPU layers) */
    q3_cuda_state *gpu;               /* CUDA layers: device workspace and host staging */
    q3_profile prof;                  /* per-stage times while profiling is on */
    float *rope_inv_freq;             /* [head_dim / 2] owned: q3_rope_table's, made at creation */
    float rope_scale;                 /* of cos and sin (the RoPE's attention_scaling) */
    uint8_t *held;                    /* [E] owned: 1 for each expert the layer holds */
    int n_held;                       /* how many (E: the whole layer can run) */
};

/* One pass over the R = n_seqs * L rows in ws->x [R, H] (row s * L + t is token t of
 * sequence seqs[s], at position cache->lengths[seqs[s]] + t). */
typedef struct {
    const q3_cpu_ops *k; /* kernels, fixed for the whole call */
    q3_profile *prof;    /* stage boundaries are marked here */
    int n_seqs;
    const int32_t *seqs;
    int64_t L;
    const q3_forward_args *call; /* the call's introspection outputs (NULL: none) */
    int64_t t0;                  /* the pass's first token of each sequence within the call */
} q3_pass;

/* whether the call asks for the router's outputs */
static inline int q3_pass_wants_router(const q3_pass *p) {
    return p->call && (p->call->router_logits || p->call->router_experts || p->call->router_weights);
}

/* A projection matrix of the layer: its data, and its scale_inv in the FP8 format */
typedef struct {
    const void *w, *scale;
} q3_matrix;

static inline q3_matrix q3_dense_matrix(const q3_layer *l, q3_dense_weight i) {
    return (q3_matrix){l->w.dense[i], l->w.dense_scale[i]};
}
static inline q3_matrix q3_expert_matrix(const q3_layer *l, q3_expert_weight x, int e) {
    return (q3_matrix){l->w.experts[x][e], l->w.format == Q3_WF_FP8_BLOCK128 ? l->w.expert_scales[x][e] : NULL};
}

/* y [T, N] (=, or += when acc) x [T, K] m^T on the CPU, in the layer's weight format. xb: the
 * bf16 scratch of kernels/matmul.h (NULL: x stays fp32); threads: the FP8 kernel's, with its
 * scratch in the workspace (1 and T < Q3_FP8_GEMV_MAX_T inside a parallel region: no scratch) */
static inline void q3_project(const q3_layer *l, const q3_cpu_ops *k, float *y, const float *x, q3_matrix m,
                              int64_t T, int64_t N, int64_t K, int acc, uint16_t *xb, int threads) {
    if (l->w.format == Q3_WF_FP8_BLOCK128)
        /* an fp32 layer keeps fp32 products (xb lets the amx path round to bf16) */
        k->matmul_fp8(y, x, m.w, m.scale, l->w.scale_dtype, T, N, K, acc, l->ws.fp8_scratch, threads,
                      l->w.dtype == Q3_BF16 ? xb : NULL);
    else
        k->matmul(y, x, m.w, l->w.dtype, T, N, K, acc, xb);
}

/* q3_layer_check_call without its demand for every expert (the attention half's checks) */
q3_status q3_layer_check_pass(const q3_layer *l, const q3_cache *c, const q3_forward_args *a, q3_error *err);
/* the CPU passes of a checked call: the whole layer (half NULL), or its attention half
 * (layer.c); a pass's half outputs written from the workspace (layer_halves.c) */
q3_status q3_layer_passes(q3_layer *l, q3_cache *c, const q3_forward_args *a, const q3_attention_half_out *half,
                          q3_error *err);
void q3_attention_half_write(const q3_layer *l, const q3_pass *p, const q3_attention_half_out *half);
/* the expert half's ids experts [n, top_k] (host memory), checked: each -1 (then *skip = 1)
 * or an expert the layer holds; else the failure naming the first other entry [i, j] */
q3_status q3_layer_check_expert_ids(const q3_layer *l, const int32_t *experts, int64_t n, int *skip, q3_error *err);

/* the failure of a call stopped by its interrupt poll after `done` of `tokens` tokens */
q3_status q3_layer_interrupted(q3_error *err, int64_t done, int64_t tokens);

/* x += o_proj(attention(rmsnorm(x))); appends the pass's K/V to the cache */
void q3_attention_block(q3_layer *layer, q3_cache *cache, const q3_pass *p);
/* h = post_attention_layernorm(x); the router's logits and top-k into the workspace (and
 * the call's insides) */
void q3_route_block(q3_layer *layer, const q3_pass *p);
/* dst [R, H] += sum over each row's pairs of w x expert(h): the top-k in ws->topk_idx and
 * ws->topk_w; with `skip` an entry E is another process's expert and is passed over */
void q3_experts_block(q3_layer *layer, const q3_cpu_ops *k, q3_profile *prof, int64_t R, int skip, float *dst);


#endif
