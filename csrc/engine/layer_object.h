/* The layer object and one pass over its rows, as the engine and its device backends
 * (csrc/cuda) both see them: the struct, the pass, a projection matrix of the layer, and the
 * checks and failures a backend's pass driver shares with the engine's. The CPU's stages and
 * its pass loop are the engine's own (layer_internal.h); a backend includes this header, not
 * that one. */
#ifndef Q3_ENGINE_LAYER_OBJECT_H
#define Q3_ENGINE_LAYER_OBJECT_H

#include "cache.h"
#include "cpu_dispatch.h"
#include "profile.h"
#include "workspace.h"

#include "../../kernels/int4.h"

typedef struct q3_cuda_state q3_cuda_state; /* a device backend's, opaque here (csrc/cuda/device_state.h) */

typedef struct q3_weight_holdings q3_weight_holdings;
void q3_weight_holdings_free(q3_weight_holdings *h); /* after the backend let the layer go */

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
    q3_int4_matrix *int4;             /* GPTQ format: [Q3_W_DENSE_COUNT + Q3_X_COUNT * E] owned
                                       * (q3_int4_index), checked at creation; else NULL. A CUDA
                                       * layer's tensors are on its device, these structs on the host */
    int n_held;                       /* how many (E: the whole layer can run) */
    q3_weight_holdings *holdings;     /* q3_layer_load's views and copies (weight_load.c); else NULL */
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
    int half_of_pass;            /* the attention half's outputs hold this pass's rows alone (s * L + t),
                                    not the call's (s * tokens + t0 + t): q3_layer_attention_pass */
} q3_pass;

/* the row of the attention half's outputs where sequence s's rows of pass p start */
static inline int64_t q3_half_row(const q3_pass *p, int s) {
    return p->half_of_pass ? s * p->L : s * p->call->tokens + p->t0;
}

/* the call's token mask for sequence s's rows of pass p ([L], 0: hidden), NULL when none */
static inline const uint8_t *q3_pass_token_mask(const q3_pass *p, int s) {
    return p->call && p->call->token_mask ? p->call->token_mask + s * p->call->tokens + p->t0 : NULL;
}

/* pos [L] <- the RoPE positions of sequence s's rows of pass p: the call's, else the cache's
 * rule (positions count from the first real token, at first_pos; padding tokens sit at 0) */
static inline void q3_pass_positions(const q3_cache *c, const q3_pass *p, int s, int64_t *pos) {
    const int seq = p->seqs[s];
    const int64_t n = c->lengths[seq], pad = c->padding[seq], first = c->first_pos[seq];
    if (p->call && p->call->positions) {
        memcpy(pos, p->call->positions + s * p->call->tokens + p->t0, (size_t)p->L * sizeof *pos);
        return;
    }
    for (int64_t t = 0; t < p->L; t++) pos[t] = n + t >= pad ? first + n + t - pad : 0;
}

/* What the attention of pass p reads of sequence s (its cache rows, hidden keys, the call's
 * tree: kernels/attention.h), the hidden flags of the pass's rows written first from the
 * call's token mask (q3_cache_mark_rows) */
static inline q3_attn_seq q3_pass_attn_seq(q3_cache *c, const q3_pass *p, int s) {
    const int seq = p->seqs[s];
    q3_cache_mark_rows(c, seq, p->L, q3_pass_token_mask(p, s));
    q3_attn_seq a = q3_cache_attn_seq(c, seq, p->L);
    if (p->call && p->call->tree) {
        const int64_t T = p->call->tokens;
        a.tree = p->call->tree + (size_t)s * (size_t)T * (size_t)T;
        a.tree_first = c->lengths[seq] - p->t0; /* the call's first row: the passes before advanced it */
        a.tree_tokens = T;
    }
    return a;
}

/* whether the call asks for the router's outputs */
static inline int q3_pass_wants_router(const q3_pass *p) {
    return p->call && (p->call->router_logits || p->call->router_experts || p->call->router_weights);
}

/* A projection matrix of the layer: its data, and its scale_inv in the FP8 format; in the
 * GPTQ format the layer's description of it (w: its qweight; q4 NULL: a dense matrix, the
 * attention's of a layer with gptq_dense_attention) */
typedef struct {
    const void *w, *scale;
    const q3_int4_matrix *q4;
} q3_matrix;

