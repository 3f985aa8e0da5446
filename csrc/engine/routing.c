/* Tokens per expert of one layer call (q3.h): a histogram of the router's choices, walking
 * the experts tensor in row-major order whatever its strides; a device's choices copied to the
 * host first, through the installed backend (device_backend.h), once the device finished. */
#include "device_backend.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* "[2, 7]" for the multi-index idx[ndim] */
static void format_index(char *buf, size_t n, int ndim, const int64_t *idx) {
    size_t used = (size_t)snprintf(buf, n, "[");
    for (int d = 0; d < ndim && used < n; d++)
        used += (size_t)snprintf(buf + used, n - used, d ? ", %lld" : "%lld", (long long)idx[d]);
    if (used < n) snprintf(buf + used, n - used, "]");
}

/* whether no two elements of the layout share an address: the dims of more than one element,
 * by ascending |stride|, each step past the whole extent of the dims below it. A sufficient
 * test (torch's for non-overlapping views): any slice, transpose or permutation of a dense
 * tensor passes; an expand (stride 0) or an as_strided overlap does not. Without it a shape of
 * 2^40 elements over a few bytes (stride 0) would be walked element by element. */
static int elements_distinct(int ndim, const int64_t *shape, const int64_t *strides) {
    int order[Q3_MAX_DIM], n = 0;
    for (int d = 0; d < ndim; d++)
        if (shape[d] > 1) {
            if (strides[d] == 0 || strides[d] == INT64_MIN) return 0;
            int i = n++;
            for (; i > 0 && llabs(strides[order[i - 1]]) > llabs(strides[d]); i--) order[i] = order[i - 1];
            order[i] = d;
        }
    int64_t extent = 1; /* elements spanned by the dims taken so far */
    for (int i = 0; i < n; i++) {
        const int d = order[i];
        if (llabs(strides[d]) < extent || !q3_mul_i64(llabs(strides[d]), shape[d], &extent)) return 0;
    }
    return 1;
}

q3_status q3_count_experts_check(int E, int device, q3_error *err) {
    if (E < 1 || E > Q3_MAX_EXPERTS)
        return q3_fail(err, Q3_ERR_VALUE, "num_experts: expected 1 <= num_experts <= %d, got %d", Q3_MAX_EXPERTS, E);
    if (device >= 0 && !q3_device())
        return q3_fail(err, Q3_ERR_VALUE, "experts: expected a host tensor, or a CUDA one once the CUDA backend is "
                       "loaded (qwen3layer.cuda.load()), got a tensor on cuda:%d", device);
    return Q3_OK;
}

/* The count of host memory: experts [ndim dims: shape] int32 at element strides `strides`,
 * ndim in [1, Q3_MAX_DIM], a shape whose count fits int64 and strides whose reach does (a
 * view's, q3_view_from_dlpack) */
static q3_status count(const int32_t *experts, int ndim, const int64_t *shape, const int64_t *strides, int E,
                       int64_t *counts, q3_error *err) {
    int64_t n;
    q3_numel(ndim, shape, &n); /* fits: a view's */
    if (n > 0 && !experts) return q3_fail(err, Q3_ERR_VALUE, "experts: NULL data for %lld entries", (long long)n);
    if (n > 1 && !elements_distinct(ndim, shape, strides)) {
        char sh[8 * 24], st[8 * 24];
        format_index(sh, sizeof sh, ndim, shape);
        format_index(st, sizeof st, ndim, strides);
        return q3_fail(err, Q3_ERR_VALUE, "experts: expected a view whose elements do not overlap, got shape %s with "
                       "strides %s (an expand or as_strided view: call .contiguous())", sh, st);
    }
    memset(counts, 0, (size_t)E * sizeof *counts);
    int64_t idx[Q3_MAX_DIM] = {0}, off = 0; /* off: the element offset of idx */
    for (int64_t i = 0; i < n; i++) {
        const int32_t e = experts[off];
        if (e < 0 || e >= E) {
            char where[8 * 24];
            format_index(where, sizeof where, ndim, idx);
            memset(counts, 0, (size_t)E * sizeof *counts);
            return q3_fail(err, Q3_ERR_INDEX, "experts%s: expected an expert index in [0, %d) (num_experts), got %d",
                           where, E, (int)e);
        }
        counts[e]++;
        /* the next index, row-major. off only ever holds the offset of an element of the
         * tensor (a stride is added only when the index stays inside its dimension), so it
         * stays within the reach the caller checked, even for a stride of a size-1 dim that
         * is never taken (any int64) */
        for (int d = ndim - 1; d >= 0; d--) {
            if (++idx[d] < shape[d]) {
                off += strides[d];
                break;
            }
            off -= strides[d] * (shape[d] - 1);
            idx[d] = 0;
        }
    }
    return Q3_OK;
}

q3_status q3_count_experts(const q3_view *v, int E, int64_t *counts, q3_error *err) {
    if (v->ndim < 1)
        return q3_fail(err, Q3_ERR_VALUE, "experts: expected at least 1 dimension ([..., top_k]), got a scalar");
    if (v->device < 0) return count(v->data, v->ndim, v->shape, v->strides, E, counts, err);
    /* a device's: copied whole (its bytes, contiguous) to the host, then counted there in C order */
    if (!v->contiguous)
        return q3_fail(err, Q3_ERR_VALUE, "experts: expected a contiguous tensor on a CUDA device (or a host tensor "
                       "of any layout), got a strided view");
    int64_t n, strides[Q3_MAX_DIM];
    q3_numel(v->ndim, v->shape, &n); /* fits: a view's, and so do its bytes */
    q3_contiguous_strides(v->ndim, v->shape, sizeof(int32_t), strides);
    int32_t *host = malloc((size_t)(n ? n : 1) * sizeof *host);
    if (!host) return q3_fail(err, Q3_ERR_NOMEM, "experts: out of host memory for %lld entries", (long long)n);
    const q3_device_backend *b = q3_device(); /* installed: q3_count_experts_check */
    q3_status s = b ? b->copy_to_host(host, v->data, (size_t)n * sizeof *host, v->device, err)
                    : q3_fail(err, Q3_ERR_STATE, "the CUDA backend is not loaded");
    if (s != Q3_OK) {
        char why[sizeof err->msg];
        snprintf(why, sizeof why, "%s", err->msg);
        s = q3_fail(err, Q3_ERR_STATE, "experts: copying them from cuda:%d: %.400s", v->device, why);
    } else {
        s = count(host, v->ndim, v->shape, strides, E, counts, err);
    }
    free(host);
    return s;
}
