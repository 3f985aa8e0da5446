/* The views a layer is handed, checked before anything is made or written: a call's (x and
 * out= of prefill and decode, the sizes of the insides asked for, the expert half's rows;
 * q3_call_prepare: a call's arguments from its views, then q3_layer_check_call's checks of the
 * call itself), and at creation how each weight is taken
 * (borrowed, uploaded or converted). Each error names the argument, what was expected and what
 * came. */
#include <stdio.h>

#include "q3.h"

static q3_status shape_error(const char *arg, const char *want, const q3_view *v, q3_error *err) {
    char got[128];
    q3_format_shape(got, sizeof got, v->ndim, v->shape);
    return q3_fail(err, Q3_ERR_VALUE, "%s: expected shape %s, got %s", arg, want, got);
}

q3_status q3_call_check_x(const q3_config *cfg, const q3_cache *c, const q3_view *x, int decode, int *n_seqs,
                          int64_t *tokens, q3_error *err) {
    char want[128];
    const int batch = q3_cache_batch(c);
    const long long H = (long long)cfg->hidden;
    q3_status s = q3_view_require(x, "x", Q3_NEED_CONTIGUOUS, err);
    if (s != Q3_OK) return s;
    if (decode) {
        snprintf(want, sizeof want, "[batch=%d, hidden=%lld]", batch, H);
        if (x->ndim != 2 || x->shape[0] != batch || x->shape[1] != H) return shape_error("x", want, x, err);
        *n_seqs = batch;
        *tokens = 1;
        return Q3_OK;
    }
    if (x->ndim == 2) {
        snprintf(want, sizeof want, "[tokens, hidden=%lld]", H);
        *n_seqs = 1;
    } else {
        snprintf(want, sizeof want, "[batch=%d, tokens, hidden=%lld] or [tokens, hidden=%lld]", batch, H, H);
        if (x->ndim != 3 || x->shape[0] != batch) return shape_error("x", want, x, err);
        *n_seqs = batch;
    }
    if (x->shape[x->ndim - 1] != H) return shape_error("x", want, x, err);
    *tokens = x->shape[x->ndim - 2]; /* 0: refused by q3_layer_check_call */
    return Q3_OK;
}

q3_status q3_call_prepare(const q3_layer *layer, const q3_cache *c, const q3_view *x, int decode, const int *seq,
                          const q3_view *const token[3], int half, int32_t *seqs, int cap, q3_forward_args *a,
                          q3_error *err) {
    q3_status s = q3_call_check_x(q3_layer_config(layer), c, x, decode, &a->n_seqs, &a->tokens, err);
    if (s != Q3_OK) return s;
    a->x = x->data;
    a->io_dtype = x->dtype;
    a->seqs = seqs;
    if (!decode && x->ndim == 2) {
        seqs[0] = seq ? *seq : 0; /* its range: q3_layer_check_call's */
    } else if (seq) {
        return q3_fail(err, Q3_ERR_VALUE, "seq: expected None when x is [batch, tokens, hidden] (x covers every "
                       "sequence)");
    } else {
        int32_t *list = a->n_seqs > cap ? q3_alloc((size_t)a->n_seqs * sizeof *list) : seqs;
        if (!list) return q3_fail(err, Q3_ERR_NOMEM, "out of memory for the call's %d sequences", a->n_seqs);
        for (int i = 0; i < a->n_seqs; i++) list[i] = i;
        a->seqs = list;
    }
    static const char *const names[2] = {"token_mask", "positions"};
    for (int i = 0; s == Q3_OK && i < 3; i++)
        if (token[i])
            s = i == 2 ? q3_call_check_tree_input(token[i], x, err)
                       : q3_call_check_token_input(token[i], x, names[i], err);
    a->token_mask = token[0] ? token[0]->data : NULL;
    a->positions = token[1] ? token[1]->data : NULL;
    a->tree = token[2] ? token[2]->data : NULL;
    if (s == Q3_OK) s = half ? q3_layer_check_attention_half(layer, c, a, err) : q3_layer_check_call(layer, c, a, err);
    if (s != Q3_OK) q3_call_release(a, seqs);
    return s;
}

void q3_call_release(q3_forward_args *a, const int32_t *seqs) {
    if (a->seqs != seqs) q3_free((void *)a->seqs);
    a->seqs = NULL;
}

q3_status q3_call_check_out(const q3_view *o, const q3_view *x, q3_error *err) {
    if (o->dtype != x->dtype)
        return q3_fail(err, Q3_ERR_TYPE, "out: expected dtype %s (x's), got %s", q3_dtype_name(x->dtype),
                       q3_dtype_name(o->dtype));
    q3_status s = q3_view_check_shape(o, "out", x->ndim, x->shape, err);
    if (s != Q3_OK || (s = q3_view_require(o, "out", Q3_NEED_CONTIGUOUS | Q3_NEED_WRITABLE, err)) != Q3_OK) return s;
    /* y may be x itself (each pass reads its rows before it writes them), but rows of out
     * over other rows of x would be written before they are read */
    int64_t n;
    q3_numel(x->ndim, x->shape, &n); /* fits: checked at import */
    const uintptr_t bytes = (uintptr_t)n * q3_dtype_size(x->dtype), xa = (uintptr_t)x->data, oa = (uintptr_t)o->data;
    if (oa != xa && oa < xa + bytes && xa < oa + bytes)
        return q3_fail(err, Q3_ERR_VALUE, "out: overlaps x partly (out starts %lld bytes %s x); expected separate "
                       "memory or out being x itself", (long long)(oa > xa ? oa - xa : xa - oa),
                       oa > xa ? "after" : "before");
    return Q3_OK;
}

