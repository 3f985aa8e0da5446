/* Rows moved between a layer's halves where its experts are split between a device and the
 * host (qwen3layer/placement/hybrid.py) or between processes
 * (qwen3layer/placement/parallel.py): the rows that chose an expert elsewhere taken out
 * (q3_take_rows), the sums back from there added in (q3_combine_rows), each on views of the
 * tensors from outside, checked here (shapes, dtype, overlaps, the index tensor's form) with
 * messages naming the argument. Host memory here; a device's through the installed backend
 * (csrc/cuda/split_rows.c), after the same checks. */
#include <stdlib.h>

#include "cpu_dispatch.h"
#include "device_backend.h"

q3_status q3_check_split_rows(const int32_t *rows, int64_t n, int64_t R, int distinct, q3_error *err) {
    uint8_t *seen = NULL;
    if (distinct && n > 1 && !(seen = calloc((size_t)R, 1)))
        return q3_fail(err, Q3_ERR_NOMEM, "rows: out of host memory for the check of %lld rows", (long long)R);
    q3_status s = Q3_OK;
    for (int64_t i = 0; i < n && s == Q3_OK; i++) {
        if (rows[i] < 0 || rows[i] >= R)
            s = q3_fail(err, Q3_ERR_INDEX, "rows[%lld]: expected a row in [0, %lld), got %d", (long long)i,
                        (long long)R, (int)rows[i]);
        else if (seen && seen[rows[i]]++)
            s = q3_fail(err, Q3_ERR_VALUE, "rows[%lld]: row %d is named twice; on a device each part adds to a row "
                        "of its own (combine twice, or on the host)", (long long)i, (int)rows[i]);
    }
    free(seen);
    return s;
}

/* R rows of H and n of H of each dtype fit in memory */
static q3_status check_sizes(int64_t R, int64_t H, int64_t n, q3_error *err) {
    int64_t a, b;
    if (R < 0 || H < 1 || n < 0 || !q3_mul_i64(R, H, &a) || !q3_mul_i64(n, H, &b) || !q3_mul_i64(a, 4, &a) ||
        !q3_mul_i64(b, 4, &b))
        return q3_fail(err, Q3_ERR_VALUE, "rows: expected R >= 0 rows of H >= 1 and n >= 0 parts whose bytes fit, "
                       "got %lld, %lld, %lld", (long long)R, (long long)H, (long long)n);
    return Q3_OK;
}

/* rows: a contiguous tensor [n] (n < 0: any n; int32, the import's) */
static q3_status check_index(const q3_view *rows, int64_t n, q3_error *err) {
    if (rows->ndim == 1 && (n < 0 || rows->shape[0] == n) && rows->contiguous) return Q3_OK;
    char got[128];
    q3_format_shape(got, sizeof got, rows->ndim, rows->shape);
    if (n >= 0)
        return q3_fail(err, Q3_ERR_VALUE, "rows: expected a contiguous int32 tensor [%lld] (one per part), got %s",
                       (long long)n, got);
    return q3_fail(err, Q3_ERR_VALUE, "rows: expected a contiguous int32 tensor [n], got %s", got);
}

/* out: a writable contiguous [rows, H] */
static q3_status check_out(const q3_view *out, int64_t rows, int64_t H, q3_error *err) {
    q3_status s = q3_view_check_rows(out, "out", rows, H, "hidden", err);
    return s != Q3_OK ? s : q3_view_require(out, "out", Q3_NEED_WRITABLE, err);
}

static q3_status no_backend(q3_error *err) { return q3_fail(err, Q3_ERR_STATE, "cuda: the CUDA backend is not loaded"); }

