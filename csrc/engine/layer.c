/* Layer lifetime and the forward: every argument checked, then the passes, on the CPU or
 * through the device backend (both through the one pass loop, pass_loop.c). Prefill, chunked
 * prefill and decode are this one function with different (n_seqs, tokens, chunk). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device_backend.h"
#include "layer_internal.h"

/* the format's fields: a known format; GPTQ: the scales, qzeros and g_idx of every 4-bit matrix;
 * FP8: scales of fp32 or bf16 for every matrix; none for the rest */
static q3_status check_format(const q3_weights *w, q3_error *err) {
    char list[128];
    if ((unsigned)w->format >= (unsigned)q3_weight_format_count())
        return q3_fail(err, Q3_ERR_VALUE, "weight_format: expected %s, got %d", q3_weight_format_list(list, sizeof list),
                       (int)w->format);
    if (w->gptq_dense_attention && w->format != Q3_WF_GPTQ_INT4)
        return q3_fail(err, Q3_ERR_VALUE, "gptq_dense_attention: a setting of weight_format 'gptq_int4', got it with "
                       "'%s'", q3_weight_format_name(w->format));
    if (w->format == Q3_WF_DENSE) return Q3_OK;
    if (w->format == Q3_WF_GPTQ_INT4) {
        for (int i = 0; i < Q3_W_DENSE_COUNT && !w->experts_only && !w->gptq_dense_attention; i++)
            if (q3_dense_weight_is_matrix(i) && (!w->dense_scale[i] || !w->dense_qzeros[i] || !w->dense_g_idx[i]))
                return q3_fail(err, Q3_ERR_VALUE, "weights: missing the scales, qzeros or g_idx of %s",
                               q3_dense_weight_name(i));
        return Q3_OK;
    }
    if (w->scale_dtype != Q3_F32 && w->scale_dtype != Q3_BF16)
        return q3_fail(err, Q3_ERR_TYPE, "weight_scale_inv: expected float32 or bfloat16 scales, got %s",
                       q3_dtype_name(w->scale_dtype));
    for (int i = 0; i < Q3_W_DENSE_COUNT && !w->experts_only; i++)
        if (q3_dense_weight_is_matrix(i) && !w->dense_scale[i])
            return q3_fail(err, Q3_ERR_VALUE, "weights: missing the scale_inv of %s", q3_dense_weight_name(i));
    return Q3_OK;
}

/* Expert e's pointers into the fused tensors (q3_fused_expert_shape): gate [E], up [E] into
 * gate_up [E, 2 rows, cols], down [E] into down_p [E, cols, rows], of elem-byte elements:
 * rows = I and cols = H for the weights, their 128-blocks for the FP8 scales. */
static void slice_fused(const void **gate, const void **up, const void **down, const void *gate_up,
                        const void *down_p, size_t E, int64_t rows, int64_t cols, size_t elem) {
    const size_t expert = (size_t)rows * (size_t)cols * elem; /* one matrix of an expert */
    for (size_t e = 0; e < E; e++) {
        gate[e] = (const char *)gate_up + 2 * e * expert;
        up[e] = (const char *)gate_up + (2 * e + 1) * expert;
        down[e] = (const char *)down_p + e * expert;
    }
}

