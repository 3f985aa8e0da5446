/* The forward of a layer on a CUDA device: the engine's one pass loop (q3_layer_run_passes,
 * csrc/engine/pass_loop.c) over the stages of passes.c, on the caller's stream. The host keeps
 * the bookkeeping: cache lengths (advanced and rolled back by the loop), the hidden flags of
 * a call's token mask (marked here, trimmed by the loop's roll-back), staging for positions
 * and the sequences' cache rows. A decode pass uploads the lengths and cache rows of its
 * sequences and lets the device take it from there (as a captured graph does,
 * decode_graph.c). While profiling is on, an event is recorded at each stage boundary and the
 * stream is synchronised after each pass to read them. */
#include "passes.h"

/* the limits of the attention kernels (kernels/cuda/ops_cuda.h): head_dim for their tiles,
 * the query heads of a KV head for the warps of a block; the CPU takes any config */
q3_status q3_layer_cuda_config_check(const q3_config *cfg, q3_error *err) {
    if (cfg->head_dim > Q3_CUDA_MAX_HEAD_DIM)
        return q3_fail(err, Q3_ERR_VALUE, "head_dim: expected at most %d on a CUDA device, got %d",
                       Q3_CUDA_MAX_HEAD_DIM, cfg->head_dim);
    const int G = cfg->heads / cfg->kv_heads;
    if (G > Q3_CUDA_MAX_GROUP)
        return q3_fail(err, Q3_ERR_VALUE,
                       "num_attention_heads / num_key_value_heads: expected at most %d on a CUDA device, got %d",
                       Q3_CUDA_MAX_GROUP, G);
    return Q3_OK;
}

q3_status q3_layer_forward_cuda(q3_layer *l, q3_cache *c, const q3_forward_args *a, q3_error *err) {
    return q3_layer_cuda_passes(l, c, a, NULL, NULL, err);
}

/* ---- a CUDA device's stages of the engine's pass loop (q3_layer_run_passes), on the run's
 * stream; the first failing call stays in the run (Q3_GPU) and stops the loop */

/* whether the pass's rows are the call's, in order: one copy for every sequence */
static int whole(const q3_pass *p) { return p->L == p->call->tokens; }

static void gpu_input(q3_layer *l, const q3_pass *p, void *r) {
    q3_gpu_run *run = r;
    const int64_t H = l->cfg.hidden, L = p->L;
    const size_t es = q3_dtype_size(p->call->io_dtype);
    q3_gpu_mark(run, -1);
    for (int i = 0; i < (whole(p) ? 1 : p->n_seqs); i++)
        Q3_GPU(run, run->g->to_f32(run->ws->dev.x + i * L * H,
                                   (const char *)p->call->x + ((size_t)i * p->call->tokens + p->t0) * H * es,
                                   p->call->io_dtype, (whole(p) ? p->n_seqs : 1) * L * H, run->stream), "input");
    q3_gpu_mark(run, Q3_STAGE_IO);
}

/* the hidden flags of the pass's tokens into the cache (its host array) before attention
 * reads them, as the CPU's attention block marks them; the keys any query of the pass sees
 * at most; a decode pass not staged on the host starts from the device (its lengths and
 * cache rows uploaded) */
static void gpu_attention(q3_layer *l, q3_cache *c, const q3_pass *p, void *r) {
    q3_gpu_run *run = r;
    int64_t max_keys = 0;
    for (int i = 0; i < p->n_seqs; i++) {
        q3_cache_mark_rows(c, p->seqs[i], p->L, q3_pass_token_mask(p, i));
        max_keys = c->lengths[p->seqs[i]] + p->L > max_keys ? c->lengths[p->seqs[i]] + p->L : max_keys;
    }
    if (!q3_gpu_stages_on_host(c, p))
        Q3_GPU(run, q3_gpu_upload_decode_state(run->g, run->ws, c, p->seqs, p->n_seqs, run->st->lengths,
                                               run->st->seq_ptr, run->stream), "uploading lengths");
    q3_gpu_attention_pass(l, c, p, max_keys, run);
}

static void gpu_route(q3_layer *l, const q3_pass *p, void *r) { q3_gpu_route_pass(l, p, r); }

static void gpu_half_write(q3_layer *l, const q3_pass *p, const q3_attention_half_out *half, void *r) {
    q3_gpu_attention_half_write(l, p, half, r);
}

static void gpu_experts(q3_layer *l, const q3_pass *p, void *r) { q3_gpu_experts_pass(l, p, r); }

static void gpu_output(q3_layer *l, const q3_pass *p, void *r) {
    q3_gpu_run *run = r;
    const int64_t H = l->cfg.hidden, L = p->L;
    const size_t es = q3_dtype_size(p->call->io_dtype);
    for (int i = 0; i < (whole(p) ? 1 : p->n_seqs); i++)
        Q3_GPU(run, run->g->from_f32((char *)p->call->y + ((size_t)i * p->call->tokens + p->t0) * H * es,
                                     p->call->io_dtype, run->ws->dev.x + i * L * H, (whole(p) ? p->n_seqs : 1) * L * H,
                                     run->stream), "output");
}

static void gpu_end(q3_layer *l, const q3_pass *p, void *r) {
    (void)l;
    (void)p;
    q3_gpu_mark(r, Q3_STAGE_IO);
    q3_gpu_collect(r);
}

static int gpu_failed(const void *r) { return ((const q3_gpu_run *)r)->code != 0; }

static q3_status gpu_failure(const void *r, q3_error *err) {
    const q3_gpu_run *run = r;
    return q3_fail(err, Q3_ERR_STATE, "cuda: %s failed: %s", run->what, run->g->error_string(run->code));
}

static const q3_pass_stages gpu_stages = {gpu_input, gpu_attention, gpu_route, gpu_half_write, gpu_experts,
                                          gpu_output, gpu_end, gpu_failed, gpu_failure};

q3_status q3_layer_cuda_passes(q3_layer *l, q3_cache *c, const q3_forward_args *a, const q3_attention_half_out *half,
                               q3_pass_cursor *cur, q3_error *err) {
    const int64_t step = q3_call_step(a);
    q3_status s = q3_layer_cuda_reserve(l, step * a->n_seqs, a->n_seqs, err);
    if (s != Q3_OK) return s;
    q3_gpu_run run = {q3_cuda(), a->stream, 0, NULL, l->prof.enabled ? &l->prof : NULL, l->gpu, &l->gpu->ws};
    Q3_GPU(&run, run.g->set_device(l->w.device), "cudaSetDevice");
    return q3_layer_run_passes(l, c, a, half, cur, &gpu_stages, &run, err);
}
