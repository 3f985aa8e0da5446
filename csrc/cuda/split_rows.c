/* q3_take_rows and q3_combine_rows (q3.h) on a CUDA device, reached through the device
 * backend after the engine checked the sizes and dtypes: the rows [n] int32 read back on the
 * stream and checked on the host (in range; distinct for the combine, whose kernel adds the
 * parts of a call in parallel) before anything is queued, then the kernels of
 * kernels/cuda/elementwise.cu on the stream. */
#include <stdlib.h>

#include "backend.h"
#include "split_rows.h"

/* rows into host memory (*out, malloc'd) and checked; Q3_OK or the failure */
static q3_status rows_read(const q3_cuda_ops *g, const int32_t *rows, int64_t n, int64_t R, int distinct, int device,
                           void *stream, int32_t **out, q3_error *err) {
    *out = NULL;
    if (n == 0) return Q3_OK;
    int32_t *h = malloc((size_t)n * sizeof *h);
    if (!h) return q3_fail(err, Q3_ERR_NOMEM, "rows: out of host memory for %lld rows", (long long)n);
    int code = g->set_device(device);
    if (!code) code = g->copy_async(h, rows, (size_t)n * sizeof *h, 0, stream);
    if (!code) code = g->stream_synchronize(stream);
    q3_status s = code ? q3_fail(err, Q3_ERR_STATE, "cuda: reading rows back from device %d failed: %s", device,
                                 g->error_string(code))
                       : q3_check_split_rows(h, n, R, distinct, err);
    if (s != Q3_OK) free(h);
    else *out = h;
    return s;
}

static q3_status queued(const q3_cuda_ops *g, int code, const char *what, q3_error *err) {
    return code ? q3_fail(err, Q3_ERR_STATE, "cuda: %s failed: %s", what, g->error_string(code)) : Q3_OK;
}

q3_status q3_take_rows_cuda(void *dst, const void *src, q3_dtype dt, int64_t R, int64_t H, const int32_t *rows,
                            int64_t n, int device, void *stream, q3_error *err) {
    const q3_cuda_ops *g = q3_cuda();
    int32_t *h;
    q3_status s = rows_read(g, rows, n, R, 0, device, stream, &h, err);
    free(h);
    return s == Q3_OK ? queued(g, g->take_rows(dst, src, dt, rows, n, H, stream), "take_rows", err) : s;
}

q3_status q3_combine_rows_cuda(float *resid, int64_t R, int64_t H, const void *parts, q3_dtype parts_dtype,
                               const int32_t *rows, int64_t n, void *out, q3_dtype out_dtype, int device, void *stream,
                               q3_error *err) {
    const q3_cuda_ops *g = q3_cuda();
    int32_t *h;
    q3_status s = rows_read(g, rows, n, R, 1, device, stream, &h, err);
    free(h);
    if (s != Q3_OK) return s;
    s = queued(g, g->add_rows(resid, parts, parts_dtype, rows, n, H, stream), "add_rows", err);
    if (s == Q3_OK && out) s = queued(g, g->from_f32(out, out_dtype, resid, R * H, stream), "combine's out", err);
    return s;
}
