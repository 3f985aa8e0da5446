/* The prefill MoE on a CUDA device: the experts of a pass whose (token, expert) pairs passes.c
 * grouped on the host, on one of q3_cuda.h's Q3_MOE_* paths. With bf16 weights the host may
 * plan the experts in batches (tiles of up to 64 slots of one expert, and each token's slots)
 * so that three tensor-core launches serve a whole batch (gate/up with SiLU*up, down,
 * combine), or three cuBLAS grouped GEMMs and a few small kernels (moe_cublas.c, handed the
 * plan); or one launch per chosen expert and projection, on the WMMA kernel or through cuBLAS.
 *
 * Which path, by measured speed: on a layer's first prefill pass of a size class (rows in
 * [2^(c-1), 2^c)), each path the pass can take runs once to warm up (cuBLAS's handle and
 * heuristics, lazy module loading) and once between two events on the run's stream, on the
 * same inputs; x (which every path adds its output to) is saved before and restored before
 * each run, so the outputs are discarded, and the fastest then runs on the restored x: the
 * first pass of a class costs about seven MoE stages instead of one (a profiled pass charges
 * them to its experts stage). The class keeps that path for the layer's life (the choices
 * carry over q3_layer_cuda_reserve's growth). A path the layer forces
 * (q3_layer_cuda_moe_path) skips all of it.
 *
 * Only passes whose experts are grouped on the host come here: they synchronise the stream
 * (to read the router's choices), which a graph capture forbids, so no measurement can run
 * inside one; decode passes group on the device and take no path (passes.c). */
#include <string.h>
#include <stdlib.h>

#include "moe_prefill.h"

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

/* the experts in batches of at most R slots, their tiles and token lists in st->moe_plan,
 * queued for upload into ws->moe_plan */
static q3_moe_plan make_plan(const q3_layer *l, const q3_pass *p, q3_gpu_run *run) {
    q3_cuda_state *st = run->st;
    const int64_t R = p->n_seqs * p->L, *off = st->offsets;
    const int E = l->cfg.experts, k = l->cfg.top_k;
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
    Q3_GPU(run, run->g->copy_async(run->ws->moe_plan, st->moe_plan, (size_t)at * sizeof(int32_t), 1, run->stream),
           "copy plan");
    return (q3_moe_plan){n_batches, st->batches, run->ws->moe_plan};
}

/* a few launches per batch of experts (bf16 weights on tensor cores): gate/up with SiLU * up,
 * down, combine */
static void experts_grouped(q3_layer *l, q3_gpu_run *run, const q3_moe_plan *plan) {
    const q3_config *cf = &l->cfg;
    const q3_cuda_ops *g = run->g;
    q3_workspace *d = &run->ws->dev;
    void *sm = run->stream;
    const int64_t H = cf->hidden, I = cf->moe_inter;
    const int E = cf->experts;
    const q3_moe_tile *tiles = (const q3_moe_tile *)plan->dev;
    const void *const *gate = run->ws->experts, *const *up = gate + E, *const *down = gate + 2 * E;
    for (int i = 0; i < plan->n_batches && !run->code; i++) {
        const q3_moe_batch *b = &plan->batches[i];
        if (b->n_tiles == 0) continue;
        const int32_t *tokens = plan->dev + b->tokens, *ptr = tokens + b->n_tokens, *slot = ptr + b->n_tokens + 1;
        Q3_GPU(run, g->moe_gate_up_tc(d->gate, d->h, d->pair_row + b->slot_lo, tiles + b->tile_lo, b->n_tiles,
                                      gate, up, I, H, sm), "moe_gate_up_tc");
        Q3_GPU(run, g->moe_down_tc(d->ye, d->gate, tiles + b->tile_lo, b->n_tiles, down, H, I, sm), "moe_down_tc");
        Q3_GPU(run, g->moe_combine_csr(d->x, d->ye, d->pair_w + b->slot_lo, tokens, ptr, slot, b->n_tokens, H, sm),
               "moe_combine_csr");
    }
}

/* y = x W^T for one expert's n rows: tensor cores for 16 rows or more when the shape fits
 * (through matmul_tc, i.e. cuBLAS where it is open, when cublas is set; else the WMMA
 * kernel), else the GEMV; FP8 and GPTQ weights the same way (project_quantized.c) */
