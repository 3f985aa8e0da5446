/* DLPack import: borrow a tensor from any producer (torch, numpy, cupy, ours) without a
 * copy. Protocol: ask __dlpack_device__ first (so a tensor on the wrong device is refused
 * before it is exported), then __dlpack__(max_version=(1, 0)) for a versioned capsule,
 * falling back to the legacy __dlpack__() for producers that predate max_version. The
 * capsule is renamed "used_..." once consumed; its deleter runs in q3_view_release. */
#include <string.h>

#include "dlpack_abi.h"
#include "py_glue.h"

static const char *device_name(int type) {
    switch (type) {
    case Q3_DL_CPU: return "cpu";
    case Q3_DL_CUDA: return "cuda";
    case Q3_DL_CUDA_HOST: return "cuda_host";
    case Q3_DL_CUDA_MANAGED: return "cuda_managed";
    default: return "device_type";
    }
}

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

void q3_format_shape(char *buf, size_t n, int ndim, const int64_t *shape) {
    size_t used = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < ndim && used < n; i++)
        used += (size_t)snprintf(buf + used, n - used, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (used < n) snprintf(buf + used, n - used, "]");
}

/* (device_type, device_id) of obj, or -1 with TypeError for a non-tensor */
static int query_device(PyObject *obj, const char *arg, int *type, int *id) {
    PyObject *dev = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
    if (!dev) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "%s: expected a tensor with __dlpack__ (torch.Tensor, numpy.ndarray, ...), "
                         "got %.200s", arg, Py_TYPE(obj)->tp_name);
        }
        return -1;
    }
    const int ok = PyArg_ParseTuple(dev, "ii", type, id);
    Py_DECREF(dev);
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s: __dlpack_device__ did not return (device_type, id)", arg);
        return -1;
    }
    return 0;
}

static PyObject *export_capsule(PyObject *obj, int cuda, void *stream) {
    PyObject *meth = PyObject_GetAttrString(obj, "__dlpack__");
    if (!meth) return NULL;
    PyObject *args = PyTuple_New(0);
    /* CUDA: the stream the consumer will use (1 is the legacy default stream, per DLPack) */
    PyObject *kw = cuda ? Py_BuildValue("{s:(ii),s:K}", "max_version", Q3_DL_MAJOR, Q3_DL_MINOR, "stream",
                                        (unsigned long long)(stream ? (uintptr_t)stream : 1))
                        : Py_BuildValue("{s:(ii)}", "max_version", Q3_DL_MAJOR, Q3_DL_MINOR);
    PyObject *cap = args && kw ? PyObject_Call(meth, args, kw) : NULL;
    if (!cap && PyErr_ExceptionMatches(PyExc_TypeError)) {
        /* a producer older than DLPack 1.0 does not know max_version */
        PyErr_Clear();
        if (cuda) {
            PyObject *kw_legacy = Py_BuildValue("{s:K}", "stream", (unsigned long long)(stream ? (uintptr_t)stream : 1));
            cap = kw_legacy && args ? PyObject_Call(meth, args, kw_legacy) : NULL;
            Py_XDECREF(kw_legacy);
        } else {
            cap = PyObject_CallNoArgs(meth);
        }
    }
    Py_XDECREF(args);
    Py_XDECREF(kw);
    Py_DECREF(meth);
    return cap;
}

/* "cpu" or "cuda:N" */
static void want_name(char *buf, size_t n, int device) {
    if (device < 0) snprintf(buf, n, "cpu");
    else snprintf(buf, n, "cuda:%d", device);
}

static int device_fits(int type, int id, int device, int allow_host) {
    if (type == Q3_DL_CPU) return device < 0 || allow_host;
    return type == Q3_DL_CUDA && device >= 0 && id == device;
}

static int wrong_device(const char *arg, int type, int id, int device) {
    char want[24];
    want_name(want, sizeof want, device);
    if (type == Q3_DL_CPU) PyErr_Format(PyExc_ValueError, "%s: expected a tensor on device %s, got cpu", arg, want);
    else PyErr_Format(PyExc_ValueError, "%s: expected a tensor on device %s, got %s:%d", arg, want, device_name(type), id);
    return -1;
}

