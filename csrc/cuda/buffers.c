/* Device memory and copies for the glue (q3_cuda.h): the blocks behind extension Tensors on a
 * CUDA device, with the kept blocks of dead ones reused by new ones of their size; a weight's
 * one-time copy into a block of the layer's device; synchronous and queued copies. Each
 * returns a status whose message is the CUDA runtime's own error string, so that the caller
 * names its argument around it. The kept blocks are not locked: their callers serialize (the
 * glue holds the GIL around them). */
#include <string.h>

#include "backend.h"

/* Device blocks of freed tensors, kept for the next tensor of the same size on the same
 * device (a decode step's output is the size of the last one's): cudaFree waits for the
 * whole device, so freeing an output every step would stall the caller's stream each time.
 * A block is reused by the next call's work on the caller's stream, after what was queued
 * there before, as torch's caching allocator does. */
#define KEPT_BLOCKS 16
#define KEPT_BYTES ((size_t)512 << 20)
static struct {
    void *p[KEPT_BLOCKS];
    size_t bytes[KEPT_BLOCKS];
    int device[KEPT_BLOCKS];
    int n;
    size_t total;
} kept;

/* the CUDA error of `code` (nonzero) in err, as Q3_ERR_STATE */
static q3_status cuda_failed(q3_error *err, int code) {
    return q3_fail(err, Q3_ERR_STATE, "%s", q3_cuda()->error_string(code));
}

static q3_status not_loaded(q3_error *err) {
    return q3_fail(err, Q3_ERR_STATE, "the CUDA backend is not loaded");
}

int q3_cuda_loaded(void) { return q3_cuda() != NULL; }

q3_status q3_cuda_require(const char *what, q3_error *err) {
    return q3_cuda() ? Q3_OK : q3_fail(err, Q3_ERR_STATE, "%s: the CUDA backend is not loaded", what);
}

void q3_device_free(void *p) {
    if (p && q3_cuda()) q3_cuda()->free_device(p);
}

void q3_device_release_kept(void) {
    for (int i = 0; i < kept.n; i++) q3_device_free(kept.p[i]);
    kept.n = 0;
    kept.total = 0;
}

/* drops kept block i (the others keep their order: oldest first) */
static void kept_drop(int i) {
    kept.total -= kept.bytes[i];
    kept.n--;
    memmove(&kept.p[i], &kept.p[i + 1], (size_t)(kept.n - i) * sizeof kept.p[0]);
    memmove(&kept.bytes[i], &kept.bytes[i + 1], (size_t)(kept.n - i) * sizeof kept.bytes[0]);
    memmove(&kept.device[i], &kept.device[i + 1], (size_t)(kept.n - i) * sizeof kept.device[0]);
}

int q3_device_kept(int i, int *device, size_t *bytes, void **p) {
    if (i >= 0 && i < kept.n) {
        *device = kept.device[i];
        *bytes = kept.bytes[i];
        *p = kept.p[i];
    }
    return kept.n;
}

q3_status q3_device_alloc(void **out, size_t bytes, int device, q3_error *err) {
    *out = NULL;
    bytes = bytes ? bytes : 4;
    for (int i = kept.n - 1; i >= 0; i--) /* the newest of the size first */
        if (kept.bytes[i] == bytes && kept.device[i] == device) {
            *out = kept.p[i];
            kept_drop(i);
            return Q3_OK;
        }
    const q3_cuda_ops *g = q3_cuda();
    if (!g) return not_loaded(err);
    int code = g->set_device(device);
    if (!code && g->malloc_device(out, bytes)) { /* the kept blocks may be what is missing */
        q3_device_release_kept();
        code = g->set_device(device);
        if (!code) code = g->malloc_device(out, bytes);
    }
    if (code) *out = NULL;
    return code ? cuda_failed(err, code) : Q3_OK;
}

void q3_device_keep(void *p, size_t bytes, int device) {
    bytes = bytes ? bytes : 4;
    if (bytes > KEPT_BYTES) { /* past the limit on its own */
        q3_device_free(p);
        return;
    }
    while (kept.n == KEPT_BLOCKS || kept.total + bytes > KEPT_BYTES) { /* the oldest make room */
        q3_device_free(kept.p[0]);
        kept_drop(0);
    }
    kept.p[kept.n] = p;
    kept.bytes[kept.n] = bytes;
    kept.device[kept.n] = device;
    kept.n++;
    kept.total += bytes;
}

