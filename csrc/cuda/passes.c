/* The two stages of a pass on a CUDA device (attention_block.c and moe_block.c's
 * counterparts), each kernel queued on the run's stream through the table of
 * backend.c, and the device memory they work in.
 *
 * Decode passes (q3_gpu_is_decode) take no decision on the host: decode_prepare turns the
 * device-resident lengths into positions, moe_route groups the (token, expert) pairs, and the
 * grouped expert kernels read each chosen expert's weights once, guided by the device-side
 * groups. They can be captured in a CUDA graph (decode_graph.c). Larger passes stage
 * positions on the host and bring the router's choices back to group them there: one stream
 * synchronisation per pass. The experts then take one of the paths of layer.h's Q3_MOE_*
 * (moe_paths.c picks it): with bf16 weights the host may plan the experts in batches (tiles
 * of up to 64 slots of one expert, and each token's slots) so that three tensor-core
 * launches serve a whole batch (gate/up with SiLU*up, down, combine), or three cuBLAS
 * grouped GEMMs and a few small kernels; or one launch per chosen expert and projection, on
 * the WMMA kernel or through cuBLAS. */
#include <math.h>
#include <stdlib.h>

#include "layer.h"

q3_status q3_gpu_ws_alloc(q3_gpu_ws *ws, const q3_layer *l, int64_t rows, int seqs, int64_t split_rows,
                          q3_error *err) {
    const q3_cuda_ops *g = q3_cuda();
    const q3_config *cf = &l->cfg;
    const int64_t E = cf->experts, k = cf->top_k, Rd = rows < Q3_DECODE_MAX_ROWS ? rows : Q3_DECODE_MAX_ROWS;
    const int fp8 = l->w.format == Q3_WF_FP8_BLOCK128;
    /* the expert tables: the weights, then (FP8) their scales, as layer.c's expert_ptrs */
    const int64_t tables = (fp8 ? 2 : 1) * Q3_X_COUNT * E;
    const q3_attn_shape shape = {.heads = cf->heads, .kv_heads = cf->kv_heads, .head_dim = cf->head_dim};
    *ws = (q3_gpu_ws){0};
    size_t off = 0;
    char *base = NULL;
    for (int pass = 0; pass < 2; pass++) { /* measure, then carve */
        off = q3_workspace_layout(&ws->dev, base, cf, 0, rows, seqs, 1);
#define CARVE(field, type, count)                                    \
    do {                                                             \
        ws->field = (type *)(base ? base + off : NULL);              \
        off += ((size_t)(count) * sizeof(type) + 255) / 256 * 256;   \
    } while (0)
        CARVE(partial, float, q3_attention_cuda_partial_floats(split_rows, &shape));
        CARVE(lengths, int64_t, seqs);
        CARVE(active, int32_t, E + 1);
        CARVE(pair_slot, int32_t, Rd * k);
        CARVE(pair_act, float, Rd * k * cf->moe_inter);
        CARVE(pair_y, float, Rd * k * cf->hidden);
        CARVE(experts, const void *, tables);
        CARVE(moe_plan, int32_t, q3_moe_plan_ints(rows, (int)k, (int)E));
        if (fp8 && rows >= 16) CARVE(wbf16, uint16_t, q3_gpu_fp8_largest_matrix(cf));
#undef CARVE
        if (pass == 0 && (g->set_device(l->w.device) || g->malloc_device((void **)&base, off)))
            return q3_fail(err, Q3_ERR_NOMEM, "cuda workspace: cannot allocate %zu bytes on cuda:%d", off,
                           l->w.device);
    }
    ws->dev.block = base;
    ws->dev.bytes = off;
    ws->dev.rows = rows;
    ws->dev.seqs = seqs;
    ws->split_rows = split_rows;
    /* the expert kernels of a decode pass look their weights up on the device */
    if (g->copy(ws->experts, l->expert_ptrs, (size_t)tables * sizeof(void *), 1)) {
        q3_gpu_ws_free(ws);
        return q3_fail(err, Q3_ERR_STATE, "cuda workspace: cannot upload the expert pointer tables");
    }
    return Q3_OK;
}

void q3_gpu_ws_free(q3_gpu_ws *ws) {
    if (ws->dev.block && q3_cuda()) q3_cuda()->free_device(ws->dev.block);
    *ws = (q3_gpu_ws){0};
}