/* the experts' [arrays][E] pointers, per expert or sliced from the fused tensors */
static q3_status take_experts(const void **ptrs, const q3_config *cfg, const q3_weights *w, int fp8, size_t arrays,
                              q3_error *err) {
    const size_t E = (size_t)cfg->experts;
    if (w->fused[Q3_FUSED_GATE_UP] || w->fused[Q3_FUSED_DOWN]) {
        for (int s = 0; s <= fp8; s++) {
            const void *const *f = s ? w->fused_scales : w->fused;
            if (!f[Q3_FUSED_GATE_UP] || !f[Q3_FUSED_DOWN])
                return q3_fail(err, Q3_ERR_VALUE, "weights: missing %s%s",
                               q3_fused_expert_name(f[Q3_FUSED_GATE_UP] ? Q3_FUSED_DOWN : Q3_FUSED_GATE_UP),
                               s ? "_scale_inv" : "");
            int64_t dims[3];
            q3_fused_expert_shape(cfg, Q3_FUSED_GATE_UP, s, dims);
            const size_t elem = s ? q3_dtype_size(w->scale_dtype) : fp8 ? 1 : q3_dtype_size(w->dtype);
            const void **base = ptrs + (size_t)s * Q3_X_COUNT * E;
            slice_fused(base, base + E, base + 2 * E, f[Q3_FUSED_GATE_UP], f[Q3_FUSED_DOWN], E, dims[1] / 2, dims[2],
                        elem);
        }
        for (size_t a = 0; a < arrays; a++) /* the experts held elsewhere: not there to read */
            for (size_t e = 0; e < E; e++)
                if (w->held && !w->held[e]) ptrs[a * E + e] = NULL;
        return Q3_OK;
    }
    static const char *const gptq_names[] = {".qweight", ".scales", ".qzeros", ".g_idx"};
    const int gptq = w->format == Q3_WF_GPTQ_INT4;
    for (size_t a = 0; a < arrays; a++) {
        const int x = (int)(a % Q3_X_COUNT), side = (int)(a / Q3_X_COUNT);
        const void *const *src = side == 0   ? w->experts[x]
                                 : side == 1 ? w->expert_scales[x]
                                 : side == 2 ? w->expert_qzeros[x]
                                             : w->expert_g_idx[x];
        for (size_t e = 0; e < E; e++) {
            if (w->held && !w->held[e]) continue;
            if (!src || !src[e])
                return q3_fail(err, Q3_ERR_VALUE, "weights: missing mlp.experts.%zu.%s%s", e, q3_expert_weight_name(x),
                               gptq ? gptq_names[side] : side ? ".weight_scale_inv" : ".weight");
            ptrs[a * E + e] = src[e];
        }
    }
    return Q3_OK;
}

q3_status q3_layer_create(q3_layer **out, const q3_config *cfg, const q3_weights *w, q3_error *err) {
    *out = NULL;
    q3_status s = q3_config_check(cfg, err);
    if (s == Q3_OK) s = check_format(w, err);
    if (s == Q3_OK && w->device >= 0 && q3_device()) s = q3_device()->layer_config_check(cfg, err);
    if (s != Q3_OK) return s;
    if (w->experts_only && w->device >= 0)
        return q3_fail(err, Q3_ERR_VALUE, "experts_only: an expert-only layer is a host layer, got device %d",
                       w->device);
    for (int i = 0; i < Q3_W_DENSE_COUNT && !w->experts_only; i++)
        if (!w->dense[i])
            return q3_fail(err, Q3_ERR_VALUE, "weights: missing %s", q3_dense_weight_name(i));
    const int fp8 = w->format == Q3_WF_FP8_BLOCK128, gptq = w->format == Q3_WF_GPTQ_INT4;
    q3_layer *l = calloc(1, sizeof *l);
    const size_t E = (size_t)cfg->experts, arrays = (size_t)(gptq ? 4 : fp8 ? 2 : 1) * Q3_X_COUNT;
    const void **ptrs = calloc(arrays * E, sizeof *ptrs); /* [arrays][E]: the weights, then the scales */
    float *rope = malloc((size_t)cfg->head_dim / 2 * sizeof *rope);
    uint8_t *held = malloc(E);
    if (!l || !ptrs || !rope || !held) {
        free(l);
        free(ptrs);
        free(rope);
        free(held);
        return q3_fail(err, Q3_ERR_NOMEM, "layer: out of memory");
    }
    for (size_t e = 0; e < E; e++) l->n_held += held[e] = !w->held || w->held[e];
    l->held = held;
    l->cfg = *cfg;
    l->rope_inv_freq = rope;
    q3_rope_table(cfg, rope, &l->rope_scale); /* once: every pass rotates by this table */
    l->w = *w;
    if (w->experts_only) /* nothing of the attention is read: no pointer of the caller's kept */
        for (int i = 0; i < Q3_W_DENSE_COUNT; i++)
            l->w.dense[i] = l->w.dense_scale[i] = l->w.dense_qzeros[i] = l->w.dense_g_idx[i] = NULL;
    l->expert_ptrs = ptrs;
    for (size_t a = 0; a < arrays; a++) {
        const void **at = ptrs + a * E;
        const int x = (int)(a % Q3_X_COUNT);
        if (a < Q3_X_COUNT) l->w.experts[x] = at;
        else if (a < 2 * Q3_X_COUNT) l->w.expert_scales[x] = at;
        else if (a < 3 * Q3_X_COUNT) l->w.expert_qzeros[x] = at;
        else l->w.expert_g_idx[x] = at;
    }
    s = take_experts(ptrs, cfg, w, fp8, arrays, err);
    if (s == Q3_OK && gptq) s = q3_layer_take_int4(l, err);
    if (s == Q3_OK && w->device < 0) s = q3_workspace_reserve(&l->ws, cfg, fp8 || gptq, 1, 1, err);
    if (s != Q3_OK) {
        q3_layer_destroy(l);
        return s;
    }
    *out = l;
    return Q3_OK;
}

