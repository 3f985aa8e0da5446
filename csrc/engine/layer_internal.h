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
};

/* One pass over the R = n_seqs * L rows in ws->x [R, H] (row s * L + t is token t of
 * sequence seqs[s], at position cache->lengths[seqs[s]] + t). */
typedef struct {
    const q3_cpu_ops *k; /* kernels, fixed for the whole call */
    q3_profile *prof;    /* stage boundaries are marked here */
    int n_seqs;
    const int32_t *seqs;
    int64_t L;
} q3_pass;

/* the failure of a call stopped by its interrupt poll after `done` of `tokens` tokens */
q3_status q3_layer_interrupted(q3_error *err, int64_t done, int64_t tokens);

/* x += o_proj(attention(rmsnorm(x))); appends the pass's K/V to the cache */
void q3_attention_block(q3_layer *layer, q3_cache *cache, const q3_pass *p);
/* x += sum_k w_k expert_k(rmsnorm(x)) */
void q3_moe_block(q3_layer *layer, const q3_pass *p);


#endif
