/* The layer's two halves (q3.h) for a caller that moves rows between them: the attention
 * half is q3_layer_forward's passes stopped after the router, the expert half the same
 * experts block on rows handed in. Both run the code the whole layer runs: on the CPU here,
 * on a device through the installed backend (csrc/cuda/layer_halves.c) after the same checks. */
#include <string.h>

#include "device_backend.h"
#include "layer_internal.h"


static q3_status no_backend(q3_error *err) { return q3_fail(err, Q3_ERR_STATE, "cuda: the CUDA backend is not loaded"); }

void q3_attention_half_write(const q3_layer *l, const q3_pass *p, const q3_attention_half_out *half) {
    const q3_workspace *ws = &l->ws;
    const int64_t H = l->cfg.hidden, k = l->cfg.top_k, L = p->L;
    const size_t es = q3_dtype_size(half->normed_dtype);
    for (int s = 0; s < p->n_seqs; s++) {
        const int64_t src = s * L, dst = q3_half_row(p, s); /* rows of the pass, of the outputs */
        memcpy(half->resid + dst * H, ws->x + src * H, (size_t)(L * H) * sizeof(float));
        p->k->from_f32((char *)half->normed + (size_t)(dst * H) * es, half->normed_dtype, ws->h + src * H, L * H);
        memcpy(half->experts + dst * k, ws->topk_idx + src * k, (size_t)(L * k) * sizeof(int32_t));
        memcpy(half->weights + dst * k, ws->topk_w + src * k, (size_t)(L * k) * sizeof(float));
    }
}

q3_status q3_layer_check_attention_half(const q3_layer *l, const q3_cache *c, const q3_forward_args *a,
                                        q3_error *err) {
    return q3_layer_check_pass(l, c, a, err);
}

static q3_status check_half_out(const q3_attention_half_out *out, q3_error *err) {
    if (!out || !out->resid || !out->normed || !out->experts || !out->weights)
        return q3_fail(err, Q3_ERR_VALUE, "attention_half: expected its four outputs, got a NULL one");
    if (!q3_dtype_is_float(out->normed_dtype))
        return q3_fail(err, Q3_ERR_TYPE, "normed: expected float32, bfloat16 or float16, got %s",
                       q3_dtype_name(out->normed_dtype));
    return Q3_OK;
}

/* the call's passes on the layer's device: every one (cur NULL), or the cursor's next */
static q3_status half_passes(q3_layer *l, q3_cache *c, const q3_forward_args *a, const q3_attention_half_out *out,
                             q3_pass_cursor *cur, q3_error *err) {
    if (l->w.device >= 0)
        return q3_device() ? q3_device()->layer_attention_half(l, c, a, out, cur, err) : no_backend(err);
    return q3_layer_passes(l, c, a, out, cur, err);
}

q3_status q3_layer_attention_half(q3_layer *l, q3_cache *c, const q3_forward_args *a,
                                  const q3_attention_half_out *out, q3_error *err) {
    q3_status s = q3_layer_check_attention_half(l, c, a, err);
    if (s == Q3_OK) s = check_half_out(out, err);
    return s != Q3_OK ? s : half_passes(l, c, a, out, NULL, err);
}

q3_status q3_layer_attention_passes_begin(const q3_layer *l, const q3_cache *c, const q3_forward_args *a,
                                          q3_pass_cursor *cur, q3_error *err) {
    *cur = (q3_pass_cursor){0};
    const q3_status s = q3_layer_check_attention_half(l, c, a, err);
    cur->open = s == Q3_OK;
    if (cur->open) cur->passes = (a->tokens + q3_call_step(a) - 1) / q3_call_step(a); /* tokens >= 1, checked */
    return s;
}

q3_status q3_layer_attention_passes_end(q3_pass_cursor *cur, q3_error *err) {
    if (!cur->open)
        return q3_fail(err, Q3_ERR_STATE, "close: the call is not open (closed, aborted, or a pass failed)");
    if (cur->done < cur->passes)
        return q3_fail(err, Q3_ERR_STATE, "close: %lld of the call's %lld passes have run; run the rest, or abort() "
                       "to roll the cache back", (long long)cur->done, (long long)cur->passes);
    cur->open = 0;
    return Q3_OK;
}

int64_t q3_pass_cursor_tokens(const q3_forward_args *a, const q3_pass_cursor *cur) {
    if (!cur->open || cur->next >= a->tokens) return 0;
    const int64_t step = q3_call_step(a);
    return a->tokens - cur->next < step ? a->tokens - cur->next : step;
}