void q3_layer_destroy(q3_layer *l) {
    if (!l) return;
    if (q3_device()) q3_device()->layer_release(l);
    q3_workspace_release(&l->ws);
    q3_weight_holdings_free(l->holdings);
    free(l->expert_ptrs);
    free(l->rope_inv_freq);
    free(l->held);
    free(l->int4);
    free(l);
}

const q3_config *q3_layer_config(const q3_layer *l) { return &l->cfg; }
q3_dtype q3_layer_dtype(const q3_layer *l) { return l->w.dtype; }
q3_weight_format q3_layer_weight_format(const q3_layer *l) { return l->w.format; }
/* bytes of a [dims] matrix in the layer's format (fits: q3_config_check bounds the weights);
 * attention: one of q/k/v/o_proj (dense in a GPTQ layer with gptq_dense_attention) */
static int64_t matrix_bytes(const q3_layer *l, const int64_t dims[2], int attention) {
    if (l->w.format == Q3_WF_GPTQ_INT4 && !(attention && l->w.gptq_dense_attention)) { /* qweight, scales, qzeros, g_idx */
        const int64_t N = dims[0], K = dims[1], G = K / q3_gptq_group(l->w.gptq_group, K);
        return K / 8 * N * 4 + G * N * 2 + G * (N / 8) * 4 + K * 4;
    }
    if (l->w.format != Q3_WF_FP8_BLOCK128) return dims[0] * dims[1] * (int64_t)q3_dtype_size(l->w.dtype); /* dense */
    int64_t s[2];
    q3_fp8_scale_shape(dims, s);
    return dims[0] * dims[1] + s[0] * s[1] * (int64_t)q3_dtype_size(l->w.scale_dtype);
}

int64_t q3_layer_weight_bytes(const q3_layer *l) {
    int64_t total = 0, dims[2];
    for (int i = 0; i < Q3_W_DENSE_COUNT && !l->w.experts_only; i++) {
        const int rank = q3_dense_weight_shape(&l->cfg, i, dims);
        total += q3_dense_weight_is_matrix(i) ? matrix_bytes(l, dims, 1)
                                              : dims[0] * (rank == 2 ? dims[1] : 1) * (int64_t)q3_dtype_size(l->w.dtype);
    }
    for (int x = 0; x < Q3_X_COUNT; x++) {
        q3_expert_weight_shape(&l->cfg, x, dims);
        total += l->n_held * matrix_bytes(l, dims, 0);
    }
    return total;
}

size_t q3_layer_workspace_bytes(const q3_layer *l) {
    if (l->w.device < 0) return l->ws.bytes;
    return q3_device() ? q3_device()->layer_workspace_bytes(l) : 0;
}

