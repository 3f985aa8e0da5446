/* The layer's two halves on a CUDA device (q3.h's q3_layer_attention_half and
 * q3_layer_expert_half, reached through the device backend after the engine's checks). The
 * attention half is layer.c's passes stopped after the router: each pass's rows copied from
 * the device workspace into the call's outputs. The expert half is the experts stage of
 * passes.c on rows handed in. Every tensor is in the layer's device's memory, row-major:
 * rows [n, H], experts [n, top_k] int32, weights [n, top_k] fp32, out [n, H]; the attention
 * half's outputs have rows r = s * tokens + t as x (a pass's alone, q3_layer_attention_pass:
 * r = s * L + t). */
#include "passes.h"

void q3_gpu_attention_half_write(const q3_layer *l, const q3_pass *p, const q3_attention_half_out *half,
                                 q3_gpu_run *run) {
    const q3_workspace *d = &run->ws->dev;
    const int64_t H = l->cfg.hidden, k = l->cfg.top_k, L = p->L;
    const size_t es = q3_dtype_size(half->normed_dtype);
    /* the pass's rows lie in the outputs as in the workspace, in order: one copy each */
    const int whole = L == p->call->tokens || p->half_of_pass;
    for (int s = 0; s < (whole ? 1 : p->n_seqs) && !run->code; s++) {
        const int64_t src = s * L, dst = q3_half_row(p, s), n = (whole ? p->n_seqs : 1) * L;
        Q3_GPU(run, run->g->copy_device_async(half->resid + dst * H, d->x + src * H, (size_t)(n * H) * sizeof(float),
                                              run->stream), "resid");
        Q3_GPU(run, run->g->from_f32((char *)half->normed + (size_t)(dst * H) * es, half->normed_dtype, d->h + src * H,
                                     n * H, run->stream), "normed");
        Q3_GPU(run, run->g->copy_device_async(half->experts + dst * k, d->topk_idx + src * k,
                                              (size_t)(n * k) * sizeof(int32_t), run->stream), "experts");
        Q3_GPU(run, run->g->copy_device_async(half->weights + dst * k, d->topk_w + src * k,
                                              (size_t)(n * k) * sizeof(float), run->stream), "weights");
    }
}

q3_status q3_layer_attention_half_cuda(q3_layer *l, q3_cache *c, const q3_forward_args *a,
                                       const q3_attention_half_out *out, q3_pass_cursor *cur, q3_error *err) {
    return q3_layer_cuda_passes(l, c, a, out, cur, err);
}

/* The rows go through the experts in one pass (each expert's weights read once). Up to a
 * decode pass's rows with every entry held, grouped on the device as a decode pass groups
 * them; otherwise on the host from the ids already brought there for their check, a skipped
 * entry grouped past the experts (passes.c), on the prefill path its size takes. The sum
 * accumulates in the workspace's x, seeded with out (accumulate) or zeros, as the forward
 * adds into its residual. */
q3_status q3_layer_expert_half_cuda(q3_layer *l, const q3_expert_half_args *a, q3_error *err) {
    const q3_config *cf = &l->cfg;
    const int64_t n = a->n, H = cf->hidden;
    const int E = cf->experts, k = cf->top_k;
    q3_status s = q3_layer_cuda_reserve(l, n, 1, err);
    if (s != Q3_OK) return s;
    q3_cuda_state *st = l->gpu;
    void *sm = a->stream;
    q3_gpu_run run = {q3_cuda(), sm, 0, NULL, l->prof.enabled ? &l->prof : NULL, st, &st->ws};
    const q3_cuda_ops *g = run.g;
    q3_workspace *d = &st->ws.dev;
    /* fit: the engine bounds n * k by INT32_MAX, the workspace holds n rows of H */
    const size_t pairs = (size_t)(n * k), bytes = (size_t)(n * H) * sizeof(float);
    Q3_GPU(&run, g->set_device(l->w.device), "cudaSetDevice");
    Q3_GPU(&run, g->copy_async(st->topk_idx, a->experts, pairs * sizeof(int32_t), 0, sm), "copy experts");
    Q3_GPU(&run, g->copy_async(st->topk_w, a->weights, pairs * sizeof(float), 0, sm), "copy weights");
    Q3_GPU(&run, g->stream_synchronize(sm), "synchronize");
    if (run.code) return q3_fail(err, Q3_ERR_STATE, "cuda: %s failed: %s", run.what, g->error_string(run.code));
    int skip;
    s = q3_layer_check_expert_ids(l, st->topk_idx, n, &skip, err);
    if (s != Q3_OK) return s;
    const int on_device = n <= Q3_DECODE_MAX_ROWS && !skip;
    for (size_t i = 0; i < pairs; i++)
        if (st->topk_idx[i] < 0) st->topk_idx[i] = E;
    q3_gpu_mark(&run, -1); /* profiling: the call's stages from here (a refused call records none) */
    Q3_GPU(&run, g->to_f32(d->h, a->rows, a->dtype, n * H, sm), "rows");
    if (a->acc) Q3_GPU(&run, g->to_f32(d->x, a->out, a->out_dtype, n * H, sm), "out (accumulate)");
    else Q3_GPU(&run, g->memset_async(d->x, 0, bytes, sm), "out (zeros)");
    if (on_device) {
        Q3_GPU(&run, g->copy_device_async(d->topk_idx, a->experts, pairs * sizeof(int32_t), sm), "experts");
        Q3_GPU(&run, g->copy_device_async(d->topk_w, a->weights, pairs * sizeof(float), sm), "weights");
    }
    q3_gpu_mark(&run, Q3_STAGE_IO);
    const q3_pass p = {NULL, NULL, 1, NULL, n, NULL, 0, 0};
    q3_gpu_experts_rows(l, &p, &run, on_device);
    Q3_GPU(&run, g->from_f32(a->out, a->out_dtype, d->x, n * H, sm), "out");
    q3_gpu_mark(&run, Q3_STAGE_IO);
    q3_gpu_collect(&run);
    if (run.code) return q3_fail(err, Q3_ERR_STATE, "cuda: %s failed: %s", run.what, g->error_string(run.code));
    return Q3_OK;
}
