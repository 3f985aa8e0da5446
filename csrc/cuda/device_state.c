/* A CUDA layer's device state (device_state.h): the device workspace, carved in one
 * allocation as the host workspace is; the host staging beside it, grown with it (never
 * shrunk) and released with the layer; and the events a profiled run records at each stage
 * boundary, read after each pass. */
#include <stdlib.h>
#include <string.h>

#include "device_state.h"

q3_status q3_gpu_ws_alloc(q3_gpu_ws *ws, const q3_layer *l, int64_t rows, int seqs, int64_t split_rows,
                          q3_error *err) {
    const q3_cuda_ops *g = q3_cuda();
    const q3_config *cf = &l->cfg;
    const int64_t E = cf->experts, k = cf->top_k, Rd = rows < Q3_DECODE_MAX_ROWS ? rows : Q3_DECODE_MAX_ROWS;
    const int fp8 = l->w.format == Q3_WF_FP8_BLOCK128, gptq = l->w.format == Q3_WF_GPTQ_INT4;
    /* the expert tables: the weights (a GPTQ layer's qweight), then (FP8) their scales, as
     * layer.c's expert_ptrs; and a GPTQ layer's experts as l->int4's [Q3_X_COUNT][E] structs */
    const int64_t tables = (fp8 ? 2 : 1) * Q3_X_COUNT * E, int4_tables = gptq ? Q3_X_COUNT * E : 0;
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
        if (gptq) CARVE(int4_experts, q3_int4_matrix, int4_tables);
        CARVE(moe_plan, int32_t, q3_moe_plan_ints(rows, (int)k, (int)E));
        if ((fp8 || gptq) && rows >= 16) CARVE(wbf16, uint16_t, q3_gpu_quantized_largest_matrix(l));
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
    /* the expert kernels of a decode pass look their weights up on the device: the structs
     * hold device pointers already (the layer's tensors are there), an expert not held zeros */
    if (g->copy(ws->experts, l->expert_ptrs, (size_t)tables * sizeof(void *), 1) ||
        (gptq && g->copy(ws->int4_experts, l->int4 + Q3_W_DENSE_COUNT, (size_t)int4_tables * sizeof(q3_int4_matrix),
                         1))) {
        q3_gpu_ws_free(ws);
        return q3_fail(err, Q3_ERR_STATE, "cuda workspace: cannot upload the expert tables");
    }
    return Q3_OK;
}

