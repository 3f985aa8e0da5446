/* The stages of a pass on a CUDA device (attention_block.c and moe_block.c's
 * counterparts), each kernel queued on the run's stream through the table of backend.c, in
 * the device state of device_state.c.
 *
 * Decode passes (q3_gpu_is_decode) take no decision on the host: decode_prepare turns the
 * device-resident lengths into positions, moe_route groups the (token, expert) pairs, and the
 * grouped expert kernels read each chosen expert's weights once, guided by the device-side
 * groups. They can be captured in a CUDA graph (decode_graph.c). Larger passes stage
 * positions on the host and bring the router's choices back to group them there: one stream
 * synchronisation per pass. Their experts are then the prefill MoE's (moe_prefill.c: its
 * paths, its plan and the measured choice between the paths, behind one entry). A decode
 * pass whose call gives positions, or whose sequences hold hidden tokens (a token mask's),
 * stages its positions and cache rows on the host as larger passes do, the hidden flags
 * uploaded beside them (q3_gpu_stages_on_host); so does every pass of a call with a tree (a
 * verify: prefill-like), its tree uploaded too. */
#include <math.h>

#include "moe_prefill.h"
#include "passes.h"

int q3_gpu_upload_decode_state(const q3_cuda_ops *g, q3_gpu_ws *ws, const q3_cache *c, const int32_t *seqs, int n,
                               int64_t *lengths, q3_attn_seq *rows, void *stream) {
    for (int s = 0; s < n; s++) { /* no hidden flags: their passes are staged on the host, graphs refuse them */
        lengths[s] = c->lengths[seqs[s]];
        rows[s] = q3_cache_attn_seq(c, seqs[s], 1);
    }
    const int code = g->copy_async(ws->lengths, lengths, (size_t)n * sizeof *lengths, 1, stream);
    return code ? code : g->copy_async(ws->dev.attn_seqs, rows, (size_t)n * sizeof *rows, 1, stream);
}

/* decode passes of up to this many rows (sequences) take the multi-row GEMV, which reads
 * each weight row once for all of them (the trade against the WMMA GEMM: kernels/cuda/matmul.cu) */
#define GEMV_MAX_ROWS 64

/* y = x W^T: the GEMV for decode passes of up to GEMV_MAX_ROWS rows and for anything under
 * 16 tokens, else tensor cores when the shape fits (cuBLAS where it is open, except in a
 * decode pass, which a graph may capture); FP8 and GPTQ weights the same way (project_quantized.c) */
static int project(const q3_layer *l, q3_gpu_run *run, const q3_pass *p, float *y, const float *x, q3_matrix m,
                   int64_t T, int64_t N, int64_t K, int accumulate) {
    const q3_cuda_ops *g = run->g;
    const int gemv_rows = q3_gpu_is_decode(p) ? GEMV_MAX_ROWS : 15;
    const void *w = m.w;
    const q3_dtype dt = l->w.dtype;
    if (q3_gpu_quantized(l, m))
        return q3_gpu_project_quantized(l, run, T > gemv_rows, !q3_gpu_is_decode(p), y, x, m, T, N, K, accumulate);
    if (T > gemv_rows && dt == Q3_BF16 && N % 16 == 0 && K % 32 == 0)
        return (q3_gpu_is_decode(p) ? g->matmul_wmma : g->matmul_tc)(y, x, w, T, N, K, accumulate,
                                                                      run->ws->dev.xb, run->stream);
    return g->matmul(y, x, w, dt, T, N, K, accumulate, run->stream);
}

int q3_gpu_stages_on_host(const q3_cache *c, const q3_pass *p) {
    if (!q3_gpu_is_decode(p) || (p->call && (p->call->positions || p->call->tree))) return 1;
    for (int s = 0; s < p->n_seqs; s++)
        if (q3_cache_attn_seq(c, p->seqs[s], p->L).hidden) return 1;
    return 0;
}

/* positions and the sequences' cache rows (q3_pass_attn_seq: its hidden flags and the call's
 * tree), staged on the host (q3_gpu_stages_on_host); the hidden flags of each sequence that has
 * some, rows [0, n_past + L), uploaded one after the other into st->hidden (grown to the
 * cache's batch x capacity, the most a pass needs), its row pointing there; a tree call's
 * trees [n_seqs, T, T] into st->tree, each row pointing at its sequence's */
