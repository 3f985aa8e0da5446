/* A tensor from outside as the engine checks it (q3_view, q3.h): a producer's DLPack tensor
 * read into a view, refused with a message naming the argument when its device, dtype,
 * alignment, shape or strides cannot be used; and the checks calls make of views (contiguous,
 * writable, shape, rows, overlap, a copy's devices). The glue imports capsules and raises; the decisions are
 * here, where a C program (the fuzzers, the CPU op harness) can reach them without Python. */
#include <stdio.h>
#include <string.h>

#include "device_backend.h"

void q3_format_shape(char *buf, size_t n, int ndim, const int64_t *shape) {
    size_t used = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < ndim && used < n; i++)
        used += (size_t)snprintf(buf + used, n - used, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (used < n) snprintf(buf + used, n - used, "]");
}

void q3_format_device(char *buf, size_t n, int device) {
    if (device < 0) snprintf(buf, n, "cpu");
    else snprintf(buf, n, "cuda:%d", device);
}

static const char *device_name(int type) {
    switch (type) {
    case Q3_DL_CPU: return "cpu";
    case Q3_DL_CUDA: return "cuda";
    case Q3_DL_CUDA_HOST: return "cuda_host";
    case Q3_DL_CUDA_MANAGED: return "cuda_managed";
    default: return "device_type";
    }
}

/* "float32", "bfloat16", "float8_e4m3fn", "int32", "uint8 x4", ...: what a producer gave */
static void dtype_desc(char *buf, size_t n, q3_dl_dtype d) {
    static const char *kinds[] = {"int", "uint", "float", "opaque", "bfloat", "complex", "bool"};
    static const char *float8[] = {"e3m4", "e4m3", "e4m3b11fnuz", "e4m3fn", "e4m3fnuz", "e5m2", "e5m2fnuz",
                                   "e8m0fnu"};
    const char *k = d.code < sizeof kinds / sizeof kinds[0] ? kinds[d.code] : "code";
    if (d.lanes != 1) snprintf(buf, n, "%s%u x%u", k, d.bits, d.lanes);
    else if (d.code == Q3_DL_BOOL) snprintf(buf, n, "bool");
    else if (d.code >= Q3_DL_FLOAT8_FIRST && d.code <= Q3_DL_FLOAT8_LAST)
        snprintf(buf, n, "float8_%s", float8[d.code - Q3_DL_FLOAT8_FIRST]);
    else snprintf(buf, n, "%s%u", k, d.bits);
}

q3_status q3_view_check_device(int type, int id, int device, int allow, const char *arg, q3_error *err) {
    const int fits = type == Q3_DL_CPU ? device < 0 || (allow & Q3_VIEW_HOST) : type == Q3_DL_CUDA && device >= 0 && id == device;
    if (fits) return Q3_OK;
    char want[24];
    q3_format_device(want, sizeof want, device);
    if (type == Q3_DL_CPU) return q3_fail(err, Q3_ERR_VALUE, "%s: expected a tensor on device %s, got cpu", arg, want);
    return q3_fail(err, Q3_ERR_VALUE, "%s: expected a tensor on device %s, got %s:%d", arg, want, device_name(type), id);
}

/* the dtype of t as `allow` takes it */
static q3_status view_dtype(const q3_dl_dtype d, const char *arg, int allow, q3_dtype *dt, q3_error *err) {
    char desc[64];
    const int one = d.lanes == 1;
    if (allow & Q3_VIEW_I32) { /* int32 only: the router's chosen experts */
        if (one && d.code == Q3_DL_INT && d.bits == 32) return *dt = Q3_I32, Q3_OK;
        dtype_desc(desc, sizeof desc, d);
        return q3_fail(err, Q3_ERR_TYPE, "%s: expected dtype int32, got %s", arg, desc);
    }
    if (allow & Q3_VIEW_BOOL) { /* bool or uint8 only: a call's token mask */
        if (one && (d.code == Q3_DL_BOOL || d.code == Q3_DL_UINT) && d.bits == 8) return *dt = Q3_BOOL, Q3_OK;
        dtype_desc(desc, sizeof desc, d);
        return q3_fail(err, Q3_ERR_TYPE, "%s: expected dtype bool or uint8, got %s", arg, desc);
    }
    if (allow & Q3_VIEW_I64) { /* int64 only: a call's positions */
        if (one && d.code == Q3_DL_INT && d.bits == 64) return *dt = Q3_I64, Q3_OK;
        dtype_desc(desc, sizeof desc, d);
        return q3_fail(err, Q3_ERR_TYPE, "%s: expected dtype int64, got %s", arg, desc);
    }
    if (allow & Q3_VIEW_F16) { /* float16 only: a GPTQ matrix's scales */
        if (one && d.code == Q3_DL_FLOAT && d.bits == 16) return *dt = Q3_F16, Q3_OK;
        dtype_desc(desc, sizeof desc, d);
        return q3_fail(err, Q3_ERR_TYPE, "%s: expected dtype float16, got %s", arg, desc);
    }
    if (one && d.code == Q3_DL_FLOAT && d.bits == 32) return *dt = Q3_F32, Q3_OK;
    if (one && d.code == Q3_DL_BFLOAT && d.bits == 16) return *dt = Q3_BF16, Q3_OK;
    if (one && d.code == Q3_DL_FLOAT && d.bits == 16) return *dt = Q3_F16, Q3_OK;
    if ((allow & (Q3_VIEW_E4M3 | Q3_VIEW_ANY)) && one && d.code == Q3_DL_FLOAT8_E4M3FN && d.bits == 8)
        return *dt = Q3_E4M3, Q3_OK;
    if ((allow & Q3_VIEW_ANY) && one && d.code == Q3_DL_INT && d.bits == 32) return *dt = Q3_I32, Q3_OK;
    dtype_desc(desc, sizeof desc, d);
    return q3_fail(err, Q3_ERR_TYPE, "%s: expected dtype %s, got %s", arg,
                   allow & Q3_VIEW_ANY    ? "float32, bfloat16, float16, float8_e4m3fn or int32"
                   : allow & Q3_VIEW_E4M3 ? "float32, bfloat16, float16 or float8_e4m3fn"
                                          : "float32, bfloat16 or float16",
                   desc);
}

