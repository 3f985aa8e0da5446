/* Decode graphs (q3_cuda.h): one decode pass of passes.c captured in a CUDA graph.
 *
 * Everything the pass needs that changes from token to token lives on the device: the
 * sequences' lengths (decode_prepare advances them), the router's groups (moe_route). What
 * the host still knows (each replay adds one token per sequence) it tracks itself, so a
 * replay never waits for the device. The graph owns its workspace, input and output, so the
 * pointers baked into it stay valid whatever the layer's other calls allocate. A cache
 * holding hidden tokens (a token mask's) is refused, at capture and at each replay. */
#include <stdlib.h>
#include <string.h>

#include "passes.h"

struct q3_decode_graph {
    q3_layer *layer;
    q3_cache *cache;
    int64_t capacity; /* the cache's when captured: its blocks' strides and addresses are in the graph */
    int n_seqs;
    q3_dtype io_dtype;
    int32_t seqs[Q3_GRAPH_MAX_BATCH];
    q3_gpu_ws ws;
    void *input;  /* [n_seqs, hidden] io_dtype */
    void *output; /* [n_seqs, hidden] io_dtype */
    void *exec;   /* the instantiated graph */
    /* what the device holds: lengths as last uploaded or advanced (-1: stale), and the rows
     * (cache blocks, padding) as last uploaded */
    int64_t dev_lengths[Q3_GRAPH_MAX_BATCH];
    q3_attn_seq staged[Q3_GRAPH_MAX_BATCH];
};

void *q3_decode_graph_input(const q3_decode_graph *g) { return g->input; }
void *q3_decode_graph_output(const q3_decode_graph *g) { return g->output; }

int q3_decode_graph_io(const q3_decode_graph *g, q3_tensor_spec *spec) {
    *spec = (q3_tensor_spec){g->io_dtype, 2, {g->n_seqs, g->layer->cfg.hidden}};
    return g->layer->w.device;
}

q3_status q3_decode_graph_load(q3_decode_graph *g, const q3_view *x, void *stream, q3_error *err) {
    const int64_t H = g->layer->cfg.hidden;
    if (x->ndim != 2 || x->shape[0] != g->n_seqs || x->shape[1] != H) {
        char got[128];
        q3_format_shape(got, sizeof got, x->ndim, x->shape);
        return q3_fail(err, Q3_ERR_VALUE, "x: expected shape [batch=%d, hidden=%lld], got %s", g->n_seqs,
                       (long long)H, got);
    }
    if (x->dtype != g->io_dtype)
        return q3_fail(err, Q3_ERR_TYPE, "x: expected dtype %s (the graph's), got %s", q3_dtype_name(g->io_dtype),
                       q3_dtype_name(x->dtype));
    q3_status s = q3_view_require(x, "x", Q3_NEED_CONTIGUOUS, err);
    if (s != Q3_OK || x->data == g->input) return s;
    q3_error copy;
    const size_t bytes = (size_t)g->n_seqs * (size_t)H * q3_dtype_size(g->io_dtype); /* the input's, allocated */
    s = q3_device_copy_async(g->input, x->data, bytes, stream, &copy);
    return s == Q3_OK ? s : q3_fail(err, Q3_ERR_STATE, "x: copy to the graph's input failed: %s", copy.msg);
}

void q3_decode_graph_destroy(q3_decode_graph *g) {
    if (!g) return;
    const q3_cuda_ops *cu = q3_cuda();
    if (cu) {
        if (g->exec) cu->graph_destroy(g->exec);
        if (g->input) cu->free_device(g->input);
        if (g->output) cu->free_device(g->output);
    }
    q3_gpu_ws_free(&g->ws);
    free(g);
}

/* re-uploads the sequences' lengths and padding if the host's differ from the device's
 * (a prefill or reset in between); queued on the stream, before the replay that needs them */