int q3_gpu_upload_decode_state(const q3_cuda_ops *g, q3_gpu_ws *ws, const q3_cache *c, const int32_t *seqs, int n,
                               int64_t *lengths, q3_attn_seq *rows, void *stream) {
    for (int s = 0; s < n; s++) {
        lengths[s] = c->lengths[seqs[s]];
        rows[s] = q3_cache_attn_seq(c, seqs[s]);
    }
    const int code = g->copy_async(ws->lengths, lengths, (size_t)n * sizeof *lengths, 1, stream);
    return code ? code : g->copy_async(ws->dev.attn_seqs, rows, (size_t)n * sizeof *rows, 1, stream);
}

void q3_gpu_mark(q3_gpu_run *run, int stage) {
    q3_cuda_state *st = run->st;
    if (!run->prof || run->code || st->n_events >= (int)(sizeof st->events / sizeof st->events[0])) return;
    void **ev = &st->events[st->n_events];
    if (!*ev && (run->code = run->g->event_create(ev)) != 0) {
        run->what = "cudaEventCreate";
        return;
    }
    st->stage_of[st->n_events++] = stage;
    if ((run->code = run->g->event_record(*ev, run->stream)) != 0) run->what = "cudaEventRecord";
}

/* decode passes of up to this many rows (sequences) take the multi-row GEMV, which reads
 * each weight row once for all of them (the trade against the WMMA GEMM: kernels/cuda/matmul.cu) */
#define GEMV_MAX_ROWS 64

/* y = x W^T: the GEMV for decode passes of up to GEMV_MAX_ROWS rows and for anything under
 * 16 tokens, else tensor cores when the shape fits (cuBLAS where it is open, except in a
 * decode pass, which a graph may capture); FP8 weights the same way (project_fp8.c) */
static int project(const q3_layer *l, q3_gpu_run *run, const q3_pass *p, float *y, const float *x, q3_matrix m,
                   int64_t T, int64_t N, int64_t K, int accumulate) {
    const q3_cuda_ops *g = run->g;
    const int gemv_rows = q3_gpu_is_decode(p) ? GEMV_MAX_ROWS : 15;
    const void *w = m.w;
    const q3_dtype dt = l->w.dtype;
    if (l->w.format == Q3_WF_FP8_BLOCK128)
        return q3_gpu_project_fp8(l, run, T > gemv_rows, !q3_gpu_is_decode(p), y, x, m, T, N, K, accumulate);
    if (T > gemv_rows && dt == Q3_BF16 && N % 16 == 0 && K % 32 == 0)
        return (q3_gpu_is_decode(p) ? g->matmul_wmma : g->matmul_tc)(y, x, w, T, N, K, accumulate,
                                                                      run->ws->dev.xb, run->stream);
    return g->matmul(y, x, w, dt, T, N, K, accumulate, run->stream);
}