/* Checks the shape and strides of v (dims and strides filled from t): non-negative dims whose
 * count fits int64, and a farthest element whose byte offset fits (the producer's pointer
 * itself cannot be checked); sets v->contiguous. */
static q3_status view_extent(q3_view *v, const q3_dl_tensor *t, const char *arg, q3_error *err) {
    for (int d = 0; d < v->ndim; d++) v->shape[d] = t->shape[d];
    int64_t n;
    if (!q3_numel(v->ndim, v->shape, &n)) {
        char got[160];
        q3_format_shape(got, sizeof got, v->ndim, v->shape);
        for (int d = 0; d < v->ndim; d++)
            if (v->shape[d] < 0) return q3_fail(err, Q3_ERR_VALUE, "%s: expected non-negative dimensions, got %s", arg, got);
        return q3_fail(err, Q3_ERR_VALUE, "%s: the element count of shape %s overflows int64", arg, got);
    }
    int64_t expect = 1, reach = 0;
    for (int d = v->ndim - 1; d >= 0; d--) {
        v->strides[d] = t->strides ? t->strides[d] : expect;
        /* an empty tensor reaches nothing */
        const int64_t stride = v->strides[d] < 0 && v->strides[d] > INT64_MIN ? -v->strides[d] : v->strides[d];
        int64_t step;
        if (n > 0 && (stride < 0 || !q3_mul_i64(v->shape[d] - 1, stride, &step) || !q3_add_i64(reach, step, &reach)))
            return q3_fail(err, Q3_ERR_VALUE, "%s: strides that overflow int64 at dimension %d (stride %lld)", arg, d,
                           (long long)v->strides[d]);
        if (!q3_mul_i64(expect, v->shape[d], &expect)) expect = INT64_MAX; /* only with a 0 dim: n == 0 */
    }
    v->contiguous = q3_strides_contiguous(v->ndim, v->shape, v->strides);
    if (n > 0 && (!q3_add_i64(reach, 1, &reach) || !q3_mul_i64(reach, (int64_t)q3_dtype_size(v->dtype), &reach)))
        return q3_fail(err, Q3_ERR_VALUE, "%s: a tensor spanning more than 2^63 bytes (its size overflows)", arg);
    return Q3_OK;
}

q3_status q3_view_from_dlpack(q3_view *v, const q3_dl_tensor *t, const char *arg, int device, int allow,
                              q3_error *err) {
    q3_status s = q3_view_check_device(t->device.device_type, t->device.device_id, device, allow, arg, err);
    if (s != Q3_OK || (s = view_dtype(t->dtype, arg, allow, &v->dtype, err)) != Q3_OK) return s;
    v->device = t->device.device_type == Q3_DL_CPU ? -1 : t->device.device_id;
    if (t->ndim < 0 || t->ndim > Q3_MAX_DIM)
        return q3_fail(err, Q3_ERR_VALUE, "%s: expected at most %d dimensions, got %d", arg, Q3_MAX_DIM, (int)t->ndim);
    v->ndim = t->ndim;
    v->data = (char *)t->data + t->byte_offset;
    if ((uintptr_t)v->data % q3_dtype_size(v->dtype)) /* kernels load whole elements, vectors even */
        return q3_fail(err, Q3_ERR_VALUE, "%s: expected data aligned to its %zu-byte elements, got address %p", arg,
                       q3_dtype_size(v->dtype), v->data);
    return view_extent(v, t, arg, err);
}

int q3_strides_contiguous(int ndim, const int64_t *shape, const int64_t *strides) {
    int64_t expect = 1, n;
    if (!q3_numel(ndim, shape, &n) || n == 0) return 1; /* an empty one always is */
    for (int d = ndim - 1; d >= 0; d--) {
        if (shape[d] != 1 && strides[d] != expect) return 0;
        expect *= shape[d]; /* fits: the element count does */
    }
    return 1;
}

