/* Rows moved between a layer's halves where its experts are split between a device and the
 * host (qwen3layer/placement/hybrid.py) or between processes
 * (qwen3layer/placement/parallel.py): the rows that chose an expert elsewhere taken out
 * (q3_take_rows), the sums back from there added in (q3_combine_rows). Host memory here; a
 * device's through the installed backend (csrc/cuda/split_rows.c), after the same checks of
 * the sizes and dtypes. */
#include <stdlib.h>

#include "cpu_dispatch.h"
#include "device_backend.h"

static int io_dtype_ok(q3_dtype dt) { return dt == Q3_F32 || dt == Q3_BF16; }

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

/* R rows of H and n of H of each dtype fit in memory: false with the failure set */
static int sizes_ok(int64_t R, int64_t H, int64_t n, q3_error *err) {
    int64_t a, b;
    if (R < 0 || H < 1 || n < 0 || !q3_mul_i64(R, H, &a) || !q3_mul_i64(n, H, &b) || !q3_mul_i64(a, 4, &a) ||
        !q3_mul_i64(b, 4, &b)) {
        q3_fail(err, Q3_ERR_VALUE, "rows: expected R >= 0 rows of H >= 1 and n >= 0 parts whose bytes fit, got %lld, "
                "%lld, %lld", (long long)R, (long long)H, (long long)n);
        return 0;
    }
    return 1;
}

static q3_status no_backend(q3_error *err) { return q3_fail(err, Q3_ERR_STATE, "cuda: the CUDA backend is not loaded"); }

q3_status q3_take_rows(void *dst, const void *src, q3_dtype dt, int64_t R, int64_t H, const int32_t *rows, int64_t n,
                       int device, void *stream, q3_error *err) {
    if (!sizes_ok(R, H, n, err)) return err->status;
    if (!io_dtype_ok(dt)) return q3_fail(err, Q3_ERR_TYPE, "take: expected float32 or bfloat16 rows");
    if (device >= 0) {
        const q3_device_backend *b = q3_device();
        return b ? b->take_rows(dst, src, dt, R, H, rows, n, device, stream, err) : no_backend(err);
    }
    q3_status s = q3_check_split_rows(rows, n, R, 0, err);
    if (s == Q3_OK) q3_cpu_ops_active()->take_rows(dst, src, dt, rows, n, H);
    return s;
}

q3_status q3_combine_rows(float *resid, int64_t R, int64_t H, const void *parts, q3_dtype parts_dtype,
                          const int32_t *rows, int64_t n, void *out, q3_dtype out_dtype, int device, void *stream,
                          q3_error *err) {
    if (!sizes_ok(R, H, n, err)) return err->status;
    if (!io_dtype_ok(parts_dtype) || (out && !io_dtype_ok(out_dtype)))
        return q3_fail(err, Q3_ERR_TYPE, "combine: expected float32 or bfloat16 parts and out");
    if (device >= 0) {
        const q3_device_backend *b = q3_device();
        return b ? b->combine_rows(resid, R, H, parts, parts_dtype, rows, n, out, out_dtype, device, stream, err)
                 : no_backend(err);
    }
    q3_status s = q3_check_split_rows(rows, n, R, 0, err);
    if (s != Q3_OK) return s;
    const q3_cpu_ops *k = q3_cpu_ops_active();
    k->add_rows(resid, parts, parts_dtype, rows, n, H);
    if (out) k->from_f32(out, out_dtype, resid, R * H);
    return Q3_OK;
}