static int fill_view(q3_view *v, const q3_dl_tensor *t, const char *arg, int device, int allow) {
    char desc[64];
    if (!device_fits(t->device.device_type, t->device.device_id, device, allow & Q3_VIEW_HOST))
        return wrong_device(arg, t->device.device_type, t->device.device_id, device);
    v->device = t->device.device_type == Q3_DL_CPU ? -1 : t->device.device_id;
    if (allow & Q3_VIEW_I32) { /* int32 only: the router's chosen experts (py_routing.c) */
        if (t->dtype.lanes != 1 || t->dtype.code != Q3_DL_INT || t->dtype.bits != 32) {
            dtype_desc(desc, sizeof desc, t->dtype);
            PyErr_Format(PyExc_TypeError, "%s: expected dtype int32, got %s", arg, desc);
            return -1;
        }
        v->dtype = Q3_I32;
    } else if (t->dtype.lanes == 1 && t->dtype.code == Q3_DL_FLOAT && t->dtype.bits == 32) v->dtype = Q3_F32;
    else if (t->dtype.lanes == 1 && t->dtype.code == Q3_DL_BFLOAT && t->dtype.bits == 16) v->dtype = Q3_BF16;
    else if ((allow & (Q3_VIEW_E4M3 | Q3_VIEW_ANY)) && t->dtype.lanes == 1 &&
             t->dtype.code == Q3_DL_FLOAT8_E4M3FN && t->dtype.bits == 8)
        v->dtype = Q3_E4M3;
    else if ((allow & Q3_VIEW_ANY) && t->dtype.lanes == 1 && t->dtype.code == Q3_DL_INT && t->dtype.bits == 32)
        v->dtype = Q3_I32;
    else {
        dtype_desc(desc, sizeof desc, t->dtype);
        PyErr_Format(PyExc_TypeError, "%s: expected dtype %s, got %s", arg,
                     allow & Q3_VIEW_ANY    ? "float32, bfloat16, float8_e4m3fn or int32"
                     : allow & Q3_VIEW_E4M3 ? "float32, bfloat16 or float8_e4m3fn"
                                            : "float32 or bfloat16",
                     desc);
        return -1;
    }
    if (t->ndim < 0 || t->ndim > Q3_MAX_DIM) {
        PyErr_Format(PyExc_ValueError, "%s: expected at most %d dimensions, got %d", arg, Q3_MAX_DIM,
                     (int)t->ndim);
        return -1;
    }
    v->ndim = t->ndim;
    v->data = (char *)t->data + t->byte_offset;
    if ((uintptr_t)v->data % q3_dtype_size(v->dtype)) { /* kernels load whole elements, vectors even */
        PyErr_Format(PyExc_ValueError, "%s: expected data aligned to its %zu-byte elements, got address %p", arg,
                     q3_dtype_size(v->dtype), v->data);
        return -1;
    }
    for (int d = 0; d < v->ndim; d++) v->shape[d] = t->shape[d];
    int64_t n;
    if (!q3_numel(v->ndim, v->shape, &n)) {
        char got[160];
        q3_format_shape(got, sizeof got, v->ndim, v->shape);
        for (int d = 0; d < v->ndim; d++)
            if (v->shape[d] < 0) {
                PyErr_Format(PyExc_ValueError, "%s: expected non-negative dimensions, got %s", arg, got);
                return -1;
            }
        PyErr_Format(PyExc_ValueError, "%s: the element count of shape %s overflows int64", arg, got);
        return -1;
    }
    /* the farthest element, in bytes, must be addressable: strides that overflow are refused
     * (the producer's pointer itself cannot be checked) */
    int64_t expect = 1, reach = 0;
    for (int d = v->ndim - 1; d >= 0; d--) {
        v->strides[d] = t->strides ? t->strides[d] : expect;
        /* an empty tensor reaches nothing */
        const int64_t stride = v->strides[d] < 0 && v->strides[d] > INT64_MIN ? -v->strides[d] : v->strides[d];
        int64_t step;
        if (n > 0 && (stride < 0 || !q3_mul_i64(v->shape[d] - 1, stride, &step) || !q3_add_i64(reach, step, &reach))) {
            PyErr_Format(PyExc_ValueError, "%s: strides that overflow int64 at dimension %d (stride %lld)", arg, d,
                         (long long)v->strides[d]);
            return -1;
        }
        if (!q3_mul_i64(expect, v->shape[d], &expect)) expect = INT64_MAX; /* only with a 0 dim: n == 0 */
    }
    v->contiguous = q3_strides_contiguous(v->ndim, v->shape, v->strides);
    if (n > 0 && (!q3_add_i64(reach, 1, &reach) || !q3_mul_i64(reach, (int64_t)q3_dtype_size(v->dtype), &reach))) {
        PyErr_Format(PyExc_ValueError, "%s: a tensor spanning more than 2^63 bytes (its size overflows)", arg);
        return -1;
    }
    return 0;
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

int q3py_view_require(const q3_view *v, const char *arg, int need) {
    if ((need & Q3_NEED_CONTIGUOUS) && !v->contiguous) {
        char st[128];
        q3_format_shape(st, sizeof st, v->ndim, v->strides);
        PyErr_Format(PyExc_ValueError, "%s: expected a contiguous tensor, got strides %s (call .contiguous())", arg, st);
        return -1;
    }
    if ((need & Q3_NEED_WRITABLE) && v->readonly) {
        PyErr_Format(PyExc_ValueError, "%s: expected a writable tensor, got a read-only one", arg);
        return -1;
    }
    return 0;
}

int q3_view_acquire_on(PyObject *obj, const char *arg, q3_view *v, int device, int allow, void *stream) {
    memset(v, 0, sizeof *v);
    int type, id;
    if (query_device(obj, arg, &type, &id) < 0) return -1;
    if (!device_fits(type, id, device, allow & Q3_VIEW_HOST)) return wrong_device(arg, type, id, device);
    PyObject *cap = export_capsule(obj, type != Q3_DL_CPU, stream);
    if (!cap) return -1;
    const q3_dl_tensor *t = NULL;
    if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
        q3_dl_managed_v *m = PyCapsule_GetPointer(cap, "dltensor_versioned");
        if (m->version.major != Q3_DL_MAJOR) {
            PyErr_Format(PyExc_BufferError, "%s: DLPack version %u.%u is not supported (expected 1.x)",
                         arg, m->version.major, m->version.minor);
            Py_DECREF(cap); /* the capsule's destructor still owns it */
            return -1;
        }
        PyCapsule_SetName(cap, "used_dltensor_versioned");
        v->managed = m;
        v->versioned = 1;
        v->readonly = (m->flags & Q3_DL_FLAG_READ_ONLY) != 0;
        t = &m->dl_tensor;
    } else if (PyCapsule_IsValid(cap, "dltensor")) {
        q3_dl_managed *m = PyCapsule_GetPointer(cap, "dltensor");
        PyCapsule_SetName(cap, "used_dltensor");
        v->managed = m;
        t = &m->dl_tensor;
    } else {
        Py_DECREF(cap);
        PyErr_Format(PyExc_TypeError, "%s: __dlpack__ did not return a DLPack capsule", arg);
        return -1;
    }
    Py_DECREF(cap);
    if (fill_view(v, t, arg, device, allow) < 0) {
        q3_view_release(v);
        return -1;
    }
    return 0;
}

void q3_view_release(q3_view *v) {
    if (!v->managed) return;
    /* a deleter may run Python code (a producer written with ctypes): never with our
     * exception pending, which it would fail on or replace */
    const int pending = PyErr_Occurred() != NULL;
    q3_pending_error e;
    if (pending) q3_error_stash(&e);
    if (v->versioned) {
        q3_dl_managed_v *m = v->managed;
        if (m->deleter) m->deleter(m);
    } else {
        q3_dl_managed *m = v->managed;
        if (m->deleter) m->deleter(m);
    }
    v->managed = NULL;
    if (pending) q3_error_unstash(&e);
}