static const char *device_name(int device, char *buf, size_t n) {
    if (device < 0) snprintf(buf, n, "cpu");
    else snprintf(buf, n, "cuda:%d", device);
    return buf;
}

/* the attention maps' columns hold the longest sequence, and their size fits a size_t */
static q3_status check_attention_output(const q3_layer *l, const q3_forward_args *a, int64_t longest, q3_error *err) {
    if (!a->attention) return Q3_OK;
    if (a->attention_context < longest)
        return q3_fail(err, Q3_ERR_VALUE, "attention_context: expected at least %lld (the longest sequence after "
                       "the call), got %lld", (long long)longest, (long long)a->attention_context);
    int64_t n;
    const int64_t shape[5] = {a->n_seqs, l->cfg.heads, a->tokens, a->attention_context, (int64_t)sizeof(float)};
    if (!q3_numel(5, shape, &n) || (uint64_t)n > SIZE_MAX)
        return q3_fail(err, Q3_ERR_VALUE, "attention: [%d, %d, %lld, %lld] fp32 maps overflow the address space",
                       a->n_seqs, l->cfg.heads, (long long)a->tokens, (long long)a->attention_context);
    return Q3_OK;
}

q3_status q3_layer_check_call(const q3_layer *l, const q3_cache *c, const q3_forward_args *a, q3_error *err) {
    if (l->n_held < l->cfg.experts && !l->w.experts_only)
        return q3_fail(err, Q3_ERR_VALUE, "layer: holds %d of the %d experts, and the whole layer needs every one "
                       "(run its halves: attention_half, then expert_half where the experts are)", l->n_held,
                       l->cfg.experts);
    return q3_layer_check_pass(l, c, a, err);
}

q3_status q3_layer_check_pass(const q3_layer *l, const q3_cache *c, const q3_forward_args *a, q3_error *err) {
    char want[16], got[16];
    if (l->w.experts_only)
        return q3_fail(err, Q3_ERR_VALUE, "layer: holds the experts alone (experts_only: no attention weights); it "
                       "runs expert_half, and the attention on the layer that holds them");
    if (c->device != l->w.device)
        return q3_fail(err, Q3_ERR_VALUE, "cache: expected a cache on %s (this layer's device), got one on %s",
                       device_name(l->w.device, want, sizeof want), device_name(c->device, got, sizeof got));
    if (c->kv_heads != l->cfg.kv_heads || c->head_dim != l->cfg.head_dim)
        return q3_fail(err, Q3_ERR_VALUE,
                       "cache: expected %d KV heads of dim %d (this layer's), got %d of dim %d",
                       l->cfg.kv_heads, l->cfg.head_dim, c->kv_heads, c->head_dim);
    if (a->tokens <= 0)
        return q3_fail(err, Q3_ERR_VALUE, "x: expected at least 1 token, got %lld",
                       (long long)a->tokens);
    if (a->n_seqs <= 0 || a->n_seqs > c->batch)
        return q3_fail(err, Q3_ERR_VALUE, "x: expected 1 to %d sequences (the cache's batch), got %d",
                       c->batch, a->n_seqs);
    /* a pass routes rows x top_k (token, expert) pairs, indexed by int32 */
    const int64_t step = q3_call_step(a);
    int64_t pairs;
    if (!q3_mul_i64(step, a->n_seqs, &pairs) || !q3_mul_i64(pairs, l->cfg.top_k, &pairs) || pairs > INT32_MAX)
        return q3_fail(err, Q3_ERR_VALUE,
                       "chunk_size: a pass of %lld tokens x %d sequences routes more than 2^31 - 1 (token, "
                       "expert) pairs; expected at most %lld tokens a pass", (long long)step, a->n_seqs,
                       (long long)(INT32_MAX / ((int64_t)a->n_seqs * l->cfg.top_k)));
    int64_t longest = 0; /* the longest sequence after the call */
    for (int s = 0; s < a->n_seqs; s++) {
        const int seq = a->seqs[s];
        if (seq < 0 || seq >= c->batch)
            return q3_fail(err, Q3_ERR_INDEX, "seq: expected 0 <= seq < %d (the cache's batch), got %d",
                           c->batch, seq);
        for (int r = 0; r < s; r++)
            if (a->seqs[r] == seq)
                return q3_fail(err, Q3_ERR_VALUE, "seq: sequence %d appears twice in one call", seq);
        if (a->tokens > c->capacity - c->lengths[seq])
            return q3_fail(err, Q3_ERR_CACHE_FULL,
                           "sequence %d holds %lld of %lld tokens: %lld more do not fit",
                           seq, (long long)c->lengths[seq], (long long)c->capacity,
                           (long long)a->tokens);
        if (c->lengths[seq] + a->tokens > longest) longest = c->lengths[seq] + a->tokens;
    }
    for (int64_t i = 0; a->positions && i < a->n_seqs * a->tokens; i++) /* the product fits: x holds it */
        if (a->positions[i] < 0 || a->positions[i] >= Q3_MAX_POSITIONS)
            return q3_fail(err, Q3_ERR_VALUE, "positions[%lld, %lld]: expected 0 <= position < 2^40, got %lld",
                           (long long)(i / a->tokens), (long long)(i % a->tokens), (long long)a->positions[i]);
    if (a->tree) {
        if (a->token_mask)
            return q3_fail(err, Q3_ERR_VALUE, "tree: given with token_mask; a tree call's tokens are all seen by the "
                           "tokens its tree says");
        const int64_t T = a->tokens;
        for (int s = 0; s < a->n_seqs; s++)
            for (int64_t t = 0; t < T; t++)
                for (int64_t u = 0; u < T; u++) {
                    const uint8_t v = a->tree[((int64_t)s * T + t) * T + u];
                    if ((u == t && !v) || (u > t && v))
                        return q3_fail(err, Q3_ERR_VALUE, "tree[%d, %lld, %lld]: expected %s (a token sees itself and "
                                       "tokens before it only), got %s", s, (long long)t, (long long)u,
                                       u == t ? "True" : "False", v ? "True" : "False");
                }
    }
    return check_attention_output(l, a, longest, err);
}

