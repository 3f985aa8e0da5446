/* The MoE half of the layer for one pass of R rows:
 *   h = rmsnorm(x); router softmax/top-k; pairs grouped by expert; for each expert with
 *   tokens: gather its rows, (silu(h G^T) * h U^T) D^T, scatter-add w * y into x.
 * Each selected expert's weights are read once per pass, whatever its token count.
 * q3_route_block is the norm and the router, q3_experts_block the rest, adding into any fp32
 * rows: the residual stream (the whole layer), or the expert half's output (layer_halves.c).
 *
 * Many rows (prefill): experts one after the other, each product split across threads.
 * Few rows (decode): whole experts split across threads, each thread streaming its experts'
 * weights back to back with no barrier between them. Each expert writes its weighted rows
 * to the (token, expert) pair slots, which are then summed into x in expert order: the
 * result does not depend on which thread ran which expert, nor on the thread count. */
#ifdef _OPENMP
#include <omp.h>
#endif

#include <string.h>

#include "layer_internal.h"

typedef struct {
    float *xe, *gate, *up; /* [n, H], [n, I], [n, I] */
} expert_buffers;

/* out [n, H] <- expert e applied to rows xe [n, H] (gate, up, SiLU * up, down); threads: the
 * FP8 matmuls' (1 when called by each thread of a parallel region) */
static void expert_apply(const q3_cpu_ops *k, const q3_layer *layer, int e, int64_t n, float *out,
                         const expert_buffers *b, uint16_t *xb, int threads) {
    const int64_t H = layer->cfg.hidden, I = layer->cfg.moe_inter;
    q3_project(layer, k, b->gate, b->xe, q3_expert_matrix(layer, Q3_X_GATE, e), n, I, H, 0, xb, threads);
    q3_project(layer, k, b->up, b->xe, q3_expert_matrix(layer, Q3_X_UP, e), n, I, H, 0, xb, threads);
    k->swiglu(b->gate, b->gate, b->up, n * I);
    q3_project(layer, k, out, b->gate, q3_expert_matrix(layer, Q3_X_DOWN, e), n, H, I, 0, xb, threads);
}

static void experts_in_turn(q3_layer *layer, const q3_cpu_ops *k, float *dst) {
    q3_workspace *ws = &layer->ws;
    const int64_t H = layer->cfg.hidden;
    const expert_buffers b = {ws->xe, ws->gate, ws->up};
    for (int e = 0; e < layer->cfg.experts; e++) {
        const int64_t first = ws->offsets[e], n = ws->offsets[e + 1] - first;
        if (n == 0) continue;
        k->gather_rows(ws->xe, ws->h, ws->pair_row + first, n, H);
        expert_apply(k, layer, e, n, ws->ye, &b, ws->xb, ws->threads);
        k->scatter_add_rows(dst, ws->ye, ws->pair_row + first, ws->pair_w + first, n, H);
    }
}

/* pair_out[s] <- weight[s] * expert(h[pair_row[s]]) for the slots s of expert e; xb: the
 * thread's bf16 scratch (q3_expert_thread_xb) */
static void expert_to_slots(const q3_cpu_ops *k, const q3_layer *layer, int e, const expert_buffers *b,
                            uint16_t *xb) {
    const q3_workspace *ws = &layer->ws;
    const int64_t H = layer->cfg.hidden;
    const int64_t first = ws->offsets[e], n = ws->offsets[e + 1] - first;
    float *out = ws->pair_out + first * H;
    k->gather_rows(b->xe, ws->h, ws->pair_row + first, n, H);
    expert_apply(k, layer, e, n, out, b, xb, 1); /* n <= Q3_MOE_THREAD_ROWS */
    for (int64_t i = 0; i < n; i++) {
        const float wt = ws->pair_w[first + i];
#pragma omp simd
        for (int64_t j = 0; j < H; j++) out[i * H + j] *= wt;
    }
}