void q3_gpu_ws_free(q3_gpu_ws *ws) {
    if (ws->dev.block && q3_cuda()) q3_cuda()->free_device(ws->dev.block);
    *ws = (q3_gpu_ws){0};
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

void q3_gpu_collect(q3_gpu_run *run) {
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

size_t q3_layer_cuda_workspace_bytes(const q3_layer *l) { return l->gpu ? l->gpu->ws.dev.bytes : 0; }

int q3_gpu_staging_reserve(const q3_cuda_ops *g, uint8_t **buf, size_t *have, size_t bytes, void *stream) {
    if (bytes <= *have) return 0;
    if (*buf) { /* a queued pass may still read the old bytes */
        const int code = g->stream_synchronize(stream);
        if (code) return code;
        g->free_device(*buf);
        *buf = NULL;
        *have = 0;
    }
    const int code = g->malloc_device((void **)buf, bytes);
    if (!code) *have = bytes;
    return code;
}

void q3_layer_cuda_release(q3_layer *l) {
    q3_cuda_state *s = l->gpu;
    if (!s) return;
    q3_gpu_ws_free(&s->ws);
    for (size_t i = 0; i < sizeof s->events / sizeof s->events[0]; i++)
        if (s->events[i] && q3_cuda()) q3_cuda()->event_destroy(s->events[i]);
    for (size_t i = 0; i < sizeof s->moe_events / sizeof s->moe_events[0]; i++)
        if (s->moe_events[i] && q3_cuda()) q3_cuda()->event_destroy(s->moe_events[i]);
    if (s->blas_ptrs_dev && q3_cuda()) q3_cuda()->free_device(s->blas_ptrs_dev);
    if (s->hidden && q3_cuda()) q3_cuda()->free_device(s->hidden);
    if (s->tree && q3_cuda()) q3_cuda()->free_device(s->tree);
    free(s->blas_ptrs);
    free(s->blas_rows);
    free(s->pos);
    free(s->seq_ptr);
    free(s->lengths);
    free(s->topk_idx);
    free(s->topk_w);
    free(s->offsets);
    free(s->pair_row);
    free(s->pair_w);
    free(s->moe_plan);
    free(s->batches);
    free(s->token_index);
    free(s->token_fill);
    free(s);
    l->gpu = NULL;
}

/* Device workspace and host staging for passes of `rows` rows and `seqs` sequences, grown
 * only: to the larger of what is held and what is asked in each of rows, sequences and
 * split-KV rows (q3_gpu_split_rows), as the CPU workspace grows (q3_workspace_reserve).
 * Sized to each call instead, alternating a one-sequence prefill (many rows, one sequence)
 * with a batched decode (few rows, many sequences) reallocated on every switch, and cudaFree
 * waits for the whole device; now only the first call of each shape may allocate. */
q3_status q3_layer_cuda_reserve(q3_layer *l, int64_t rows, int seqs, q3_error *err) {
    if (!q3_cuda()) return q3_fail(err, Q3_ERR_STATE, "cuda: the CUDA backend is not loaded");
    int64_t split = q3_gpu_split_rows(rows, seqs);
    /* the prefill MoE paths measured so far outlive the growth (moe_prefill.c): measuring
     * again would time every path and allocate its scratch once more per size class */
    q3_moe_choice kept[Q3_MOE_SIZE_CLASSES];
    q3_moe_hooks hooks = {0};
    memset(kept, 0, sizeof kept);
    if (l->gpu) {
        const q3_gpu_ws *held = &l->gpu->ws;
        if (rows <= held->dev.rows && seqs <= held->dev.seqs && split <= held->split_rows) return Q3_OK;
        if (rows < held->dev.rows) rows = held->dev.rows;
        if (seqs < held->dev.seqs) seqs = held->dev.seqs;
        if (split < held->split_rows) split = held->split_rows;
        memcpy(kept, l->gpu->moe_choice, sizeof kept);
        hooks = l->gpu->moe_hooks;
    }
    q3_layer_cuda_release(l);
    q3_cuda_state *s = calloc(1, sizeof *s);
    if (!s) return q3_fail(err, Q3_ERR_NOMEM, "cuda layer: out of host memory");
    l->gpu = s;
    memcpy(s->moe_choice, kept, sizeof kept);
    s->moe_hooks = hooks;
    const q3_status status = q3_gpu_ws_alloc(&s->ws, l, rows, seqs, split, err);
    if (status != Q3_OK) {
        q3_layer_cuda_release(l);
        return status;
    }
    const int k = l->cfg.top_k;
    s->pos = malloc((size_t)rows * sizeof *s->pos);
    s->seq_ptr = malloc((size_t)seqs * sizeof *s->seq_ptr);
    s->lengths = malloc((size_t)seqs * sizeof *s->lengths);
    s->topk_idx = malloc((size_t)(rows * k) * sizeof *s->topk_idx);
    s->topk_w = malloc((size_t)(rows * k) * sizeof *s->topk_w);
    s->offsets = malloc((size_t)(l->cfg.experts + 2) * sizeof *s->offsets);
    s->pair_row = malloc((size_t)(rows * k) * sizeof *s->pair_row);
    s->pair_w = malloc((size_t)(rows * k) * sizeof *s->pair_w);
    s->moe_plan = malloc((size_t)q3_moe_plan_ints(rows, k, l->cfg.experts) * sizeof *s->moe_plan);
    s->batches = malloc((size_t)l->cfg.experts * sizeof *s->batches);
    s->token_index = calloc((size_t)rows, sizeof *s->token_index);
    s->token_fill = malloc((size_t)rows * sizeof *s->token_fill);
    if (!s->pos || !s->seq_ptr || !s->lengths || !s->topk_idx || !s->topk_w || !s->offsets || !s->pair_row ||
        !s->pair_w || !s->moe_plan || !s->batches || !s->token_index || !s->token_fill) {
        q3_layer_cuda_release(l);
        return q3_fail(err, Q3_ERR_NOMEM, "cuda layer: out of host memory");
    }
    return Q3_OK;
}