static int expert_project(const q3_layer *l, q3_gpu_run *run, float *y, const float *x, q3_matrix m, int64_t n,
                          int64_t N, int64_t K, int cublas) {
    const q3_cuda_ops *g = run->g;
    const void *w = m.w;
    const q3_dtype dt = l->w.dtype;
    if (q3_gpu_quantized(l, m)) return q3_gpu_project_quantized(l, run, n >= 16, cublas, y, x, m, n, N, K, 0);
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

/* whether the pass can take `path` */
static int path_fits(const q3_layer *l, const q3_cuda_ops *g, int path) {
    const q3_config *cf = &l->cfg;
    const int bf16 = l->w.dtype == Q3_BF16;
    /* FP8 and GPTQ experts: the per-expert paths only, each hit expert's matrices dequantized
     * to bf16 one at a time (project_quantized.c); the grouped ones would need every expert in
     * bf16 at once */
    if (l->w.format != Q3_WF_DENSE && (path == Q3_MOE_GROUPED_WMMA || path == Q3_MOE_GROUPED_CUBLAS)) return 0;
    if (path == Q3_MOE_GROUPED_WMMA) return bf16 && cf->hidden % 32 == 0 && cf->moe_inter % 32 == 0;
    if (path == Q3_MOE_PER_EXPERT_CUBLAS) return bf16 && g->blas_enable(-1); /* else the WMMA one's twin */
    if (path == Q3_MOE_GROUPED_CUBLAS) /* 16-byte aligned rows in the batch's buffers; blas.cu's most groups */
        return bf16 && cf->hidden % 8 == 0 && cf->moe_inter % 8 == 0 && cf->experts <= 512 &&
               g->blas_grouped_available();
    return path == Q3_MOE_PER_EXPERT_WMMA;
}

/* the experts on `path` (one the pass cannot take runs per expert) */
static void run_path(q3_layer *l, const q3_pass *p, q3_gpu_run *run, int path) {
    const int grouped = (path == Q3_MOE_GROUPED_WMMA || path == Q3_MOE_GROUPED_CUBLAS) && path_fits(l, run->g, path);
    if (!grouped) {
        experts_one_by_one(l, run, path == Q3_MOE_PER_EXPERT_CUBLAS);
        return;
    }
    const q3_moe_plan plan = make_plan(l, p, run);
    if (path == Q3_MOE_GROUPED_WMMA) experts_grouped(l, run, &plan);
    else q3_gpu_moe_grouped_cublas(l, run, &plan);
}

static int size_class(int64_t rows) {
    int c = 0;
    while (c < Q3_MOE_SIZE_CLASSES - 1 && (rows >> c) > 0) c++;
    return c;
}

int q3_layer_cuda_moe_choice(const q3_layer *l, int c, float *ms) {
    if (!l->gpu || c < 0 || c >= Q3_MOE_SIZE_CLASSES) return 0;
    const q3_moe_choice *ch = &l->gpu->moe_choice[c];
    for (int i = 0; i < Q3_MOE_PATHS; i++) ms[i] = ch->ms[i];
    return ch->chosen;
}

/* the layer's hooks; a layer without a CUDA state yet gets an empty one (no workspace: its
 * first call grows it, carrying the hooks over), so that setting them allocates nothing on
 * the device */
static q3_status hooks_of(q3_layer *l, q3_moe_hooks **hooks, q3_error *err) {
    if (l->w.device < 0) return q3_fail(err, Q3_ERR_VALUE, "layer: expected a layer on a CUDA device, got a CPU layer");
    if (!l->gpu && !(l->gpu = calloc(1, sizeof *l->gpu)))
        return q3_fail(err, Q3_ERR_NOMEM, "cuda layer: out of host memory");
    *hooks = &l->gpu->moe_hooks;
    return Q3_OK;
}

static const char *const path_names[Q3_MOE_PATHS] = {"per_expert_wmma", "per_expert_cublas", "grouped_wmma",
                                                     "grouped_cublas"};

const char *q3_moe_path_name(int path) { return path >= 0 && path < Q3_MOE_PATHS ? path_names[path] : "measured"; }

q3_status q3_moe_path_parse(const char *name, int *path, q3_error *err) {
    for (*path = -1; *path < Q3_MOE_PATHS; ++*path)
        if (!strcmp(name, q3_moe_path_name(*path))) return Q3_OK;
    return q3_fail(err, Q3_ERR_VALUE, "path: expected 'measured', 'per_expert_wmma', 'per_expert_cublas', "
                   "'grouped_wmma' or 'grouped_cublas', got '%s'", name);
}

q3_status q3_layer_cuda_moe_path(q3_layer *l, int path, int *now, q3_error *err) {
    if (path < -2 || path >= Q3_MOE_PATHS)
        return q3_fail(err, Q3_ERR_VALUE, "path: expected -1 (measured) or 0..%d, got %d", Q3_MOE_PATHS - 1, path);
    q3_moe_hooks *h = NULL;
    const q3_status s = hooks_of(l, &h, err);
    if (s != Q3_OK) return s;
    if (path >= -1) h->forced = path + 1;
    *now = h->forced - 1;
    return Q3_OK;
}

q3_status q3_layer_cuda_moe_path_named(q3_layer *l, const char *name, const char **now, q3_error *err) {
    int path = -2, at; /* -2: only read */
    q3_status s = name ? q3_moe_path_parse(name, &path, err) : Q3_OK;
    if (s == Q3_OK) s = q3_cuda_require("cuda_moe_path", err);
    if (s == Q3_OK && (s = q3_layer_cuda_moe_path(l, path, &at, err)) == Q3_OK) *now = q3_moe_path_name(at);
    return s;
}

int q3_layer_cuda_moe_classes(const q3_layer *l, q3_moe_class out[Q3_MOE_SIZE_CLASSES]) {
    int n = 0;
    for (int c = 0; c < Q3_MOE_SIZE_CLASSES; c++) {
        q3_moe_class *k = &out[n];
        const int chosen = q3_layer_cuda_moe_choice(l, c, k->ms);
        if (!chosen) continue;
        k->path = chosen - 1;
        k->lo = c ? (int64_t)1 << (c - 1) : 0; /* rows [2^(c-1), 2^c) */
        k->hi = ((int64_t)1 << c) - 1;
        n++;
    }
    return n;
}

q3_status q3_layer_cuda_moe_inject_times(q3_layer *l, const float *ms, q3_error *err) {
    q3_moe_hooks *h = NULL;
    q3_status s = q3_cuda_require("cuda_moe_inject_times", err);
    if (s == Q3_OK) s = hooks_of(l, &h, err);
    if (s != Q3_OK) return s;
    h->injected = ms != NULL;
    for (int i = 0; i < Q3_MOE_PATHS; i++) h->ms[i] = ms ? ms[i] : 0.0f;
    return Q3_OK;
}

/* one run of `path` between the two events; its time in *ms */
static void time_path(q3_layer *l, const q3_pass *p, q3_gpu_run *run, int path, float *ms) {
    void **ev = run->st->moe_events;
    Q3_GPU(run, run->g->event_record(ev[0], run->stream), "cudaEventRecord");
    run_path(l, p, run, path);
    Q3_GPU(run, run->g->event_record(ev[1], run->stream), "cudaEventRecord");
    Q3_GPU(run, run->g->stream_synchronize(run->stream), "synchronize (MoE path timing)");
    Q3_GPU(run, run->g->event_elapsed_ms(ms, ev[0], ev[1]), "cudaEventElapsedTime");
    if (run->st->moe_hooks.injected) *ms = run->st->moe_hooks.ms[path];
}

/* the fastest of the paths the pass can take into ch; a buffer for the pass's x [R, H] is
 * allocated for the measurement (every workspace buffer of that size is in use by one path
 * or another: the attention stage's share memory with the experts', csrc/engine/workspace.c)
 * and freed after it: once per size class. Without the memory for it, the default path
 * (grouped where it fits) is kept untimed. */
static void measure(q3_layer *l, const q3_pass *p, q3_gpu_run *run, q3_moe_choice *ch) {
    const q3_cuda_ops *g = run->g;
    q3_workspace *d = &run->ws->dev;
    const size_t bytes = (size_t)(p->n_seqs * p->L * l->cfg.hidden) * sizeof(float);
    for (int path = 0; path < Q3_MOE_PATHS; path++) ch->ms[path] = -1.0f;
    for (int i = 0; i < 2 && !run->code; i++)
        if (!run->st->moe_events[i]) Q3_GPU(run, g->event_create(&run->st->moe_events[i]), "cudaEventCreate");
    float *saved = NULL;
    if (run->code) return;
    if (g->malloc_device((void **)&saved, bytes) != 0) {
        const int grouped = path_fits(l, g, Q3_MOE_GROUPED_WMMA);
        ch->chosen = 1 + (grouped ? Q3_MOE_GROUPED_WMMA : Q3_MOE_PER_EXPERT_WMMA);
        return;
    }
    Q3_GPU(run, g->copy_device_async(saved, d->x, bytes, run->stream), "save x");
    int best = -1;
    for (int path = 0; path < Q3_MOE_PATHS && !run->code; path++) {
        if (!path_fits(l, g, path)) continue;
        for (int rep = 0; rep < 2 && !run->code; rep++) { /* a warm-up, then the timed run */
            Q3_GPU(run, g->copy_device_async(d->x, saved, bytes, run->stream), "restore x");
            time_path(l, p, run, path, &ch->ms[path]);
        }
        if (run->code == Q3_BLAS_REFUSED) { /* cuBLAS refused the grouped GEMM: not a candidate */
            run->code = 0;
            run->what = NULL;
            ch->ms[path] = -1.0f;
            continue;
        }
        if (!run->code && (best < 0 || ch->ms[path] < ch->ms[best])) best = path;
    }
    Q3_GPU(run, g->copy_device_async(d->x, saved, bytes, run->stream), "restore x");
    Q3_GPU(run, g->stream_synchronize(run->stream), "synchronize (MoE path timing)");
    g->free_device(saved);
    if (!run->code) ch->chosen = 1 + best;
}

static int choose(q3_layer *l, const q3_pass *p, q3_gpu_run *run) {
    if (run->st->moe_hooks.forced) return run->st->moe_hooks.forced - 1;
    q3_moe_choice *ch = &run->st->moe_choice[size_class(p->n_seqs * p->L)];
    if (!ch->chosen) measure(l, p, run, ch);
    return ch->chosen ? ch->chosen - 1 : Q3_MOE_PER_EXPERT_WMMA;
}

void q3_gpu_moe_prefill(q3_layer *l, const q3_pass *p, q3_gpu_run *run) {
    const int path = choose(l, p, run);
    if (!run->code) run_path(l, p, run, path);
}