q3_status q3_call_attention_maps(const q3_config *cfg, const q3_cache *c, const q3_forward_args *a, int64_t limit,
                                 int64_t shape[4], q3_error *err) {
    int64_t context = 0, n;
    for (int s = 0; s < a->n_seqs; s++)
        if (q3_cache_length(c, a->seqs[s]) + a->tokens > context) context = q3_cache_length(c, a->seqs[s]) + a->tokens;
    const int64_t bytes_shape[5] = {a->n_seqs, cfg->heads, a->tokens, context, (int64_t)sizeof(float)};
    shape[0] = a->n_seqs, shape[1] = cfg->heads, shape[2] = a->tokens, shape[3] = context;
    if (q3_numel(5, bytes_shape, &n) && n <= limit) return Q3_OK;
    char what[64];
    if (q3_numel(5, bytes_shape, &n)) snprintf(what, sizeof what, "%lld bytes", (long long)n);
    else snprintf(what, sizeof what, "more than 2^63 bytes");
    return q3_fail(err, Q3_ERR_VALUE,
                   "return_attention: the attention maps [%d, %d, %lld, %lld] (batch, heads, new tokens, context) fp32 "
                   "would take %s, above attention_limit=%lld bytes; pass a larger attention_limit, or fewer tokens "
                   "per call", a->n_seqs, cfg->heads, (long long)a->tokens, (long long)context, what, (long long)limit);
}

q3_status q3_expert_half_check_views(const q3_config *cfg, const q3_view *rows, const q3_view *experts,
                                     const q3_view *weights, const q3_view *out, q3_error *err) {
    q3_status s = q3_view_check_rows(rows, "rows", -1, cfg->hidden, "hidden", err);
    const int64_t n = s == Q3_OK ? q3_view_rows(rows) : 0;
    if (s != Q3_OK || (s = q3_view_check_rows(experts, "experts", n, cfg->top_k, "top_k", err)) != Q3_OK ||
        (s = q3_view_check_rows(weights, "weights", n, cfg->top_k, "top_k", err)) != Q3_OK)
        return s;
    if (weights->dtype != Q3_F32)
        return q3_fail(err, Q3_ERR_TYPE, "weights: expected dtype float32 (the router's), got %s",
                       q3_dtype_name(weights->dtype));
    if (!out) return Q3_OK;
    if ((s = q3_view_check_rows(out, "out", n, cfg->hidden, "hidden", err)) != Q3_OK ||
        (s = q3_view_require(out, "out", Q3_NEED_WRITABLE, err)) != Q3_OK)
        return s;
    const q3_view *in[3] = {rows, experts, weights};
    static const char *names[3] = {"rows", "experts", "weights"};
    for (int i = 0; i < 3; i++)
        if (q3_views_overlap(out, in[i]))
            return q3_fail(err, Q3_ERR_VALUE, "out: overlaps %s; expected separate memory", names[i]);
    return Q3_OK;
}

q3_status q3_weight_view_use(const q3_view *v, q3_dtype want, int device, int align, const char *arg,
                             q3_weight_use *use, q3_error *err) {
    const int aligned = v->device < 0 || (uintptr_t)v->data % (uintptr_t)align == 0;
    if (want == Q3_E4M3 || want == Q3_I32 || want == Q3_F16) {
        /* quantized data, never converted: a CUDA layer takes the bytes from its device or from
         * the host (uploaded once) */
        const int placed = v->device == device || (device >= 0 && v->device < 0);
        if (v->dtype != want || !v->contiguous || !placed)
            return q3_fail(err, Q3_ERR_VALUE, "%s: %s layer expected a contiguous %s tensor on %s, got a%s %s tensor "
                           "on %s", arg, want == Q3_E4M3 ? "an fp8_e4m3_block128" : "a gptq_int4", q3_dtype_name(want),
                           device < 0 ? "cpu" : "cuda", v->contiguous ? "" : " non-contiguous",
                           q3_dtype_name(v->dtype), v->device < 0 ? "cpu" : "cuda");
        *use = device >= 0 && (v->device < 0 || !aligned) ? Q3_WEIGHT_UPLOAD : Q3_WEIGHT_BORROW;
        return Q3_OK;
    }
    if (v->device == device && v->dtype == want && v->contiguous && aligned) *use = Q3_WEIGHT_BORROW;
    else if (v->device < 0) *use = Q3_WEIGHT_CONVERT;
    else if (v->dtype != want || !v->contiguous)
        return q3_fail(err, Q3_ERR_VALUE, "%s: a CUDA weight must be contiguous and of the layer's dtype (%s), got "
                       "a%s %s tensor", arg, q3_dtype_name(want), v->contiguous ? "" : " non-contiguous",
                       q3_dtype_name(v->dtype));
    else *use = Q3_WEIGHT_UPLOAD; /* of the layer's dtype and contiguous, but off the kernels' alignment */
    return Q3_OK;
}

q3_status q3_call_check_token_input(const q3_view *v, const q3_view *x, const char *arg, q3_error *err) {
    q3_status s = q3_view_check_shape(v, arg, x->ndim - 1, x->shape, err); /* x's shape less hidden */
    return s != Q3_OK ? s : q3_view_require(v, arg, Q3_NEED_CONTIGUOUS, err);
}

q3_status q3_call_check_tree_input(const q3_view *v, const q3_view *x, q3_error *err) {
    int64_t dims[Q3_MAX_DIM];
    for (int d = 0; d < x->ndim - 1; d++) dims[d] = x->shape[d];
    dims[x->ndim - 1] = x->shape[x->ndim - 2]; /* [..., tokens, tokens] */
    q3_status s = q3_view_check_shape(v, "tree", x->ndim, dims, err);
    return s != Q3_OK ? s : q3_view_require(v, "tree", Q3_NEED_CONTIGUOUS, err);
}
