/* The forward driver of a layer on a CUDA device: the stages of attention_block.c and
 * moe_block.c, each kernel queued on the caller's stream (kernels/cuda, through the table
 * of csrc/cuda_backend.c). The host keeps the bookkeeping: positions and the sequences'
 * cache pointers are staged in host memory and copied over; the router's top-k choices come
 * back to the host (one stream synchronisation per pass) to group the tokens by expert, so
 * each selected expert's weights are read once per pass, as on the CPU. Device-side grouping,
 * which CUDA-graph decode needs, is the next step. A call that fails restores the cache
 * lengths it started from. While profiling is on, an event is recorded at each stage
 * boundary and the stream is synchronised after each pass to read them. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_backend.h"
#include "layer_internal.h"

struct q3_cuda_state {
    q3_workspace dev; /* device block, carved like the host workspace */
    float *partial;   /* device scratch of split-KV attention (kernels/cuda/ops_cuda.h) */
    void *events[2 * Q3_STAGE_COUNT + 2]; /* profiling: one per stage boundary of a pass */
    int stage_of[2 * Q3_STAGE_COUNT + 2]; /* the stage each event ends */
    int n_events;
    int64_t rows;
    int seqs;
    /* host staging */
    int64_t *pos;         /* [rows] */
    q3_attn_seq *seq_ptr; /* [seqs] */
    int32_t *topk_idx;    /* [rows, k] */
    float *topk_w;        /* [rows, k] */
    int64_t *offsets;     /* [E + 1] */
    int32_t *pair_row;    /* [rows * k] */
    float *pair_w;        /* [rows * k] */
};

size_t q3_layer_cuda_workspace_bytes(const q3_layer *l) {
    const q3_cuda_state *s = l->gpu;
    if (!s) return 0;
    const q3_attn_shape shape = {.heads = l->cfg.heads, .kv_heads = l->cfg.kv_heads, .head_dim = l->cfg.head_dim};
    const int64_t split_rows = s->rows < (int64_t)s->seqs * Q3_SPLIT_MAX_TOKENS ? s->rows
                                                                                  : (int64_t)s->seqs * Q3_SPLIT_MAX_TOKENS;
    return s->dev.bytes + (size_t)q3_attention_cuda_partial_floats(split_rows, &shape) * sizeof(float);
}

void q3_layer_cuda_release(q3_layer *l) {
    q3_cuda_state *s = l->gpu;
    if (!s) return;
    if (s->dev.block && q3_cuda()) q3_cuda()->free_device(s->dev.block);
    if (s->partial && q3_cuda()) q3_cuda()->free_device(s->partial);
    for (size_t i = 0; i < sizeof s->events / sizeof s->events[0]; i++)
        if (s->events[i] && q3_cuda()) q3_cuda()->event_destroy(s->events[i]);
    free(s->pos);
    free(s->seq_ptr);
    free(s->topk_idx);
    free(s->topk_w);
    free(s->offsets);
    free(s->pair_row);
    free(s->pair_w);
    free(s);
    l->gpu = NULL;
}

