/* The one pass loop (q3_layer_run_passes, layer_object.h): a checked call's tokens chunk by
 * chunk through the stages a device supplies, the cache lengths advanced pass by pass and
 * rolled back in one place when the call stops; and the CPU's stages, the CPU layer's passes
 * (q3_layer_passes). A CUDA device's stages are csrc/cuda/layer.c's. */
#include "layer_internal.h"

/* each sequence of the call back by the tokens its passes added: the one roll-back, of a
 * stopped loop and of an aborted run of passes (q3_layer_attention_passes_abort) */
static void roll_back(q3_cache *c, const q3_forward_args *a, q3_pass_cursor *cur) {
    for (int i = 0; i < a->n_seqs; i++) {
        c->lengths[a->seqs[i]] -= cur->advanced;
        q3_cache_hidden_trim(c, a->seqs[i]); /* flags of the dropped tokens, and of a failed pass's */
    }
    *cur = (q3_pass_cursor){.passes = cur->passes, .done = cur->done}; /* closed; its counts kept */
}

q3_status q3_layer_run_passes(q3_layer *l, q3_cache *c, const q3_forward_args *a, const q3_attention_half_out *half,
                              q3_pass_cursor *cur, const q3_pass_stages *s, void *run, q3_error *err) {
    const int64_t step = q3_call_step(a);
    const q3_cpu_ops *k = q3_cpu_ops_active();
    q3_pass_cursor whole = {.open = 1};
    q3_pass_cursor *at = cur ? cur : &whole; /* where the passes start, what they added so far */
    const int64_t until = cur && cur->next + step < a->tokens ? cur->next + step : a->tokens;
    for (int64_t t0 = at->next; t0 < until && !s->failed(run); t0 += step) {
        const int64_t L = a->tokens - t0 < step ? a->tokens - t0 : step;
        if (t0 > 0 && a->interrupted && a->interrupted(a->interrupt_ctx)) {
            /* a device's queued passes finish on their own: their K/V lie past the lengths */
            for (int i = 0; i < a->n_seqs; i++) c->verify_start[a->seqs[i]] = -1;
            roll_back(c, a, at);
            return q3_layer_interrupted(err, t0, a->tokens);
        }
        const q3_pass p = {k, &l->prof, a->n_seqs, a->seqs, L, a, t0, cur != NULL};
        s->input(l, &p, run);
        s->attention(l, c, &p, run);
        s->route(l, &p, run);
        if (half) {
            s->half_write(l, &p, half, run);
        } else {
            s->experts(l, &p, run);
            s->output(l, &p, run);
        }
        for (int i = 0; i < a->n_seqs; i++) c->lengths[a->seqs[i]] += L;
        at->advanced += L;
        at->next = t0 + L;
        s->end(l, &p, run);
    }
    for (int i = 0; i < a->n_seqs; i++) /* a tree call is a verify that accept may compact; nothing else is */
        c->verify_start[a->seqs[i]] = a->tree && !s->failed(run) ? c->lengths[a->seqs[i]] - at->advanced : -1;
    if (!s->failed(run)) return Q3_OK;
    roll_back(c, a, at);
    return s->failure(run, err);
}

void q3_layer_attention_passes_abort(q3_cache *c, const q3_forward_args *a, q3_pass_cursor *cur) {
    if (cur->open) roll_back(c, a, cur);
}

/* ---- the CPU's stages: the workspace's rows, the blocks of attention_block.c and moe_block.c */

static void cpu_input(q3_layer *l, const q3_pass *p, void *run) {
    (void)run;
    const int64_t H = l->cfg.hidden, L = p->L;
    const size_t es = q3_dtype_size(p->call->io_dtype);
    q3_profile_start(&l->prof);
    for (int i = 0; i < p->n_seqs; i++)
        p->k->to_f32(l->ws.x + i * L * H, (const char *)p->call->x + ((size_t)i * p->call->tokens + p->t0) * H * es,
                     p->call->io_dtype, L * H);
    q3_profile_mark(&l->prof, Q3_STAGE_IO);
}

static void cpu_attention(q3_layer *l, q3_cache *c, const q3_pass *p, void *run) {
    (void)run;
    q3_attention_block(l, c, p);
}

static void cpu_route(q3_layer *l, const q3_pass *p, void *run) {
    (void)run;
    q3_route_block(l, p);
}

static void cpu_half_write(q3_layer *l, const q3_pass *p, const q3_attention_half_out *half, void *run) {
    (void)run;
    q3_attention_half_write(l, p, half);
}

static void cpu_experts(q3_layer *l, const q3_pass *p, void *run) {
    (void)run;
    q3_experts_block(l, p->k, &l->prof, p->L * p->n_seqs, 0, l->ws.x);
}

static void cpu_output(q3_layer *l, const q3_pass *p, void *run) {
    (void)run;
    const int64_t H = l->cfg.hidden, L = p->L;
    const size_t es = q3_dtype_size(p->call->io_dtype);
    for (int i = 0; i < p->n_seqs; i++)
        p->k->from_f32((char *)p->call->y + ((size_t)i * p->call->tokens + p->t0) * H * es, p->call->io_dtype,
                       l->ws.x + i * L * H, L * H);
}

static void cpu_end(q3_layer *l, const q3_pass *p, void *run) {
    (void)p;
    (void)run;
    q3_profile_mark(&l->prof, Q3_STAGE_IO);
}

static int cpu_failed(const void *run) {
    (void)run;
    return 0; /* the CPU's stages cannot fail: the workspace is reserved, the call checked */
}

static q3_status cpu_failure(const void *run, q3_error *err) {
    (void)run;
    return q3_fail(err, Q3_ERR_STATE, "cpu: a pass failed");
}

static const q3_pass_stages cpu_stages = {cpu_input, cpu_attention, cpu_route, cpu_half_write, cpu_experts,
                                          cpu_output, cpu_end, cpu_failed, cpu_failure};

q3_status q3_layer_passes(q3_layer *l, q3_cache *c, const q3_forward_args *a, const q3_attention_half_out *half,
                          q3_pass_cursor *cur, q3_error *err) {
    const int64_t step = q3_call_step(a);
    const q3_status s =
        q3_workspace_reserve(&l->ws, &l->cfg, l->w.format != Q3_WF_DENSE, step * a->n_seqs, a->n_seqs, err);
    return s != Q3_OK ? s : q3_layer_run_passes(l, c, a, half, cur, &cpu_stages, NULL, err);
}