int q3_contiguous_strides(int ndim, const int64_t *shape, size_t itemsize, int64_t *strides) {
    int64_t span = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        strides[d] = span;
        if (shape[d] < 0 || !q3_mul_i64(span, shape[d] ? shape[d] : 1, &span)) return 0;
    }
    return q3_mul_i64(span, (int64_t)itemsize, &span);
}

q3_status q3_view_require(const q3_view *v, const char *arg, int need, q3_error *err) {
    if ((need & Q3_NEED_CONTIGUOUS) && !v->contiguous) {
        char st[128];
        q3_format_shape(st, sizeof st, v->ndim, v->strides);
        return q3_fail(err, Q3_ERR_VALUE, "%s: expected a contiguous tensor, got strides %s (call .contiguous())", arg, st);
    }
    if ((need & Q3_NEED_WRITABLE) && v->readonly)
        return q3_fail(err, Q3_ERR_VALUE, "%s: expected a writable tensor, got a read-only one", arg);
    return Q3_OK;
}

q3_status q3_view_check_shape(const q3_view *v, const char *arg, int rank, const int64_t *dims, q3_error *err) {
    int same = v->ndim == rank;
    for (int d = 0; same && d < rank; d++) same = v->shape[d] == dims[d];
    if (same) return Q3_OK;
    char want[128], got[128];
    q3_format_shape(want, sizeof want, rank, dims);
    q3_format_shape(got, sizeof got, v->ndim, v->shape);
    return q3_fail(err, Q3_ERR_VALUE, "%s: expected shape %s, got %s", arg, want, got);
}

int64_t q3_view_rows(const q3_view *v) {
    int64_t n = 1; /* the view exists: its element count fits */
    for (int d = 0; d + 1 < v->ndim; d++) n *= v->shape[d];
    return n;
}

q3_status q3_view_check_rows(const q3_view *v, const char *arg, int64_t rows, int64_t cols, const char *cols_name,
                             q3_error *err) {
    if (v->ndim < 2 || (rows >= 0 && q3_view_rows(v) != rows) || v->shape[v->ndim - 1] != cols) {
        char got[128];
        q3_format_shape(got, sizeof got, v->ndim, v->shape);
        if (rows >= 0)
            return q3_fail(err, Q3_ERR_VALUE, "%s: expected shape [%lld, %s=%lld] (rows'), got %s", arg,
                           (long long)rows, cols_name, (long long)cols, got);
        return q3_fail(err, Q3_ERR_VALUE, "%s: expected shape [n, %s=%lld], got %s", arg, cols_name, (long long)cols,
                       got);
    }
    return q3_view_require(v, arg, Q3_NEED_CONTIGUOUS, err);
}

/* the bytes of a view of rows (contiguous: checked by its caller) */
static size_t view_bytes(const q3_view *v) {
    return (size_t)(q3_view_rows(v) * v->shape[v->ndim - 1]) * q3_dtype_size(v->dtype);
}

int q3_views_overlap(const q3_view *a, const q3_view *b) {
    const uintptr_t pa = (uintptr_t)a->data, pb = (uintptr_t)b->data;
    return pa < pb + view_bytes(b) && pb < pa + view_bytes(a) && view_bytes(a) && view_bytes(b);
}

q3_status q3_view_check_copy(const q3_view *v, int device, q3_error *err) {
    q3_status s = q3_view_require(v, "tensor", Q3_NEED_CONTIGUOUS, err);
    if (s != Q3_OK) return s;
    if ((v->device >= 0 || device >= 0) && !q3_device())
        return q3_fail(err, Q3_ERR_STATE, "device: the CUDA backend is not loaded");
    if (v->device >= 0 && device >= 0) /* the copies for the glue are host <-> device ones */
        return q3_fail(err, Q3_ERR_VALUE, "device: copies between two CUDA buffers are not supported here");
    return Q3_OK;
}

q3_status q3_view_of_bytes(q3_view *v, void *base, int64_t len, int64_t offset, q3_dtype dt, int ndim,
                           const int64_t *shape, q3_error *err) {
    memset(v, 0, sizeof *v);
    v->ndim = ndim, v->dtype = dt, v->device = -1, v->contiguous = 1;
    memcpy(v->shape, shape, (size_t)ndim * sizeof *shape);
    int64_t n, bytes, end;
    if (!q3_contiguous_strides(ndim, shape, q3_dtype_size(dt), v->strides)) {
        char got[160];
        q3_format_shape(got, sizeof got, ndim, shape);
        return q3_fail(err, Q3_ERR_VALUE, "shape: the size of %s overflows int64", got);
    }
    q3_numel(ndim, shape, &n); /* fits, and so do its bytes: the strides did */
    bytes = n * (int64_t)q3_dtype_size(dt);
    if (offset < 0 || !q3_add_i64(offset, bytes, &end) || end > len)
        return q3_fail(err, Q3_ERR_VALUE, "buffer: %lld bytes from offset %lld do not fit in a buffer of %lld bytes",
                       (long long)bytes, (long long)offset, (long long)len);
    v->data = (char *)base + offset;
    return Q3_OK;
}