static q3_status reserve(q3_layer *l, int64_t rows, int seqs, q3_error *err) {
    const q3_cuda_ops *g = q3_cuda();
    if (!g) return q3_fail(err, Q3_ERR_STATE, "cuda: the CUDA backend is not loaded");
    if (l->gpu && rows <= l->gpu->rows && seqs <= l->gpu->seqs) return Q3_OK;
    q3_layer_cuda_release(l);
    q3_cuda_state *s = calloc(1, sizeof *s);
    if (!s) return q3_fail(err, Q3_ERR_NOMEM, "cuda layer: out of host memory");
    l->gpu = s;
    const int k = l->cfg.top_k;
    const size_t bytes = q3_workspace_layout(&s->dev, NULL, &l->cfg, rows, seqs, 1);
    void *block = NULL;
    if (g->set_device(l->w.device) || g->malloc_device(&block, bytes)) {
        q3_layer_cuda_release(l);
        return q3_fail(err, Q3_ERR_NOMEM, "cuda workspace: cannot allocate %zu bytes on cuda:%d", bytes, l->w.device);
    }
    q3_workspace_layout(&s->dev, block, &l->cfg, rows, seqs, 1);
    s->dev.block = block;
    s->dev.bytes = bytes;
    const q3_attn_shape shape = {.heads = l->cfg.heads, .kv_heads = l->cfg.kv_heads, .head_dim = l->cfg.head_dim};
    /* split-KV runs for calls of at most Q3_SPLIT_MAX_TOKENS tokens per sequence */
    const int64_t split_rows = rows < (int64_t)seqs * Q3_SPLIT_MAX_TOKENS ? rows : (int64_t)seqs * Q3_SPLIT_MAX_TOKENS;
    const size_t partial = (size_t)q3_attention_cuda_partial_floats(split_rows, &shape) * sizeof(float);
    if (g->malloc_device((void **)&s->partial, partial)) {
        q3_layer_cuda_release(l);
        return q3_fail(err, Q3_ERR_NOMEM, "cuda workspace: cannot allocate %zu bytes on cuda:%d", partial, l->w.device);
    }
    s->rows = rows;
    s->seqs = seqs;
    s->pos = malloc((size_t)rows * sizeof *s->pos);
    s->seq_ptr = malloc((size_t)seqs * sizeof *s->seq_ptr);
    s->topk_idx = malloc((size_t)(rows * k) * sizeof *s->topk_idx);
    s->topk_w = malloc((size_t)(rows * k) * sizeof *s->topk_w);
    s->offsets = malloc((size_t)(l->cfg.experts + 1) * sizeof *s->offsets);
    s->pair_row = malloc((size_t)(rows * k) * sizeof *s->pair_row);
    s->pair_w = malloc((size_t)(rows * k) * sizeof *s->pair_w);
    if (!s->pos || !s->seq_ptr || !s->topk_idx || !s->topk_w || !s->offsets || !s->pair_row || !s->pair_w) {
        q3_layer_cuda_release(l);
        return q3_fail(err, Q3_ERR_NOMEM, "cuda layer: out of host memory");
    }
    return Q3_OK;
}

/* y = x W^T: tensor cores for 16 tokens or more when the shape fits, else the GEMV */
static int project(const q3_cuda_ops *g, q3_workspace *d, float *y, const float *x, const void *w, q3_dtype dt,
                   int64_t T, int64_t N, int64_t K, int accumulate, void *stream) {
    if (T >= 16 && dt == Q3_BF16 && N % 16 == 0 && K % 32 == 0)
        return g->matmul_tc(y, x, w, T, N, K, accumulate, d->xb, stream);
    return g->matmul(y, x, w, dt, T, N, K, accumulate, stream);
}

/* the first failing call of a pass, and its name */
typedef struct {
    const q3_cuda_ops *g;
    void *stream;
    int code;
    const char *what;
    q3_profile *prof;   /* NULL unless profiling */
    q3_cuda_state *st;
} gpu_run;