q3_status q3_layer_attention_pass(q3_layer *l, q3_cache *c, const q3_forward_args *a, q3_pass_cursor *cur,
                                  const q3_attention_half_out *out, q3_error *err) {
    if (!cur->open)
        return q3_fail(err, Q3_ERR_STATE, "attention_pass: the call's passes were not begun, or were rolled back "
                       "after a failure or an abort");
    const int64_t L = q3_pass_cursor_tokens(a, cur);
    if (L == 0)
        return q3_fail(err, Q3_ERR_STATE, "attention_pass: every pass of the call has run (%lld tokens a sequence)",
                       (long long)a->tokens);
    /* the call was checked at its beginning; what the cache's owner may have done since must
     * still leave room for this pass's K/V */
    for (int i = 0; i < a->n_seqs; i++)
        if (L > c->capacity - c->lengths[a->seqs[i]]) {
            q3_layer_attention_passes_abort(c, a, cur);
            return q3_fail(err, Q3_ERR_CACHE_FULL, "sequence %d holds %lld of %lld tokens: the pass's %lld more do "
                           "not fit (the cache changed between the call's passes)", (int)a->seqs[i],
                           (long long)c->lengths[a->seqs[i]], (long long)c->capacity, (long long)L);
        }
    q3_status s = check_half_out(out, err);
    if (s == Q3_OK) s = half_passes(l, c, a, out, cur, err);
    if (s != Q3_OK) q3_layer_attention_passes_abort(c, a, cur); /* a failed pass rolls the whole call back */
    else cur->done++;
    return s;
}

q3_status q3_layer_check_expert_ids(const q3_layer *l, const int32_t *experts, int64_t n, int *skip, q3_error *err) {
    const int E = l->cfg.experts, k = l->cfg.top_k;
    *skip = 0;
    for (int64_t i = 0; i < n; i++)
        for (int j = 0; j < k; j++) {
            const int32_t e = experts[i * k + j];
            if (e == -1)
                *skip = 1;
            else if (e < 0 || e >= E)
                return q3_fail(err, Q3_ERR_INDEX, "experts[%lld, %d]: expected -1 (held elsewhere) or an expert index "
                               "in [0, %d), got %d", (long long)i, j, E, (int)e);
            else if (!l->held[e])
                return q3_fail(err, Q3_ERR_VALUE, "experts[%lld, %d]: expert %d is not held by this layer (it holds "
                               "%d of the %d; mark an expert held elsewhere -1)", (long long)i, j, (int)e, l->n_held,
                               E);
        }
    return Q3_OK;
}

/* the entries' expert ids into ws->topk_idx (-1: E, the skipped group) and their weights;
 * *skip: whether any is skipped. Fails for an id the layer cannot run, before it writes. */
static q3_status take_routes(q3_layer *l, const q3_expert_half_args *a, int *skip, q3_error *err) {
    const int E = l->cfg.experts, k = l->cfg.top_k;
    const q3_status s = q3_layer_check_expert_ids(l, a->experts, a->n, skip, err);
    if (s != Q3_OK) return s;
    for (int64_t i = 0; i < a->n * k; i++) {
        l->ws.topk_idx[i] = a->experts[i] < 0 ? E : a->experts[i];
        l->ws.topk_w[i] = a->weights[i];
    }
    return Q3_OK;
}

q3_status q3_layer_expert_half(q3_layer *l, const q3_expert_half_args *a, q3_error *err) {
    const q3_config *c = &l->cfg;
    int64_t pairs;
    if (a->n < 0 || !q3_mul_i64(a->n, c->top_k, &pairs) || pairs > INT32_MAX)
        return q3_fail(err, Q3_ERR_VALUE, "rows: expected 0 to %d rows (their (row, expert) pairs are indexed by "
                       "int32), got %lld", INT32_MAX / c->top_k, (long long)a->n);
    if (!q3_dtype_is_float(a->dtype) || !q3_dtype_is_float(a->out_dtype))
        return q3_fail(err, Q3_ERR_TYPE, "%s: expected float32, bfloat16 or float16, got %s",
                       q3_dtype_is_float(a->dtype) ? "out" : "rows",
                       q3_dtype_name(q3_dtype_is_float(a->dtype) ? a->out_dtype : a->dtype));
    if (a->n == 0) return Q3_OK;
    if (!a->rows || !a->experts || !a->weights || !a->out)
        return q3_fail(err, Q3_ERR_VALUE, "expert_half: expected rows, experts, weights and out, got a NULL one");
    if (l->w.device >= 0) return q3_device() ? q3_device()->layer_expert_half(l, a, err) : no_backend(err);
    /* every row in one pass: each expert's weights are read once, whatever the rows */
    q3_status s = q3_workspace_reserve(&l->ws, c, l->w.format != Q3_WF_DENSE, a->n, 1, err);
    int skip;
    if (s == Q3_OK) s = take_routes(l, a, &skip, err);
    if (s != Q3_OK) return s;

    const q3_cpu_ops *k = q3_cpu_ops_active();
    const int64_t H = c->hidden, n = a->n;
    q3_profile_start(&l->prof);
    k->to_f32(l->ws.h, a->rows, a->dtype, n * H);
    float *dst = a->out_dtype == Q3_F32 ? a->out : l->ws.x; /* fp32: summed in place */
    if (!a->acc) memset(dst, 0, (size_t)(n * H) * sizeof(float));
    else if (dst == l->ws.x) k->to_f32(dst, a->out, a->out_dtype, n * H);
    q3_profile_mark(&l->prof, Q3_STAGE_IO);
    q3_experts_block(l, k, &l->prof, n, skip, dst);
    if (dst == l->ws.x) k->from_f32(a->out, a->out_dtype, dst, n * H);
    q3_profile_mark(&l->prof, Q3_STAGE_IO);
    return Q3_OK;
}
