/* DLPack beside the import of tensor_view.c: the export of a tensor the extension owns (a
 * Tensor of the glue) and the handling of a consumed capsule's managed tensor. What a
 * __dlpack__ call may be given is decided here; the glue parses its arguments, wraps the
 * managed tensor in a capsule and raises. The export is one calloc'd block (the managed
 * struct, shape and strides); its deleter may run on any thread. */
#include <stdlib.h>
#include <string.h>

#include "q3.h"

q3_status q3_dlpack_export_check(const q3_view *v, int stream_given, const int *dl_device, unsigned max_major,
                                 int copy, int *versioned, q3_error *err) {
    /* a CUDA tensor's work was queued on its caller's stream: a consumer on that stream (the
     * usual case) needs no synchronisation, so any stream is accepted */
    if (stream_given && v->device < 0) return q3_fail(err, Q3_ERR_VALUE, "stream: expected None for a cpu tensor");
    if (dl_device && (v->device < 0 ? dl_device[0] != Q3_DL_CPU
                                    : dl_device[0] != Q3_DL_CUDA || dl_device[1] != v->device))
        return q3_fail(err, Q3_ERR_VALUE, "dl_device: this tensor cannot be exported to device type %d:%d without a "
                       "copy", dl_device[0], dl_device[1]);
    *versioned = max_major >= Q3_DL_MAJOR;
    /* the legacy capsule cannot say read-only: its consumer would write into the file */
    if (!copy && !*versioned && v->readonly)
        return q3_fail(err, Q3_ERR_VALUE, "this tensor is a view of read-only memory, which a legacy DLPack capsule "
                       "cannot mark read-only: export it with max_version >= (1, 0), or with copy=True");
    if (copy && v->device >= 0)
        return q3_fail(err, Q3_ERR_VALUE, "copy: copies of CUDA tensors are not supported; copy with the consumer");
    return Q3_OK;
}

/* the export block: the managed struct first (its deleter gets the block's address) */
typedef struct {
    union {
        q3_dl_managed_v v;
        q3_dl_managed legacy;
    } m;
    void (*release)(void *owner);
    int64_t shape[Q3_MAX_DIM], strides[Q3_MAX_DIM];
} export_block;

static void delete_versioned(q3_dl_managed_v *m) {
    ((export_block *)m)->release(m->manager_ctx);
    free(m);
}

static void delete_legacy(q3_dl_managed *m) {
    ((export_block *)m)->release(m->manager_ctx);
    free(m);
}

q3_dl_device q3_dlpack_device(int device) {
    return device < 0 ? (q3_dl_device){Q3_DL_CPU, 0} : (q3_dl_device){Q3_DL_CUDA, device};
}

static q3_dl_dtype dl_dtype(q3_dtype dt) {
    switch (dt) {
    case Q3_BF16: return (q3_dl_dtype){Q3_DL_BFLOAT, 16, 1};
    case Q3_E4M3: return (q3_dl_dtype){Q3_DL_FLOAT8_E4M3FN, 8, 1};
    case Q3_I32: return (q3_dl_dtype){Q3_DL_INT, 32, 1};
    case Q3_F16: return (q3_dl_dtype){Q3_DL_FLOAT, 16, 1};
    case Q3_BOOL: return (q3_dl_dtype){Q3_DL_BOOL, 8, 1};
    case Q3_I64: return (q3_dl_dtype){Q3_DL_INT, 64, 1};
    default: return (q3_dl_dtype){Q3_DL_FLOAT, 32, 1};
    }
}

q3_status q3_dlpack_export(void **managed, const q3_view *v, int versioned, int copied, void *owner,
                           void (*release)(void *owner), q3_error *err) {
    *managed = NULL;
    if (v->ndim < 0 || v->ndim > Q3_MAX_DIM)
        return q3_fail(err, Q3_ERR_VALUE, "export: expected at most %d dimensions, got %d", Q3_MAX_DIM, v->ndim);
    export_block *e = calloc(1, sizeof *e);
    if (!e) return q3_fail(err, Q3_ERR_NOMEM, "export: out of memory");
    memcpy(e->shape, v->shape, sizeof e->shape);
    memcpy(e->strides, v->strides, sizeof e->strides);
    e->release = release;
    const q3_dl_tensor t = {.data = v->data, .device = q3_dlpack_device(v->device), .ndim = v->ndim,
                            .dtype = dl_dtype(v->dtype), .shape = e->shape, .strides = e->strides};
    if (versioned) {
        e->m.v = (q3_dl_managed_v){.version = {Q3_DL_MAJOR, Q3_DL_MINOR}, .manager_ctx = owner,
                                   .deleter = delete_versioned, .dl_tensor = t,
                                   .flags = (copied ? Q3_DL_FLAG_IS_COPIED : 0) |
                                            (v->readonly ? Q3_DL_FLAG_READ_ONLY : 0)};
    } else {
        e->m.legacy = (q3_dl_managed){.dl_tensor = t, .manager_ctx = owner, .deleter = delete_legacy};
    }
    *managed = e;
    return Q3_OK;
}

void q3_dlpack_delete(void *managed, int versioned) {
    if (!managed) return;
    if (versioned) {
        q3_dl_managed_v *m = managed;
        if (m->deleter) m->deleter(m);
    } else {
        q3_dl_managed *m = managed;
        if (m->deleter) m->deleter(m);
    }
}

q3_status q3_view_from_managed(q3_view *v, void *managed, int versioned, const char *arg, int device, int allow,
                               q3_error *err) {
    const q3_dl_managed_v *mv = managed;
    if (versioned && mv->version.major != Q3_DL_MAJOR)
        return q3_fail(err, Q3_ERR_VALUE, "%s: DLPack version %u.%u is not supported (expected 1.x)", arg,
                       mv->version.major, mv->version.minor);
    v->managed = managed;
    v->versioned = versioned;
    v->readonly = versioned && (mv->flags & Q3_DL_FLAG_READ_ONLY) != 0;
    return q3_view_from_dlpack(v, versioned ? &mv->dl_tensor : &((const q3_dl_managed *)managed)->dl_tensor, arg,
                               device, allow, err);
}