static int sync_state(q3_decode_graph *g, void *stream) {
    const q3_cache *c = g->cache;
    int stale = 0;
    for (int s = 0; s < g->n_seqs; s++)
        stale |= c->lengths[g->seqs[s]] != g->dev_lengths[s] || c->padding[g->seqs[s]] != g->staged[s].start ||
                 c->first_pos[g->seqs[s]] != g->staged[s].first_pos;
    if (!stale) return 0;
    const int code = q3_gpu_upload_decode_state(q3_cuda(), &g->ws, c, g->seqs, g->n_seqs, g->dev_lengths, g->staged,
                                                stream);
    if (code) g->dev_lengths[0] = -1; /* stale: upload again next time */
    return code;
}

/* Q3_ERR_VALUE naming the first of sequences seqs [n] of c that holds hidden tokens (a call's
 * token_mask hid them): a graph's steps take their positions and cache rows on the device,
 * without the flags (passes.c stages those on the host), so it neither captures nor replays
 * over them. `to`: "capture", "replay" */
static q3_status refuse_hidden(const q3_cache *c, const int32_t *seqs, int n, const char *to, q3_error *err) {
    for (int s = 0; s < n; s++)
        if (q3_cache_attn_seq(c, seqs[s], 1).hidden)
            return q3_fail(err, Q3_ERR_VALUE, "cache: expected no hidden tokens to %s a decode graph over, got "
                           "sequence %d holding some (a call's token_mask hid them; a graph does not read them): "
                           "decode it with plain calls", to, seqs[s]);
    return Q3_OK;
}

/* the decode pass, queued on the capturing stream: input -> x, both stages, x -> output */
static void enqueue_step(q3_decode_graph *g, q3_dtype io_dtype, q3_gpu_run *run) {
    q3_layer *l = g->layer;
    const int64_t rows = (int64_t)g->n_seqs * l->cfg.hidden;
    const q3_pass p = {NULL, NULL, g->n_seqs, g->seqs, 1, NULL, 0, 0};
    Q3_GPU(run, run->g->to_f32(g->ws.dev.x, g->input, io_dtype, rows, run->stream), "input");
    q3_gpu_attention_pass(l, g->cache, &p, g->cache->capacity, run);
    q3_gpu_moe_pass(l, &p, run);
    Q3_GPU(run, run->g->from_f32(g->output, io_dtype, g->ws.dev.x, rows, run->stream), "output");
}

static q3_status capture(q3_decode_graph *g, q3_dtype io_dtype, q3_error *err) {
    const q3_cuda_ops *cu = q3_cuda();
    void *stream = NULL;
    q3_gpu_run run = {cu, NULL, 0, NULL, NULL, NULL, &g->ws};
    Q3_GPU(&run, cu->stream_create(&stream), "cudaStreamCreate");
    run.stream = stream;
    Q3_GPU(&run, cu->capture_begin(stream), "cudaStreamBeginCapture");
    if (!run.code) {
        enqueue_step(g, io_dtype, &run);
        /* end the capture even after a failed launch, or the stream stays capturing */
        const int end = cu->capture_end(stream, &g->exec);
        if (!run.code && end) {
            run.code = end;
            run.what = "cudaStreamEndCapture";
        }
    }
    if (stream) cu->stream_destroy(stream);
    if (!run.code) return Q3_OK;
    return q3_fail(err, Q3_ERR_STATE, "decode graph: %s failed while capturing: %s", run.what,
                   cu->error_string(run.code));
}