/* positions and the sequences' cache rows, staged on the host for a pass of L > 1 tokens */
static void stage_positions(q3_cache *c, const q3_pass *p, q3_gpu_run *run) {
    q3_cuda_state *st = run->st;
    q3_workspace *d = &run->ws->dev;
    for (int s = 0; s < p->n_seqs; s++) {
        const int seq = p->seqs[s];
        const int64_t n = c->lengths[seq], pad = c->padding[seq], first = c->first_pos[seq];
        for (int64_t t = 0; t < p->L; t++) st->pos[s * p->L + t] = n + t >= pad ? first + n + t - pad : 0;
        st->seq_ptr[s] = q3_cache_attn_seq(c, seq);
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
    if (q3_gpu_is_decode(p))
        Q3_GPU(run, g->decode_prepare(d->attn_seqs, d->pos, run->ws->lengths, p->n_seqs, sm), "decode_prepare");
    else
        stage_positions(c, p, run);
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
    if (l->w.format == Q3_WF_FP8_BLOCK128) {
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

/* the list of tokens batch b touches and each one's slots (local to the batch), in the plan */
static int64_t plan_tokens(q3_cuda_state *st, q3_moe_batch *b, int64_t at) {
    int32_t *tokens = st->moe_plan + at, *index = st->token_index, *fill = st->token_fill;
    int n = 0;
    for (int64_t s = b->slot_lo; s < b->slot_hi; s++) {
        const int32_t t = st->pair_row[s];
        if (!index[t]) {
            index[t] = ++n;
            tokens[n - 1] = t;
            fill[n - 1] = 0;
        }
        fill[index[t] - 1]++;
    }
    int32_t *ptr = tokens + n, *slot = ptr + n + 1;
    ptr[0] = 0;
    for (int i = 0; i < n; i++) {
        ptr[i + 1] = ptr[i] + fill[i];
        fill[i] = ptr[i];
    }
    for (int64_t s = b->slot_lo; s < b->slot_hi; s++) /* slots ascending: each token's in expert order */
        slot[fill[index[st->pair_row[s]] - 1]++] = (int32_t)(s - b->slot_lo);
    for (int i = 0; i < n; i++) index[tokens[i]] = 0;
    b->tokens = at;
    b->n_tokens = n;
    return at + 2 * (int64_t)n + 1 + (b->slot_hi - b->slot_lo);
}

/* the experts in batches of at most R slots, their tiles and token lists; returns the batches
 * and sets *used to the plan's int32s to upload */
int q3_gpu_moe_plan_batches(q3_cuda_state *st, int64_t R, int k, int E, int64_t *used) {
    const int64_t *off = st->offsets;
    q3_moe_tile *tiles = (q3_moe_tile *)st->moe_plan;
    int64_t at = 4 * q3_moe_plan_tiles(R, k, E); /* the token lists start after the tiles' room */
    int n_batches = 0, n_tiles = 0;
    for (int e0 = 0; e0 < E;) {
        q3_moe_batch *b = &st->batches[n_batches++];
        b->slot_lo = off[e0];
        b->tile_lo = n_tiles;
        int e = e0;
        for (; e < E && (e == e0 || off[e + 1] - b->slot_lo <= R); e++) /* an expert has at most R slots */
            for (int64_t f = off[e]; f < off[e + 1]; f += Q3_MOE_TILE_ROWS) {
                const int64_t rows = off[e + 1] - f < Q3_MOE_TILE_ROWS ? off[e + 1] - f : Q3_MOE_TILE_ROWS;
                tiles[n_tiles++] = (q3_moe_tile){e, (int32_t)(f - b->slot_lo), (int32_t)rows, 0};
            }
        b->slot_hi = off[e];
        b->n_tiles = n_tiles - b->tile_lo;
        at = plan_tokens(st, b, at);
        e0 = e;
    }
    *used = at;
    return n_batches;
}

/* a few launches per batch of experts (bf16 weights on tensor cores): gate/up with SiLU * up,
 * down, combine */
static void experts_grouped(q3_layer *l, const q3_pass *p, q3_gpu_run *run) {
    const q3_config *cf = &l->cfg;
    const q3_cuda_ops *g = run->g;
    q3_cuda_state *st = run->st;
    q3_workspace *d = &run->ws->dev;
    void *sm = run->stream;
    const int64_t R = p->n_seqs * p->L, H = cf->hidden, I = cf->moe_inter;
    const int E = cf->experts, k = cf->top_k;
    int64_t used = 0;
    const int n_batches = q3_gpu_moe_plan_batches(st, R, k, E, &used);
    int32_t *plan = run->ws->moe_plan;
    const q3_moe_tile *tiles = (const q3_moe_tile *)plan;
    const void *const *gate = run->ws->experts, *const *up = gate + E, *const *down = gate + 2 * E;
    Q3_GPU(run, g->copy_async(plan, st->moe_plan, (size_t)used * sizeof(int32_t), 1, sm), "copy plan");
    for (int i = 0; i < n_batches && !run->code; i++) {
        const q3_moe_batch *b = &st->batches[i];
        if (b->n_tiles == 0) continue;
        const int32_t *tokens = plan + b->tokens, *ptr = tokens + b->n_tokens, *slot = ptr + b->n_tokens + 1;
        Q3_GPU(run, g->moe_gate_up_tc(d->gate, d->h, d->pair_row + b->slot_lo, tiles + b->tile_lo, b->n_tiles,
                                      gate, up, I, H, sm), "moe_gate_up_tc");
        Q3_GPU(run, g->moe_down_tc(d->ye, d->gate, tiles + b->tile_lo, b->n_tiles, down, H, I, sm), "moe_down_tc");
        Q3_GPU(run, g->moe_combine_csr(d->x, d->ye, d->pair_w + b->slot_lo, tokens, ptr, slot, b->n_tokens, H, sm),
               "moe_combine_csr");
    }
}

/* y = x W^T for one expert's n rows: tensor cores for 16 rows or more when the shape fits
 * (through matmul_tc, i.e. cuBLAS where it is open, when cublas is set; else the WMMA
 * kernel), else the GEMV; FP8 weights the same way (project_fp8.c) */
static int expert_project(const q3_layer *l, q3_gpu_run *run, float *y, const float *x, q3_matrix m, int64_t n,
                          int64_t N, int64_t K, int cublas) {
    const q3_cuda_ops *g = run->g;
    const void *w = m.w;
    const q3_dtype dt = l->w.dtype;
    if (l->w.format == Q3_WF_FP8_BLOCK128) return q3_gpu_project_fp8(l, run, n >= 16, cublas, y, x, m, n, N, K, 0);
    if (n >= 16 && dt == Q3_BF16 && N % 16 == 0 && K % 32 == 0)
        return (cublas ? g->matmul_tc : g->matmul_wmma)(y, x, w, n, N, K, 0, run->ws->dev.xb, run->stream);
    return g->matmul(y, x, w, dt, n, N, K, 0, run->stream);
}

/* one launch per chosen expert and step */
static void experts_one_by_one(q3_layer *l, q3_gpu_run *run, int cublas) {
    const q3_config *cf = &l->cfg;
    const q3_weights *w = &l->w;
    const q3_cuda_ops *g = run->g;
    q3_cuda_state *st = run->st;
    q3_workspace *d = &run->ws->dev;
    void *sm = run->stream;
    const int64_t H = cf->hidden, I = cf->moe_inter;
    for (int e = 0; e < cf->experts && !run->code; e++) {
        const int64_t first = st->offsets[e], n = st->offsets[e + 1] - first;
        if (n == 0) continue;
        Q3_GPU(run, g->gather_rows(d->xe, d->h, d->pair_row + first, n, H, sm), "gather");
        if (n < 16 && w->format == Q3_WF_DENSE) { /* few tokens: gate, up and SiLU * up in one pass */
            Q3_GPU(run, g->gate_up(d->gate, d->xe, w->experts[Q3_X_GATE][e], w->experts[Q3_X_UP][e], w->dtype, n, I,
                                   H, sm), "gate_up");
        } else {
            Q3_GPU(run, expert_project(l, run, d->gate, d->xe, q3_expert_matrix(l, Q3_X_GATE, e), n, I, H, cublas),
                   "gate_proj");
            Q3_GPU(run, expert_project(l, run, d->up, d->xe, q3_expert_matrix(l, Q3_X_UP, e), n, I, H, cublas),
                   "up_proj");
            Q3_GPU(run, g->swiglu(d->gate, d->gate, d->up, n * I, sm), "swiglu");
        }
        Q3_GPU(run, expert_project(l, run, d->ye, d->gate, q3_expert_matrix(l, Q3_X_DOWN, e), n, H, I, cublas),
               "down_proj");
        Q3_GPU(run, g->scatter_add_rows(d->x, d->ye, d->pair_row + first, d->pair_w + first, n, H, sm), "combine");
    }
}

void q3_gpu_moe_run_path(q3_layer *l, const q3_pass *p, q3_gpu_run *run, int path) {
    if (path == Q3_MOE_GROUPED_WMMA && q3_gpu_moe_path_fits(l, run->g, path)) experts_grouped(l, p, run);
    else if (path == Q3_MOE_GROUPED_CUBLAS && q3_gpu_moe_path_fits(l, run->g, path)) q3_gpu_moe_grouped_cublas(l, p, run);
    else experts_one_by_one(l, run, path == Q3_MOE_PER_EXPERT_CUBLAS);
}

/* the router's choices to the host, grouped there by expert; then the experts on the path
 * forced or chosen for the pass's size (moe_paths.c). staged (the expert half's rows): the
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
    const int path = q3_gpu_moe_choose(l, p, run);
    if (!run->code) q3_gpu_moe_run_path(l, p, run, path);
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