static void experts_across_threads(q3_layer *layer, const q3_cpu_ops *k, float *dst) {
    q3_workspace *ws = &layer->ws;
    const int64_t H = layer->cfg.hidden, I = layer->cfg.moe_inter, per = q3_expert_thread_floats(&layer->cfg);
    const int64_t pairs = ws->offsets[layer->cfg.experts], rows = Q3_MOE_THREAD_ROWS; /* skipped ones after */
    int active[layer->cfg.experts], n_active = 0;
    for (int e = 0; e < layer->cfg.experts; e++)
        if (ws->offsets[e + 1] > ws->offsets[e]) active[n_active++] = e;
#pragma omp parallel num_threads(ws->threads)
    {
#ifdef _OPENMP
        const int th = omp_get_thread_num();
#else
        const int th = 0;
#endif
        float *base = ws->expert_thread + th * per;
        uint16_t *xb = ws->expert_xb + th * q3_expert_thread_xb(&layer->cfg);
        const expert_buffers b = {base, base + rows * H, base + rows * (H + I)};
#pragma omp for schedule(dynamic, 1)
        for (int a = 0; a < n_active; a++) expert_to_slots(k, layer, active[a], &b, xb);
        /* x[t] += its slots, in slot (= expert) order; threads split the hidden dim */
#pragma omp for schedule(static)
        for (int64_t j0 = 0; j0 < H; j0 += 256) {
            const int64_t j1 = j0 + 256 < H ? j0 + 256 : H;
            for (int64_t s = 0; s < pairs; s++) {
                float *row = dst + ws->pair_row[s] * H;
                const float *src = ws->pair_out + s * H;
#pragma omp simd
                for (int64_t j = j0; j < j1; j++) row[j] += src[j];
            }
        }
    }
}

/* the pass's router logits and choices into the call's outputs (rows s * tokens + t0 + t) */
static void write_router(const q3_layer *layer, const q3_pass *p) {
    const q3_workspace *ws = &layer->ws;
    const q3_forward_args *a = p->call;
    const int64_t E = layer->cfg.experts, k = layer->cfg.top_k;
    for (int s = 0; s < p->n_seqs; s++) {
        const int64_t src = s * p->L, dst = s * a->tokens + p->t0;
        if (a->router_logits)
            memcpy(a->router_logits + dst * E, ws->logits + src * E, (size_t)(p->L * E) * sizeof(float));
        if (a->router_experts)
            memcpy(a->router_experts + dst * k, ws->topk_idx + src * k, (size_t)(p->L * k) * sizeof(int32_t));
        if (a->router_weights)
            memcpy(a->router_weights + dst * k, ws->topk_w + src * k, (size_t)(p->L * k) * sizeof(float));
    }
}

void q3_route_block(q3_layer *layer, const q3_pass *p) {
    const q3_config *c = &layer->cfg;
    const q3_weights *w = &layer->w;
    q3_workspace *ws = &layer->ws;
    const int64_t R = p->n_seqs * p->L;
    const q3_cpu_ops *k = p->k;

    k->rmsnorm(ws->h, ws->x, w->dense[Q3_W_POST_NORM], w->dtype, R, c->hidden, c->eps);
    q3_profile_mark(p->prof, Q3_STAGE_POST_NORM);
    /* the router stays in fp32 (no bf16 scratch): its top-k choice is sensitive to rounding */
    k->matmul(ws->logits, ws->h, w->dense[Q3_W_ROUTER], w->dtype, R, c->experts, c->hidden, 0, NULL);
    q3_profile_mark(p->prof, Q3_STAGE_ROUTER);
    k->router_topk(ws->topk_idx, ws->topk_w, ws->logits, R, c->experts, c->top_k, c->norm_topk);
    if (q3_pass_wants_router(p)) write_router(layer, p);
}

void q3_experts_block(q3_layer *layer, const q3_cpu_ops *k, q3_profile *prof, int64_t R, int skip, float *dst) {
    q3_workspace *ws = &layer->ws;
    const int E = layer->cfg.experts;
    /* skipped entries (E) make a group of their own after the last expert's, never run */
    k->moe_group(ws->offsets, ws->pair_row, ws->pair_w, ws->topk_idx, ws->topk_w, R, layer->cfg.top_k,
                 skip ? E + 1 : E);
    q3_profile_mark(prof, Q3_STAGE_TOP_K);
    if (R <= Q3_MOE_THREAD_ROWS && ws->threads > 1) experts_across_threads(layer, k, dst);
    else experts_in_turn(layer, k, dst);
    q3_profile_mark(prof, Q3_STAGE_EXPERTS);
}