static void stage_positions(q3_cache *c, const q3_pass *p, q3_gpu_run *run) {
    q3_cuda_state *st = run->st;
    q3_workspace *d = &run->ws->dev;
    const uint8_t *tree = p->call ? p->call->tree : NULL;
    if (tree) {
        const size_t n = (size_t)p->n_seqs * (size_t)p->call->tokens * (size_t)p->call->tokens;
        Q3_GPU(run, q3_gpu_staging_reserve(run->g, &st->tree, &st->tree_bytes, n, run->stream),
               "allocating the tree");
        Q3_GPU(run, run->g->copy_async(st->tree, tree, n, 1, run->stream), "copy tree");
    }
    size_t flags = 0;
    for (int s = 0; s < p->n_seqs && !run->code; s++) {
        q3_pass_positions(c, p, s, st->pos + s * p->L);
        q3_attn_seq *row = &st->seq_ptr[s];
        *row = q3_pass_attn_seq(c, p, s);
        if (row->tree) row->tree = st->tree + (row->tree - tree);
        if (!row->hidden) continue;
        const size_t n = (size_t)(row->n_past + p->L);
        Q3_GPU(run, q3_gpu_staging_reserve(run->g, &st->hidden, &st->hidden_bytes,
                                           (size_t)c->batch * (size_t)c->capacity, run->stream),
               "allocating the hidden flags");
        Q3_GPU(run, run->g->copy_async(st->hidden + flags, row->hidden, n, 1, run->stream), "copy hidden flags");
        row->hidden = st->hidden + flags;
        flags += n;
    }
    Q3_GPU(run, run->g->copy_async(d->pos, st->pos, (size_t)(p->n_seqs * p->L) * sizeof *st->pos, 1, run->stream),
           "copy positions");
    Q3_GPU(run, run->g->copy_async(d->attn_seqs, st->seq_ptr, (size_t)p->n_seqs * sizeof *st->seq_ptr, 1, run->stream),
           "copy seqs");
}

void q3_gpu_attention_pass(q3_layer *l, q3_cache *c, const q3_pass *p, int64_t max_keys, q3_gpu_run *run) {
    const q3_config *cf = &l->cfg;
    const q3_weights *w = &l->w;
    const q3_cuda_ops *g = run->g;
    q3_workspace *d = &run->ws->dev;
    void *sm = run->stream;
    const int64_t R = p->n_seqs * p->L, H = cf->hidden;
    const int D = cf->head_dim, Hq = cf->heads, Hkv = cf->kv_heads;
    const int64_t QD = (int64_t)Hq * D, KVD = (int64_t)Hkv * D;
    Q3_GPU(run, g->rmsnorm(d->h, d->x, w->dense[Q3_W_INPUT_NORM], w->dtype, R, H, cf->eps, sm), "rmsnorm");
    q3_gpu_mark(run, Q3_STAGE_INPUT_NORM);
    Q3_GPU(run, project(l, run, p, d->q, d->h, q3_dense_matrix(l, Q3_W_Q_PROJ), R, QD, H, 0), "q_proj");
    Q3_GPU(run, project(l, run, p, d->k, d->h, q3_dense_matrix(l, Q3_W_K_PROJ), R, KVD, H, 0), "k_proj");
    Q3_GPU(run, project(l, run, p, d->v, d->h, q3_dense_matrix(l, Q3_W_V_PROJ), R, KVD, H, 0), "v_proj");
    q3_gpu_mark(run, Q3_STAGE_QKV_PROJ);
    if (q3_gpu_stages_on_host(c, p))
        stage_positions(c, p, run);
    else
        Q3_GPU(run, g->decode_prepare(d->attn_seqs, d->pos, run->ws->lengths, p->n_seqs, sm), "decode_prepare");
    const q3_attn_shape shape = {p->L, Hq, Hkv, D, c->capacity, c->dtype, 1.0f / sqrtf((float)D), max_keys};
    /* QK-norm, RoPE and the K/V append in one kernel */
    Q3_GPU(run, g->qk_rope_kv(d->q, d->k, d->v, w->dense[Q3_W_Q_NORM], w->dense[Q3_W_K_NORM], w->dtype, d->pos,
                              d->attn_seqs, p->n_seqs, &shape, cf->eps, l->rope_inv_freq, l->rope_scale, sm),
           "qk_rope_kv");
    q3_gpu_mark(run, Q3_STAGE_QK_NORM_ROPE);
    q3_gpu_mark(run, Q3_STAGE_KV_WRITE); /* fused into the stage before */
    if (p->call && p->call->attention) /* before attention: its output overwrites q */
        Q3_GPU(run, g->attention_probs(p->call->attention, d->q, d->attn_seqs, p->n_seqs, &shape, p->t0,
                                       p->call->tokens, p->call->attention_context, sm), "attention_probs");
    Q3_GPU(run, g->attention(d->attn, d->q, d->attn_seqs, p->n_seqs, &shape, run->ws->partial, sm), "attention");
    q3_gpu_mark(run, Q3_STAGE_ATTENTION);
    /* into h: the MoE pass adds it to the residual in the same kernel as its norm */
    Q3_GPU(run, project(l, run, p, d->h, d->attn, q3_dense_matrix(l, Q3_W_O_PROJ), R, H, QD, 0), "o_proj");
    q3_gpu_mark(run, Q3_STAGE_O_PROJ);
}

