/* Which path the prefill MoE takes (q3_cuda.h's Q3_MOE_*), by measured speed: on a layer's
 * first prefill pass of a size class (rows in [2^(c-1), 2^c)), each path the pass can take
 * runs once to warm up (cuBLAS's handle and heuristics, lazy module loading) and once between
 * two events on the run's stream, on the same inputs; x (which every path adds its output
 * to) is saved before and restored before each run, so the outputs are discarded, and the
 * caller then runs the fastest on the restored x: the first pass of a class costs about
 * seven MoE stages instead of one (a profiled pass charges them to its experts stage). The
 * class keeps that path until the layer's CUDA state is remade (layer.c's reserve, when the
 * workspace grows). A forced path (q3_cuda_moe_path) skips all of it.
 *
 * Only passes whose experts are grouped on the host come here: they synchronise the stream
 * (to read the router's choices), which a graph capture forbids, so no measurement can run
 * inside one; decode passes group on the device and take no path (passes.c). */
#include "layer.h"

static int forced_path = -1; /* -1: measured */
static float injected_ms[Q3_MOE_PATHS];
static int injected;

int q3_cuda_moe_path(int path) {
    if (path >= -1 && path < Q3_MOE_PATHS) forced_path = path;
    return forced_path;
}

int q3_cuda_grouped_prefill(int on) {
    if (on >= 0) forced_path = on ? Q3_MOE_GROUPED_WMMA : Q3_MOE_PER_EXPERT_CUBLAS;
    return forced_path == Q3_MOE_GROUPED_WMMA;
}

void q3_cuda_moe_inject_times(const float *ms) {
    injected = ms != NULL;
    for (int i = 0; ms && i < Q3_MOE_PATHS; i++) injected_ms[i] = ms[i];
}

int q3_moe_size_class(int64_t rows) {
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

int q3_gpu_moe_path_fits(const q3_layer *l, const q3_cuda_ops *g, int path) {
    const q3_config *cf = &l->cfg;
    const int bf16 = l->w.dtype == Q3_BF16;
    /* FP8 experts: the per-expert paths only, each hit expert's matrices dequantized to bf16
     * one at a time (project_fp8.c); the grouped ones would need every expert in bf16 at once */
    if (l->w.format == Q3_WF_FP8_BLOCK128 && (path == Q3_MOE_GROUPED_WMMA || path == Q3_MOE_GROUPED_CUBLAS)) return 0;
    if (path == Q3_MOE_GROUPED_WMMA) return bf16 && cf->hidden % 32 == 0 && cf->moe_inter % 32 == 0;
    if (path == Q3_MOE_PER_EXPERT_CUBLAS) return bf16 && g->blas_enable(-1); /* else the WMMA one's twin */
    if (path == Q3_MOE_GROUPED_CUBLAS) /* 16-byte aligned rows in the batch's buffers; blas.cu's most groups */
        return bf16 && cf->hidden % 8 == 0 && cf->moe_inter % 8 == 0 && cf->experts <= 512 &&
               g->blas_grouped_available();
    return path == Q3_MOE_PER_EXPERT_WMMA;
}

/* one run of `path` between the two events; its time in *ms */
static void time_path(q3_layer *l, const q3_pass *p, q3_gpu_run *run, int path, float *ms) {
    void **ev = run->st->moe_events;
    Q3_GPU(run, run->g->event_record(ev[0], run->stream), "cudaEventRecord");
    q3_gpu_moe_run_path(l, p, run, path);
    Q3_GPU(run, run->g->event_record(ev[1], run->stream), "cudaEventRecord");
    Q3_GPU(run, run->g->stream_synchronize(run->stream), "synchronize (MoE path timing)");
    Q3_GPU(run, run->g->event_elapsed_ms(ms, ev[0], ev[1]), "cudaEventElapsedTime");
    if (injected) *ms = injected_ms[path];
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
        const int grouped = q3_gpu_moe_path_fits(l, g, Q3_MOE_GROUPED_WMMA);
        ch->chosen = 1 + (grouped ? Q3_MOE_GROUPED_WMMA : Q3_MOE_PER_EXPERT_WMMA);
        return;
    }
    Q3_GPU(run, g->copy_device_async(saved, d->x, bytes, run->stream), "save x");
    int best = -1;
    for (int path = 0; path < Q3_MOE_PATHS && !run->code; path++) {
        if (!q3_gpu_moe_path_fits(l, g, path)) continue;
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

int q3_gpu_moe_choose(q3_layer *l, const q3_pass *p, q3_gpu_run *run) {
    if (forced_path >= 0) return forced_path;
    q3_moe_choice *ch = &run->st->moe_choice[q3_moe_size_class(p->n_seqs * p->L)];
    if (!ch->chosen) measure(l, p, run, ch);
    return ch->chosen ? ch->chosen - 1 : Q3_MOE_PER_EXPERT_WMMA;
}