/* l->int4's entries: the dense matrices' (in q3_dense_weight order, the others' unused), then
 * the experts' [Q3_X_COUNT][E]: every gate, every up, every down, so that a projection's E
 * matrices lie together (a CUDA layer copies them to its device as the grouped decode
 * kernels' tables, csrc/cuda/device_state.c) */
static inline int64_t q3_int4_index(q3_dense_weight i) { return i; }
static inline int64_t q3_int4_expert_index(const q3_layer *l, q3_expert_weight x, int e) {
    return Q3_W_DENSE_COUNT + (int64_t)x * l->cfg.experts + e;
}

static inline q3_matrix q3_dense_matrix(const q3_layer *l, q3_dense_weight i) {
    return (q3_matrix){l->w.dense[i], l->w.dense_scale[i],
                       l->int4 && !l->w.gptq_dense_attention ? &l->int4[q3_int4_index(i)] : NULL};
}
static inline q3_matrix q3_expert_matrix(const q3_layer *l, q3_expert_weight x, int e) {
    return (q3_matrix){l->w.experts[x][e], l->w.format == Q3_WF_FP8_BLOCK128 ? l->w.expert_scales[x][e] : NULL,
                       l->int4 ? &l->int4[q3_int4_expert_index(l, x, e)] : NULL};
}

/* the expert half's ids experts [n, top_k] (host memory), checked: each -1 (then *skip = 1)
 * or an expert the layer holds; else the failure naming the first other entry [i, j] */
q3_status q3_layer_check_expert_ids(const q3_layer *l, const int32_t *experts, int64_t n, int *skip, q3_error *err);

/* the failure of a call stopped by its interrupt poll after `done` of `tokens` tokens */
q3_status q3_layer_interrupted(q3_error *err, int64_t done, int64_t tokens);

/* the tokens a pass of the call takes of each sequence: its chunk (Q3_DEFAULT_CHUNK when
 * none is given), at most the call's tokens; the one place the default applies */
static inline int64_t q3_call_step(const q3_forward_args *a) {
    const int64_t chunk = a->chunk > 0 ? a->chunk : Q3_DEFAULT_CHUNK;
    return chunk < a->tokens ? chunk : a->tokens;
}

/* The stages of a pass a device supplies to the engine's one pass loop (q3_layer_run_passes,
 * pass_loop.c): the CPU's (pass_loop.c), a CUDA device's (csrc/cuda/layer.c). Each works on
 * the pass's rows in the device's workspace; `run` is the device's state of the call (its
 * stream, its first failure; NULL on the CPU). input: the pass's rows of the call's x into
 * the workspace; attention (which appends the pass's K/V), route; then either half_write (the
 * attention half: the pass's rows of its outputs) or experts (those the layer holds) and
 * output (the rows into y); end: after the cache lengths advanced (profiling). failed:
 * nonzero once a stage failed, the loop stops; failure: that failure into err. */
typedef struct {
    void (*input)(q3_layer *l, const q3_pass *p, void *run);
    void (*attention)(q3_layer *l, q3_cache *c, const q3_pass *p, void *run);
    void (*route)(q3_layer *l, const q3_pass *p, void *run);
    void (*half_write)(q3_layer *l, const q3_pass *p, const q3_attention_half_out *half, void *run);
    void (*experts)(q3_layer *l, const q3_pass *p, void *run);
    void (*output)(q3_layer *l, const q3_pass *p, void *run);
    void (*end)(q3_layer *l, const q3_pass *p, void *run);
    int (*failed)(const void *run);
    q3_status (*failure)(const void *run, q3_error *err);
} q3_pass_stages;

/* A checked call's passes, the one loop every device runs: chunk by chunk (q3_call_step),
 * each pass's stages in turn (half NULL: the whole layer; else its attention half), each
 * sequence's cache length advanced after its pass. An interrupt between passes, or a failed
 * stage, rolls the lengths back to where the call began (one roll-back) and returns the
 * failure: Q3_ERR_INTERRUPTED, or the device's. cur NULL: every pass of the call; else the
 * next pass alone, the cursor advanced (q3_layer_attention_pass: half's rows the pass's). The
 * caller reserves the device's workspace first. */
q3_status q3_layer_run_passes(q3_layer *l, q3_cache *c, const q3_forward_args *a, const q3_attention_half_out *half,
                              q3_pass_cursor *cur, const q3_pass_stages *stages, void *run, q3_error *err);

#endif