/* grouping on the device, then each chosen expert's gate/up, down and the combine: three
 * launches for all experts, whatever the router chose */
static void experts_on_device(q3_layer *l, const q3_pass *p, q3_gpu_run *run) {
    const q3_config *cf = &l->cfg;
    const q3_cuda_ops *g = run->g;
    q3_workspace *d = &run->ws->dev;
    q3_gpu_ws *ws = run->ws;
    void *sm = run->stream;
    const int64_t R = p->n_seqs * p->L, H = cf->hidden, I = cf->moe_inter, E = cf->experts;
    const int k = cf->top_k, max_active = (int)(R * k < E ? R * k : E);
    const void *const *gate = ws->experts, *const *up = ws->experts + E, *const *down = ws->experts + 2 * E;
    const void *const *scales = ws->experts + Q3_X_COUNT * E; /* FP8: gate's, up's, down's */
    Q3_GPU(run, g->moe_route(d->offsets, d->pair_row, d->pair_w, ws->active, ws->pair_slot, d->topk_idx, d->topk_w,
                             R, k, (int)E, sm), "moe_route");
    q3_gpu_mark(run, Q3_STAGE_TOP_K);
    if (l->w.format == Q3_WF_GPTQ_INT4) { /* each projection's E matrices: a device table of structs */
        const q3_int4_matrix *m = ws->int4_experts;
        Q3_GPU(run, g->moe_gate_up_int4(ws->pair_act, d->h, d->pair_row, d->offsets, ws->active, m + Q3_X_GATE * E,
                                        m + Q3_X_UP * E, max_active, I, H, sm), "moe_gate_up_int4");
        Q3_GPU(run, g->moe_down_int4(ws->pair_y, ws->pair_act, d->offsets, ws->active, m + Q3_X_DOWN * E, max_active,
                                     H, I, sm), "moe_down_int4");
    } else if (l->w.format == Q3_WF_FP8_BLOCK128) {
        const q3_dtype sdt = l->w.scale_dtype;
        Q3_GPU(run, g->moe_gate_up_fp8(ws->pair_act, d->h, d->pair_row, d->offsets, ws->active,
                                       (const uint8_t *const *)gate, (const uint8_t *const *)up, scales,
                                       scales + E, sdt, max_active, I, H, sm), "moe_gate_up_fp8");
        Q3_GPU(run, g->moe_down_fp8(ws->pair_y, ws->pair_act, d->offsets, ws->active, (const uint8_t *const *)down,
                                    scales + 2 * E, sdt, max_active, H, I, sm), "moe_down_fp8");
    } else {
        Q3_GPU(run, g->moe_gate_up(ws->pair_act, d->h, d->pair_row, d->offsets, ws->active, gate, up, l->w.dtype,
                                   max_active, I, H, sm), "moe_gate_up");
        Q3_GPU(run, g->moe_down(ws->pair_y, ws->pair_act, d->offsets, ws->active, down, l->w.dtype, max_active, H,
                                I, sm), "moe_down");
    }
    Q3_GPU(run, g->moe_combine(d->x, ws->pair_y, d->pair_w, ws->pair_slot, R, k, H, sm), "moe_combine");
}

/* the router's choices to the host, grouped there by expert; then the experts on the path
 * forced or chosen for the pass's size (moe_prefill.c). staged (the expert half's rows): the
 * choices are on the host already, in st->topk_idx and st->topk_w, an entry E marking an
 * expert held elsewhere: grouped as expert E + 1, past the last expert's slots, where no path
 * reads (st->offsets has E + 2 entries) */