/* records the boundary that ends `stage` (the first call of a pass starts it: stage < 0) */
static void gpu_mark(gpu_run *run, int stage) {
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

/* after a pass: wait for it, charge each interval to its stage */
static void gpu_collect(gpu_run *run) {
    q3_cuda_state *st = run->st;
    if (!run->prof || run->code) return;
    if ((run->code = run->g->stream_synchronize(run->stream)) != 0) {
        run->what = "synchronize (profiling)";
        return;
    }
    for (int i = 1; i < st->n_events; i++) {
        float ms = 0.0f;
        if ((run->code = run->g->event_elapsed_ms(&ms, st->events[i - 1], st->events[i])) != 0) {
            run->what = "cudaEventElapsedTime";
            return;
        }
        run->prof->seconds[st->stage_of[i]] += 1e-3 * ms;
    }
    st->n_events = 0;
}

#define GPU(run, call, label)                 \
    do {                                      \
        if (!(run)->code) {                   \
            (run)->code = (call);             \
            if ((run)->code) (run)->what = label; \
        }                                     \
    } while (0)

static void attention_pass(q3_layer *l, q3_cache *c, const q3_pass *p, gpu_run *run) {
    const q3_config *cf = &l->cfg;
    const q3_weights *w = &l->w;
    const q3_cuda_ops *g = run->g;
    q3_cuda_state *st = l->gpu;
    q3_workspace *d = &st->dev;
    void *sm = run->stream;
    const int64_t R = p->n_seqs * p->L, H = cf->hidden;
    const int D = cf->head_dim, Hq = cf->heads, Hkv = cf->kv_heads;
    const int64_t QD = (int64_t)Hq * D, KVD = (int64_t)Hkv * D;
    GPU(run, g->rmsnorm(d->h, d->x, w->dense[Q3_W_INPUT_NORM], w->dtype, R, H, cf->eps, sm), "rmsnorm");
    gpu_mark(run, Q3_STAGE_INPUT_NORM);
    GPU(run, project(g, d, d->q, d->h, w->dense[Q3_W_Q_PROJ], w->dtype, R, QD, H, 0, sm), "q_proj");
    GPU(run, project(g, d, d->k, d->h, w->dense[Q3_W_K_PROJ], w->dtype, R, KVD, H, 0, sm), "k_proj");
    GPU(run, project(g, d, d->v, d->h, w->dense[Q3_W_V_PROJ], w->dtype, R, KVD, H, 0, sm), "v_proj");
    gpu_mark(run, Q3_STAGE_QKV_PROJ);
    int64_t max_keys = 0;
    for (int s = 0; s < p->n_seqs; s++) {
        const int seq = p->seqs[s];
        const int64_t n = c->lengths[seq], pad = c->padding[seq];
        max_keys = n + p->L > max_keys ? n + p->L : max_keys;
        for (int64_t t = 0; t < p->L; t++) st->pos[s * p->L + t] = n + t >= pad ? n + t - pad : 0;
        st->seq_ptr[s] = (q3_attn_seq){q3_cache_seq_keys(c, seq), q3_cache_seq_values(c, seq), n, pad};
    }
    GPU(run, g->copy_async(d->pos, st->pos, (size_t)R * sizeof *st->pos, 1, sm), "copy positions");
    GPU(run, g->copy_async(d->attn_seqs, st->seq_ptr, (size_t)p->n_seqs * sizeof *st->seq_ptr, 1, sm), "copy seqs");
    const q3_attn_shape shape = {p->L, Hq, Hkv, D, c->capacity, c->dtype, 1.0f / sqrtf((float)D), max_keys};
    /* QK-norm, RoPE and the K/V append in one kernel */
    GPU(run, g->qk_rope_kv(d->q, d->k, d->v, w->dense[Q3_W_Q_NORM], w->dense[Q3_W_K_NORM], w->dtype, d->pos,
                           d->attn_seqs, p->n_seqs, &shape, cf->eps, (float)cf->rope_theta, sm), "qk_rope_kv");
    gpu_mark(run, Q3_STAGE_QK_NORM_ROPE);
    gpu_mark(run, Q3_STAGE_KV_WRITE); /* fused into the stage before */
    GPU(run, g->attention(d->attn, d->q, d->attn_seqs, p->n_seqs, &shape, st->partial, sm), "attention");
    gpu_mark(run, Q3_STAGE_ATTENTION);
    GPU(run, project(g, d, d->x, d->attn, w->dense[Q3_W_O_PROJ], w->dtype, R, H, QD, 1, sm), "o_proj");
    gpu_mark(run, Q3_STAGE_O_PROJ);
}

static void moe_pass(q3_layer *l, const q3_pass *p, gpu_run *run) {
    const q3_config *cf = &l->cfg;
    const q3_weights *w = &l->w;
    const q3_cuda_ops *g = run->g;
    q3_cuda_state *st = l->gpu;
    q3_workspace *d = &st->dev;
    void *sm = run->stream;
    const int64_t R = p->n_seqs * p->L, H = cf->hidden, I = cf->moe_inter;
    const int E = cf->experts, k = cf->top_k;
    GPU(run, g->rmsnorm(d->h, d->x, w->dense[Q3_W_POST_NORM], w->dtype, R, H, cf->eps, sm), "post norm");
    gpu_mark(run, Q3_STAGE_POST_NORM);
    /* the router stays on exact fp32 activations: its top-k choice is sensitive to rounding */
    GPU(run, g->matmul(d->logits, d->h, w->dense[Q3_W_ROUTER], w->dtype, R, E, H, 0, sm), "router");
    gpu_mark(run, Q3_STAGE_ROUTER);
    GPU(run, g->router_topk(d->topk_idx, d->topk_w, d->logits, R, E, k, cf->norm_topk, sm), "top-k");
    GPU(run, g->copy_async(st->topk_idx, d->topk_idx, (size_t)(R * k) * sizeof(int32_t), 0, sm), "copy top-k");
    GPU(run, g->copy_async(st->topk_w, d->topk_w, (size_t)(R * k) * sizeof(float), 0, sm), "copy weights");
    GPU(run, g->stream_synchronize(sm), "synchronize");
    if (run->code) return;
    q3_cpu_ops_active()->moe_group(st->offsets, st->pair_row, st->pair_w, st->topk_idx, st->topk_w, R, k, E);
    GPU(run, g->copy_async(d->pair_row, st->pair_row, (size_t)(R * k) * sizeof(int32_t), 1, sm), "copy pairs");
    GPU(run, g->copy_async(d->pair_w, st->pair_w, (size_t)(R * k) * sizeof(float), 1, sm), "copy pair weights");
    gpu_mark(run, Q3_STAGE_TOP_K);
    for (int e = 0; e < E && !run->code; e++) {
        const int64_t first = st->offsets[e], n = st->offsets[e + 1] - first;
        if (n == 0) continue;
        GPU(run, g->gather_rows(d->xe, d->h, d->pair_row + first, n, H, sm), "gather");
        if (n < 16) { /* few tokens: gate, up and SiLU * up in one pass over both weight matrices */
            GPU(run, g->gate_up(d->gate, d->xe, w->experts[Q3_X_GATE][e], w->experts[Q3_X_UP][e], w->dtype, n, I, H,
                                sm), "gate_up");
        } else {
            GPU(run, project(g, d, d->gate, d->xe, w->experts[Q3_X_GATE][e], w->dtype, n, I, H, 0, sm), "gate_proj");
            GPU(run, project(g, d, d->up, d->xe, w->experts[Q3_X_UP][e], w->dtype, n, I, H, 0, sm), "up_proj");
            GPU(run, g->swiglu(d->gate, d->gate, d->up, n * I, sm), "swiglu");
        }
        GPU(run, project(g, d, d->ye, d->gate, w->experts[Q3_X_DOWN][e], w->dtype, n, H, I, 0, sm), "down_proj");
        GPU(run, g->scatter_add_rows(d->x, d->ye, d->pair_row + first, d->pair_w + first, n, H, sm), "combine");
    }
    gpu_mark(run, Q3_STAGE_EXPERTS);
}

q3_status q3_layer_forward_cuda(q3_layer *l, q3_cache *c, const q3_forward_args *a, q3_error *err) {
    const int64_t chunk = a->chunk > 0 ? a->chunk : Q3_DEFAULT_CHUNK;
    const int64_t step = chunk < a->tokens ? chunk : a->tokens;
    q3_status s = reserve(l, step * a->n_seqs, a->n_seqs, err);
    if (s != Q3_OK) return s;
    gpu_run run = {q3_cuda(), a->stream, 0, NULL, l->prof.enabled ? &l->prof : NULL, l->gpu};
    int64_t before[a->n_seqs];
    for (int i = 0; i < a->n_seqs; i++) before[i] = c->lengths[a->seqs[i]];
    GPU(&run, run.g->set_device(l->w.device), "cudaSetDevice");
    const int64_t H = l->cfg.hidden;
    const size_t es = q3_dtype_size(a->io_dtype);
    q3_workspace *d = &l->gpu->dev;
    for (int64_t t0 = 0; t0 < a->tokens && !run.code; t0 += step) {
        const int64_t L = a->tokens - t0 < step ? a->tokens - t0 : step;
        gpu_mark(&run, -1);
        for (int i = 0; i < a->n_seqs; i++)
            GPU(&run, run.g->to_f32(d->x + i * L * H, (const char *)a->x + ((size_t)i * a->tokens + t0) * H * es,
                                    a->io_dtype, L * H, run.stream), "input");
        gpu_mark(&run, Q3_STAGE_IO);
        const q3_pass p = {NULL, NULL, a->n_seqs, a->seqs, L};
        attention_pass(l, c, &p, &run);
        moe_pass(l, &p, &run);
        for (int i = 0; i < a->n_seqs; i++) {
            GPU(&run, run.g->from_f32((char *)a->y + ((size_t)i * a->tokens + t0) * H * es, a->io_dtype,
                                      d->x + i * L * H, L * H, run.stream), "output");
            c->lengths[a->seqs[i]] += L;
        }
        gpu_mark(&run, Q3_STAGE_IO);
        gpu_collect(&run);
    }
    if (!run.code) return Q3_OK;
    for (int i = 0; i < a->n_seqs; i++) c->lengths[a->seqs[i]] = before[i];
    return q3_fail(err, Q3_ERR_STATE, "cuda: %s failed: %s", run.what, run.g->error_string(run.code));
}