q3_status q3_decode_graph_create(q3_decode_graph **out, q3_layer *l, q3_cache *c, int64_t batch, q3_dtype io_dtype,
                                 q3_error *err) {
    *out = NULL;
    const int most = c->batch < Q3_GRAPH_MAX_BATCH ? c->batch : Q3_GRAPH_MAX_BATCH;
    if (batch < 1 || batch > most)
        return q3_fail(err, Q3_ERR_VALUE, "batch: expected 1 to %d (the cache's batch, at most %d), got %lld", most,
                       Q3_GRAPH_MAX_BATCH, (long long)batch);
    if (l->w.device < 0)
        return q3_fail(err, Q3_ERR_VALUE, "decode_graph: expected a layer on a CUDA device, got a cpu layer");
    const int n_seqs = (int)batch;
    int32_t seqs[Q3_GRAPH_MAX_BATCH];
    for (int i = 0; i < n_seqs; i++) seqs[i] = i;
    const q3_forward_args probe = {.io_dtype = io_dtype, .n_seqs = n_seqs, .seqs = seqs, .tokens = 1, .chunk = 1};
    q3_status s = q3_layer_check_call(l, c, &probe, err);
    if (s == Q3_OK) s = refuse_hidden(c, seqs, n_seqs, "capture", err);
    if (s != Q3_OK) return s;
    const q3_cuda_ops *cu = q3_cuda();
    q3_decode_graph *g = calloc(1, sizeof *g);
    if (!g) return q3_fail(err, Q3_ERR_NOMEM, "decode graph: out of host memory");
    g->layer = l;
    g->cache = c;
    g->capacity = c->capacity;
    g->n_seqs = n_seqs;
    g->io_dtype = io_dtype;
    memcpy(g->seqs, seqs, (size_t)n_seqs * sizeof *seqs);
    g->dev_lengths[0] = -1; /* nothing uploaded yet */
    const size_t io_bytes = (size_t)n_seqs * (size_t)l->cfg.hidden * q3_dtype_size(io_dtype);
    s = q3_gpu_ws_alloc(&g->ws, l, n_seqs, n_seqs, q3_gpu_split_rows(n_seqs, n_seqs), err);
    if (s == Q3_OK && (cu->malloc_device(&g->input, io_bytes) || cu->malloc_device(&g->output, io_bytes)))
        s = q3_fail(err, Q3_ERR_NOMEM, "decode graph: cannot allocate 2 x %zu bytes on cuda:%d", io_bytes,
                    l->w.device);
    if (s == Q3_OK && (cu->memset_async(g->input, 0, io_bytes, NULL) || cu->synchronize()))
        s = q3_fail(err, Q3_ERR_STATE, "decode graph: cannot clear its input");
    if (s == Q3_OK) s = capture(g, io_dtype, err);
    if (s != Q3_OK) {
        q3_decode_graph_destroy(g);
        return s;
    }
    *out = g;
    return Q3_OK;
}

q3_status q3_decode_graph_replay(q3_decode_graph *g, void *stream, q3_error *err) {
    q3_cache *c = g->cache;
    const q3_cuda_ops *cu = q3_cuda();
    if (c->capacity != g->capacity) /* grown: the graph would read and write the freed blocks */
        return q3_fail(err, Q3_ERR_STATE,
                       "decode graph: the cache grew from %lld to %lld tokens a sequence after the capture (the graph "
                       "holds the old blocks' addresses); capture a new graph", (long long)g->capacity,
                       (long long)c->capacity);
    const q3_status hidden = refuse_hidden(c, g->seqs, g->n_seqs, "replay", err);
    if (hidden != Q3_OK) return hidden;
    for (int s = 0; s < g->n_seqs; s++) {
        const int seq = g->seqs[s];
        if (c->lengths[seq] + 1 > c->capacity)
            return q3_fail(err, Q3_ERR_CACHE_FULL, "sequence %d holds %lld of %lld tokens: 1 more does not fit", seq,
                           (long long)c->lengths[seq], (long long)c->capacity);
    }
    int code = cu->set_device(g->layer->w.device);
    const char *what = code ? "cudaSetDevice" : NULL;
    if (!code && (code = sync_state(g, stream)) != 0) what = "uploading the sequences' lengths";
    if (!code && (code = cu->graph_launch(g->exec, stream)) != 0) what = "cudaGraphLaunch";
    if (code) return q3_fail(err, Q3_ERR_STATE, "decode graph: %s failed: %s", what, cu->error_string(code));
    for (int s = 0; s < g->n_seqs; s++) {
        c->lengths[g->seqs[s]] += 1;
        g->dev_lengths[s] += 1; /* decode_prepare did the same on the device */
    }
    return Q3_OK;
}