q3_status q3_device_upload(void **out, int device, const void *src, int src_device, size_t bytes, q3_error *err) {
    *out = NULL;
    const q3_cuda_ops *g = q3_cuda();
    if (!g) return not_loaded(err);
    void *dev = NULL;
    int code = g->set_device(device);
    if (!code) code = g->malloc_device(&dev, bytes ? bytes : 1);
    if (!code && src_device >= 0) {
        /* on the legacy default stream, which the producer's export was asked to order its
         * work before (DLPack stream 1); then waited for, as the upload of a host weight is */
        code = g->copy_device_async(dev, src, bytes, NULL);
        if (!code) code = g->synchronize();
    } else if (!code) {
        code = g->copy(dev, src, bytes, 1);
    }
    if (code) {
        if (dev) g->free_device(dev);
        return cuda_failed(err, code);
    }
    *out = dev;
    return Q3_OK;
}

q3_status q3_device_copy(void *dst, const void *src, size_t bytes, int to_device, q3_error *err) {
    const q3_cuda_ops *g = q3_cuda();
    if (!g) return not_loaded(err);
    const int code = bytes ? g->copy(dst, src, bytes, to_device) : 0;
    return code ? cuda_failed(err, code) : Q3_OK;
}

q3_status q3_device_copy_async(void *dst, const void *src, size_t bytes, void *stream, q3_error *err) {
    const q3_cuda_ops *g = q3_cuda();
    if (!g) return not_loaded(err);
    const int code = g->copy_device_async(dst, src, bytes, stream);
    return code ? cuda_failed(err, code) : Q3_OK;
}

q3_status q3_device_synchronize(int device, q3_error *err) {
    const q3_cuda_ops *g = q3_cuda();
    if (!g) return not_loaded(err);
    int code = g->set_device(device);
    if (!code) code = g->synchronize();
    return code ? cuda_failed(err, code) : Q3_OK;
}

int q3_cuda_blas_open(const char *path) { return q3_cuda() && q3_cuda()->blas_open(path) == 0; }

int q3_cuda_blas_enable(int on) { return q3_cuda() ? q3_cuda()->blas_enable(on) : 0; }

/* ---- the memory of an extension Tensor ------------------------------------------------- */

size_t q3_tensor_bytes(q3_dtype dt, int ndim, const int64_t *shape) {
    size_t n = q3_dtype_size(dt);
    for (int d = 0; d < ndim; d++) n *= (size_t)shape[d];
    return n;
}

q3_status q3_tensor_alloc(void **out, q3_dtype dt, int ndim, const int64_t *shape, int64_t *strides, int device,
                          q3_error *err) {
    *out = NULL;
    if (!q3_contiguous_strides(ndim, shape, q3_dtype_size(dt), strides)) {
        char got[160];
        q3_format_shape(got, sizeof got, ndim, shape);
        return q3_fail(err, Q3_ERR_VALUE, "shape: %s has a negative dimension or a size that overflows int64", got);
    }
    const size_t bytes = q3_tensor_bytes(dt, ndim, shape); /* fits: the strides did */
    if (device < 0) *out = q3_alloc(bytes);
    else if (q3_device_alloc(out, bytes, device, err) != Q3_OK) *out = NULL;
    return *out ? Q3_OK : q3_fail(err, Q3_ERR_NOMEM, "out of memory");
}

void q3_tensor_free(void *p, q3_dtype dt, int ndim, const int64_t *shape, int device) {
    if (device < 0) q3_free(p);
    else if (p) q3_device_keep(p, q3_tensor_bytes(dt, ndim, shape), device);
}

q3_status q3_tensor_copy(void **out, int64_t *strides, const q3_view *v, int device, q3_error *err) {
    q3_status s = q3_view_check_copy(v, device, err);
    if (s != Q3_OK || (s = q3_tensor_alloc(out, v->dtype, v->ndim, v->shape, strides, device, err)) != Q3_OK)
        return s;
    const size_t bytes = q3_tensor_bytes(v->dtype, v->ndim, v->shape);
    if (v->device < 0 && device < 0) {
        memcpy(*out, v->data, bytes);
    } else if ((s = q3_device_copy(*out, v->data, bytes, device >= 0, err)) != Q3_OK) {
        q3_tensor_free(*out, v->dtype, v->ndim, v->shape, device);
        *out = NULL;
        char cause[sizeof err->msg];
        memcpy(cause, err->msg, sizeof cause);
        return q3_fail(err, Q3_ERR_STATE, "copy_tensor: %s", cause);
    }
    return Q3_OK;
}