q3_status q3_take_rows_check(const q3_view *src, const q3_view *rows, const q3_view *out, q3_error *err) {
    if (src->ndim < 2) return q3_fail(err, Q3_ERR_VALUE, "src: expected a tensor [..., hidden] (rows to take from)");
    const int64_t H = src->shape[src->ndim - 1];
    q3_status s = q3_view_check_rows(src, "src", -1, H, "hidden", err);
    if (s != Q3_OK || (s = check_index(rows, -1, err)) != Q3_OK) return s;
    const int64_t n = rows->shape[0];
    if (out) {
        if ((s = check_out(out, n, H, err)) != Q3_OK) return s;
        if (out->dtype != src->dtype)
            return q3_fail(err, Q3_ERR_TYPE, "out: expected dtype %s (src's: rows are moved, not converted), got %s",
                           q3_dtype_name(src->dtype), q3_dtype_name(out->dtype));
        if (q3_views_overlap(out, src) || q3_views_overlap(out, rows))
            return q3_fail(err, Q3_ERR_VALUE, "out: overlaps src or rows; expected separate memory");
    }
    return check_sizes(q3_view_rows(src), H, n, err);
}

q3_status q3_take_rows(void *dst, const q3_view *src, const q3_view *rows, void *stream, q3_error *err) {
    const int64_t R = q3_view_rows(src), H = src->shape[src->ndim - 1], n = rows->shape[0];
    if (src->device >= 0) {
        const q3_device_backend *b = q3_device();
        return b ? b->take_rows(dst, src->data, src->dtype, R, H, rows->data, n, src->device, stream, err)
                 : no_backend(err);
    }
    q3_status s = q3_check_split_rows(rows->data, n, R, 0, err);
    if (s == Q3_OK) q3_cpu_ops_active()->take_rows(dst, src->data, src->dtype, rows->data, n, H);
    return s;
}

/* q3_combine_rows' views */
static q3_status check_combine(const q3_view *resid, const q3_view *parts, const q3_view *rows, const q3_view *out,
                               q3_error *err) {
    if (resid->ndim < 2 || resid->dtype != Q3_F32 || !resid->contiguous || resid->readonly)
        return q3_fail(err, Q3_ERR_VALUE, "resid: expected a writable contiguous float32 tensor [R, hidden]");
    const int64_t R = q3_view_rows(resid), H = resid->shape[resid->ndim - 1];
    q3_status s = q3_view_check_rows(parts, "parts", -1, H, "hidden", err);
    if (s != Q3_OK || (s = check_index(rows, q3_view_rows(parts), err)) != Q3_OK) return s;
    if (out && (s = check_out(out, R, H, err)) != Q3_OK) return s;
    /* out may be resid itself (the sums in place), never part of it or of parts */
    if (out && out->data != resid->data && (q3_views_overlap(out, resid) || q3_views_overlap(out, parts)))
        return q3_fail(err, Q3_ERR_VALUE, "out: overlaps resid or parts; expected separate memory");
    if (q3_views_overlap(resid, parts))
        return q3_fail(err, Q3_ERR_VALUE, "parts: overlaps resid; expected separate memory");
    return check_sizes(R, H, q3_view_rows(parts), err);
}

q3_status q3_combine_rows(const q3_view *resid, const q3_view *parts, const q3_view *rows, const q3_view *out,
                          void *stream, q3_error *err) {
    q3_status s = check_combine(resid, parts, rows, out, err);
    if (s != Q3_OK) return s;
    const int64_t R = q3_view_rows(resid), H = resid->shape[resid->ndim - 1], n = q3_view_rows(parts);
    void *out_data = out ? out->data : NULL;
    const q3_dtype out_dtype = out ? out->dtype : Q3_F32;
    if (resid->device >= 0) {
        const q3_device_backend *b = q3_device();
        return b ? b->combine_rows(resid->data, R, H, parts->data, parts->dtype, rows->data, n, out_data, out_dtype,
                                   resid->device, stream, err)
                 : no_backend(err);
    }
    if ((s = q3_check_split_rows(rows->data, n, R, 0, err)) != Q3_OK) return s;
    const q3_cpu_ops *k = q3_cpu_ops_active();
    k->add_rows(resid->data, parts->data, parts->dtype, rows->data, n, H);
    if (out_data) k->from_f32(out_data, out_dtype, resid->data, R * H);
    return Q3_OK;
}