q3_status q3_layer_interrupted(q3_error *err, int64_t done, int64_t tokens) {
    return q3_fail(err, Q3_ERR_INTERRUPTED,
                   "interrupted after %lld of %lld tokens a sequence; the cache was rolled back to where the "
                   "call began", (long long)done, (long long)tokens);
}

int q3_layer_held_experts(const q3_layer *l) { return l->n_held; }
int q3_layer_holds_expert(const q3_layer *l, int e) { return e >= 0 && e < l->cfg.experts && l->held[e]; }

q3_status q3_layer_forward(q3_layer *l, q3_cache *c, const q3_forward_args *a, q3_error *err) {
    q3_status s = q3_layer_check_call(l, c, a, err);
    if (s != Q3_OK) return s;
    if (l->w.device >= 0) {
        if (!q3_device()) return q3_fail(err, Q3_ERR_STATE, "cuda: the CUDA backend is not loaded");
        return q3_device()->layer_forward(l, c, a, err);
    }
    return q3_layer_passes(l, c, a, NULL, NULL, err);
}

static const char *const stage_names[Q3_STAGE_COUNT] = {
    "io", "input_norm", "qkv_proj", "qk_norm_rope", "kv_write", "attention", "o_proj",
    "post_norm", "router", "top_k", "experts",
};

const char *q3_stage_name(int stage) { return stage >= 0 && stage < Q3_STAGE_COUNT ? stage_names[stage] : NULL; }

q3_status q3_layer_profiling(q3_layer *l, int on, q3_error *err) {
    (void)err;
    l->prof = (q3_profile){0};
    l->prof.enabled = on != 0;
    return Q3_OK;
}

int q3_layer_profile_read(const q3_layer *l, double *seconds, int max) {
    int n = 0;
    for (; n < Q3_STAGE_COUNT && n < max; n++) seconds[n] = l->prof.seconds[n];
    return n;
}
