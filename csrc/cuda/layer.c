/* The forward driver of a layer on a CUDA device: the tokens through the passes of
 * passes.c chunk by chunk, on the caller's stream. The host keeps the
 * bookkeeping: cache lengths (advanced here), staging for positions and the sequences' cache
 * rows. A decode call uploads the lengths and cache rows of its sequences and lets the device
 * take it from there (as a captured graph does, decode_graph.c). A call that fails
 * restores the cache lengths it started from. While profiling is on, an event is recorded at
 * each stage boundary and the stream is synchronised after each pass to read them. */
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
    return q3_layer_cuda_passes(l, c, a, NULL, err);
}

q3_status q3_layer_cuda_passes(q3_layer *l, q3_cache *c, const q3_forward_args *a, const q3_attention_half_out *half,
                               q3_error *err) {
    const int64_t chunk = a->chunk > 0 ? a->chunk : Q3_DEFAULT_CHUNK;
    const int64_t step = chunk < a->tokens ? chunk : a->tokens;
    q3_status s = q3_layer_cuda_reserve(l, step * a->n_seqs, a->n_seqs, err);
    if (s != Q3_OK) return s;
    q3_gpu_run run = {q3_cuda(), a->stream, 0, NULL, l->prof.enabled ? &l->prof : NULL, l->gpu, &l->gpu->ws};
    int64_t advanced = 0; /* tokens added to each sequence's length so far */
    Q3_GPU(&run, run.g->set_device(l->w.device), "cudaSetDevice");
    const int64_t H = l->cfg.hidden;
    const size_t es = q3_dtype_size(a->io_dtype);
    q3_workspace *d = &run.ws->dev;
    for (int64_t t0 = 0; t0 < a->tokens && !run.code; t0 += step) {
        const int64_t L = a->tokens - t0 < step ? a->tokens - t0 : step;
        const int whole = L == a->tokens; /* the rows of x are this pass's rows, in order */
        if (t0 > 0 && a->interrupted && a->interrupted(a->interrupt_ctx)) {
            /* the queued passes finish on their own; their K/V lie past the rolled-back lengths */
            for (int i = 0; i < a->n_seqs; i++) c->lengths[a->seqs[i]] -= advanced;
            return q3_layer_interrupted(err, t0, a->tokens);
        }
        q3_gpu_mark(&run, -1);
        for (int i = 0; i < (whole ? 1 : a->n_seqs); i++)
            Q3_GPU(&run, run.g->to_f32(d->x + i * L * H, (const char *)a->x + ((size_t)i * a->tokens + t0) * H * es,
                                       a->io_dtype, (whole ? a->n_seqs : 1) * L * H, run.stream), "input");
        q3_gpu_mark(&run, Q3_STAGE_IO);
        const q3_pass p = {NULL, NULL, a->n_seqs, a->seqs, L, a, t0};
        int64_t max_keys = 0;
        for (int i = 0; i < a->n_seqs; i++)
            max_keys = c->lengths[a->seqs[i]] + L > max_keys ? c->lengths[a->seqs[i]] + L : max_keys;
        if (q3_gpu_is_decode(&p)) /* a decode pass starts from the device */
            Q3_GPU(&run, q3_gpu_upload_decode_state(run.g, run.ws, c, a->seqs, a->n_seqs, l->gpu->lengths,
                                                    l->gpu->seq_ptr, run.stream), "uploading lengths");
        q3_gpu_attention_pass(l, c, &p, max_keys, &run);
        q3_gpu_route_pass(l, &p, &run);
        if (half) {
            q3_gpu_attention_half_write(l, &p, half, &run);
        } else {
            q3_gpu_experts_pass(l, &p, &run);
            for (int i = 0; i < (whole ? 1 : a->n_seqs); i++)
                Q3_GPU(&run, run.g->from_f32((char *)a->y + ((size_t)i * a->tokens + t0) * H * es, a->io_dtype,
                                             d->x + i * L * H, (whole ? a->n_seqs : 1) * L * H, run.stream), "output");
        }
        for (int i = 0; i < a->n_seqs; i++) c->lengths[a->seqs[i]] += L;
        advanced += L;
        q3_gpu_mark(&run, Q3_STAGE_IO);
        q3_gpu_collect(&run);
    }
    if (!run.code) return Q3_OK;
    for (int i = 0; i < a->n_seqs; i++) c->lengths[a->seqs[i]] -= advanced;
    return q3_fail(err, Q3_ERR_STATE, "cuda: %s failed: %s", run.what, run.g->error_string(run.code));
}