static void experts_from_host(q3_layer *l, const q3_pass *p, q3_gpu_run *run, int staged) {
    const q3_config *cf = &l->cfg;
    const q3_cuda_ops *g = run->g;
    q3_cuda_state *st = run->st;
    q3_workspace *d = &run->ws->dev;
    void *sm = run->stream;
    const int64_t R = p->n_seqs * p->L;
    const int E = cf->experts, k = cf->top_k;
    if (!staged) {
        Q3_GPU(run, g->copy_async(st->topk_idx, d->topk_idx, (size_t)(R * k) * sizeof(int32_t), 0, sm), "copy top-k");
        Q3_GPU(run, g->copy_async(st->topk_w, d->topk_w, (size_t)(R * k) * sizeof(float), 0, sm), "copy weights");
        Q3_GPU(run, g->stream_synchronize(sm), "synchronize");
    }
    if (run->code) return;
    q3_cpu_ops_active()->moe_group(st->offsets, st->pair_row, st->pair_w, st->topk_idx, st->topk_w, R, k,
                                   staged ? E + 1 : E);
    Q3_GPU(run, g->copy_async(d->pair_row, st->pair_row, (size_t)(R * k) * sizeof(int32_t), 1, sm), "copy pairs");
    Q3_GPU(run, g->copy_async(d->pair_w, st->pair_w, (size_t)(R * k) * sizeof(float), 1, sm), "copy pair weights");
    q3_gpu_mark(run, Q3_STAGE_TOP_K);
    q3_gpu_moe_prefill(l, p, run);
}

/* the pass's router logits and choices into the call's outputs (rows s * tokens + t0 + t),
 * device to device on the run's stream */
static void write_router(const q3_layer *l, const q3_pass *p, q3_gpu_run *run) {
    const q3_workspace *d = &run->ws->dev;
    const q3_forward_args *a = p->call;
    const int64_t E = l->cfg.experts, k = l->cfg.top_k;
    for (int s = 0; s < p->n_seqs && !run->code; s++) {
        const int64_t src = s * p->L, dst = s * a->tokens + p->t0;
        if (a->router_logits)
            Q3_GPU(run, run->g->copy_device_async(a->router_logits + dst * E, d->logits + src * E,
                                                  (size_t)(p->L * E) * sizeof(float), run->stream), "router logits");
        if (a->router_experts)
            Q3_GPU(run, run->g->copy_device_async(a->router_experts + dst * k, d->topk_idx + src * k,
                                                  (size_t)(p->L * k) * sizeof(int32_t), run->stream), "router experts");
        if (a->router_weights)
            Q3_GPU(run, run->g->copy_device_async(a->router_weights + dst * k, d->topk_w + src * k,
                                                  (size_t)(p->L * k) * sizeof(float), run->stream), "router weights");
    }
}

void q3_gpu_route_pass(q3_layer *l, const q3_pass *p, q3_gpu_run *run) {
    const q3_config *cf = &l->cfg;
    const q3_weights *w = &l->w;
    q3_workspace *d = &run->ws->dev;
    void *sm = run->stream;
    const int64_t R = p->n_seqs * p->L, H = cf->hidden;
    const int E = cf->experts, k = cf->top_k;
    /* x += o_proj's output (in h), and h = the norm of the new x, in one kernel */
    Q3_GPU(run, run->g->add_rmsnorm(d->h, d->x, d->h, w->dense[Q3_W_POST_NORM], w->dtype, R, H, cf->eps, sm),
           "post norm");
    q3_gpu_mark(run, Q3_STAGE_POST_NORM);
    /* the router stays on exact fp32 activations: its top-k choice is sensitive to rounding */
    Q3_GPU(run, run->g->matmul(d->logits, d->h, w->dense[Q3_W_ROUTER], w->dtype, R, E, H, 0, sm), "router");
    q3_gpu_mark(run, Q3_STAGE_ROUTER);
    Q3_GPU(run, run->g->router_topk(d->topk_idx, d->topk_w, d->logits, R, E, k, cf->norm_topk, sm), "top-k");
    if (q3_pass_wants_router(p)) write_router(l, p, run);
}

void q3_gpu_experts_pass(q3_layer *l, const q3_pass *p, q3_gpu_run *run) {
    if (q3_gpu_is_decode(p)) experts_on_device(l, p, run);
    else experts_from_host(l, p, run, 0);
    q3_gpu_mark(run, Q3_STAGE_EXPERTS);
}

void q3_gpu_experts_rows(q3_layer *l, const q3_pass *p, q3_gpu_run *run, int on_device) {
    if (on_device) experts_on_device(l, p, run);
    else experts_from_host(l, p, run, 1);
    q3_gpu_mark(run, Q3_STAGE_EXPERTS);
}

void q3_gpu_moe_pass(q3_layer *l, const q3_pass *p, q3_gpu_run *run) {
    q3_gpu_route_pass(l, p, run);
    q3_gpu_experts_pass(l, p, run);
}
