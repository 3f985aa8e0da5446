/* qwen3layer Tensor: a block of extension memory, on the host or a CUDA device (a layer
 * output, random weights) or a view of engine memory (a KV-cache sequence), exported
 * zero-copy through DLPack.
 * torch.from_dlpack(t) and numpy.from_dlpack(t) share its memory; the consumer's
 * reference keeps it alive. Export allocates one block for the managed struct, shape and
 * strides; its deleter may run on any thread, with or without the GIL. */
#include <stdlib.h>
#include <string.h>

#include "py_glue.h"

static size_t tensor_bytes(const q3py_tensor_object *t) {
    size_t n = q3_dtype_size(t->dtype);
    for (int d = 0; d < t->ndim; d++) n *= (size_t)t->shape[d];
    return n;
}

static q3py_tensor_object *tensor_alloc(q3_module_state *st, q3_dtype dt, int ndim, const int64_t *shape) {
    q3py_tensor_object *t = (q3py_tensor_object *)st->tensor_type->tp_alloc(st->tensor_type, 0); /* zeroed */
    if (!t) return NULL;
    t->ndim = ndim;
    t->dtype = dt;
    t->device = -1;
    for (int d = 0; d < ndim; d++) t->shape[d] = shape[d];
    return t;
}

/* bytes of host memory, or a block of a CUDA device (csrc/cuda/buffers.c: a kept one of the
 * size when there is one); NULL when out of memory */
static void *buffer_alloc(size_t bytes, int device) {
    if (device < 0) return q3_alloc(bytes);
    void *p;
    q3_error err;
    return q3_device_alloc(&p, bytes, device, &err) == Q3_OK ? p : NULL;
}

q3py_tensor_object *q3py_tensor_new(q3_module_state *st, q3_dtype dt, int ndim, const int64_t *shape) {
    return q3py_tensor_new_on(st, dt, ndim, shape, -1);
}

q3py_tensor_object *q3py_tensor_new_on(q3_module_state *st, q3_dtype dt, int ndim, const int64_t *shape, int device) {
    q3py_tensor_object *t = tensor_alloc(st, dt, ndim, shape);
    if (!t) return NULL;
    if (!q3_contiguous_strides(ndim, shape, q3_dtype_size(dt), t->strides)) {
        char got[160];
        q3_format_shape(got, sizeof got, ndim, shape);
        PyErr_Format(PyExc_ValueError, "shape: %s has a negative dimension or a size that overflows int64", got);
        Py_DECREF(t);
        return NULL;
    }
    t->device = device;
    t->alloc = t->data = buffer_alloc(tensor_bytes(t), device);
    if (!t->alloc) {
        Py_DECREF(t);
        return (q3py_tensor_object *)PyErr_NoMemory();
    }
    return t;
}

q3py_tensor_object *q3py_tensor_view(q3_module_state *st, PyObject *base, void *data, q3_dtype dt,
                                 int ndim, const int64_t *shape, const int64_t *strides) {
    q3py_tensor_object *t = tensor_alloc(st, dt, ndim, shape);
    if (!t) return NULL;
    memcpy(t->strides, strides, (size_t)ndim * sizeof *strides);
    t->data = data;
    t->base = Py_NewRef(base);
    return t;
}

static void tensor_dealloc(q3py_tensor_object *t) {
    PyTypeObject *tp = Py_TYPE(t);
    if (t->alloc) {
        if (t->device < 0) q3_free(t->alloc);
        else q3_device_keep(t->alloc, tensor_bytes(t), t->device);
    }
    Py_XDECREF(t->base);
    if (t->buffer) {
        PyBuffer_Release(t->buffer);
        PyMem_Free(t->buffer);
    }
    PyObject_Free(t);
    Py_DECREF(tp);
}

PyObject *q3_buffer_view(PyObject *module, PyObject *args) {
    PyObject *obj;
    long long offset;
    q3py_shape shape = {.min_ndim = 0};
    q3_dtype dt;
    if (!PyArg_ParseTuple(args, "OLO&O&:buffer_view", &obj, &offset, q3py_shape_arg, &shape, q3py_buffer_dtype, &dt))
        return NULL;
    Py_buffer *buf = PyMem_Malloc(sizeof *buf);
    if (!buf) return PyErr_NoMemory();
    if (PyObject_GetBuffer(obj, buf, PyBUF_SIMPLE) < 0) {
        PyMem_Free(buf);
        return NULL;
    }
    q3_view v;
    q3_error err;
    q3py_tensor_object *t = NULL;
    if (q3py_status(q3_view_of_bytes(&v, buf->buf, buf->len, offset, dt, shape.ndim, shape.dims, &err), &err) == 0 &&
        (t = tensor_alloc(q3py_state(module), dt, v.ndim, v.shape))) {
        memcpy(t->strides, v.strides, sizeof v.strides);
        t->data = v.data;
        t->buffer = buf;
        return (PyObject *)t;
    }
    PyBuffer_Release(buf);
    PyMem_Free(buf);
    return NULL;
}

/* ---- export ------------------------------------------------------------------------ */

typedef struct {
    q3_dl_managed_v m;
    int64_t shape[Q3_MAX_DIM], strides[Q3_MAX_DIM];
} export_v;

typedef struct {
    q3_dl_managed m;
    int64_t shape[Q3_MAX_DIM], strides[Q3_MAX_DIM];
} export_legacy;

/* Drops the exported tensor's reference; runs on the consumer's thread, GIL or not. */
static void release_owner(void *owner) {
    if (!Py_IsInitialized()) return; /* interpreter gone: nothing left to release */
    PyGILState_STATE g = PyGILState_Ensure();
    Py_DECREF((PyObject *)owner);
    PyGILState_Release(g);
}

static void delete_v(q3_dl_managed_v *m) {
    release_owner(m->manager_ctx);
    free(m);
}

static void delete_legacy(q3_dl_managed *m) {
    release_owner(m->manager_ctx);
    free(m);
}

/* A capsule never consumed (not renamed "used_...") still owns its tensor. */
static void capsule_free(PyObject *cap) {
    if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
        q3_dl_managed_v *m = PyCapsule_GetPointer(cap, "dltensor_versioned");
        m->deleter(m);
    } else if (PyCapsule_IsValid(cap, "dltensor")) {
        q3_dl_managed *m = PyCapsule_GetPointer(cap, "dltensor");
        m->deleter(m);
    }
}

static void fill_dl(q3_dl_tensor *d, q3py_tensor_object *t, int64_t *shape, int64_t *strides) {
    memcpy(shape, t->shape, sizeof t->shape);
    memcpy(strides, t->strides, sizeof t->strides);
    d->data = t->data;
    d->device = t->device < 0 ? (q3_dl_device){Q3_DL_CPU, 0} : (q3_dl_device){Q3_DL_CUDA, t->device};
    d->ndim = t->ndim;
    d->dtype = t->dtype == Q3_BF16   ? (q3_dl_dtype){Q3_DL_BFLOAT, 16, 1}
               : t->dtype == Q3_E4M3 ? (q3_dl_dtype){Q3_DL_FLOAT8_E4M3FN, 8, 1}
               : t->dtype == Q3_I32  ? (q3_dl_dtype){Q3_DL_INT, 32, 1}
               : t->dtype == Q3_F16  ? (q3_dl_dtype){Q3_DL_FLOAT, 16, 1}
               : t->dtype == Q3_BOOL ? (q3_dl_dtype){Q3_DL_BOOL, 8, 1}
               : t->dtype == Q3_I64  ? (q3_dl_dtype){Q3_DL_INT, 64, 1}
                                     : (q3_dl_dtype){Q3_DL_FLOAT, 32, 1};
    d->shape = shape;
    d->strides = strides;
    d->byte_offset = 0;
}

static PyObject *make_capsule(q3py_tensor_object *t, int versioned, int copied) {
    if (versioned) {
        export_v *e = calloc(1, sizeof *e);
        if (!e) return PyErr_NoMemory();
        fill_dl(&e->m.dl_tensor, t, e->shape, e->strides);
        e->m.version = (q3_dl_version){Q3_DL_MAJOR, Q3_DL_MINOR};
        e->m.flags = (copied ? Q3_DL_FLAG_IS_COPIED : 0) | (t->buffer && t->buffer->readonly ? Q3_DL_FLAG_READ_ONLY : 0);
        e->m.manager_ctx = Py_NewRef(t);
        e->m.deleter = delete_v;
        PyObject *cap = PyCapsule_New(&e->m, "dltensor_versioned", capsule_free);
        if (!cap) delete_v(&e->m);
        return cap;
    }
    export_legacy *e = calloc(1, sizeof *e);
    if (!e) return PyErr_NoMemory();
    fill_dl(&e->m.dl_tensor, t, e->shape, e->strides);
    e->m.manager_ctx = Py_NewRef(t);
    e->m.deleter = delete_legacy;
    PyObject *cap = PyCapsule_New(&e->m, "dltensor", capsule_free);
    if (!cap) delete_legacy(&e->m);
    return cap;
}

static PyObject *tensor_dlpack(q3py_tensor_object *t, PyObject *args, PyObject *kw) {
    static char *names[] = {"stream", "max_version", "dl_device", "copy", NULL};
    PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$OOOO:__dlpack__", names, &stream, &max_version,
                                     &dl_device, &copy))
        return NULL;
    /* a CUDA tensor's work was queued on its caller's stream: a consumer on that stream (the
     * usual case) needs no synchronisation, so any stream is accepted */
    if (stream != Py_None && t->device < 0)
        return PyErr_Format(PyExc_BufferError, "stream: expected None for a cpu tensor");
    if (dl_device != Py_None) {
        int type, id;
        if (!PyArg_ParseTuple(dl_device, "ii", &type, &id)) return NULL;
        if (t->device < 0 ? type != Q3_DL_CPU : (type != Q3_DL_CUDA || id != t->device))
            return PyErr_Format(PyExc_BufferError, "dl_device: this tensor cannot be exported to device type %d:%d "
                                "without a copy", type, id);
    }
    int versioned = 0;
    if (max_version != Py_None) {
        unsigned major, minor;
        if (!PyArg_ParseTuple(max_version, "II", &major, &minor)) return NULL;
        versioned = major >= Q3_DL_MAJOR;
    }
    const int want_copy = copy != Py_None && PyObject_IsTrue(copy);
    /* the legacy capsule cannot say read-only: its consumer would write into the file */
    if (!want_copy && !versioned && t->buffer && t->buffer->readonly)
        return PyErr_Format(PyExc_BufferError, "this tensor is a view of read-only memory, which a legacy DLPack "
                            "capsule cannot mark read-only: export it with max_version >= (1, 0), or with copy=True");
    if (!want_copy) return make_capsule(t, versioned, 0);
    if (t->device >= 0)
        return PyErr_Format(PyExc_BufferError, "copy: copies of CUDA tensors are not supported; copy with the consumer");
    q3_module_state *st = q3_state_of_type(Py_TYPE(t));
    q3py_tensor_object *c = st ? q3py_tensor_new(st, t->dtype, t->ndim, t->shape) : NULL;
    if (!c) return NULL;
    q3_copy_strided(c->data, t->dtype, t->data, t->dtype, t->ndim, t->shape, t->strides);
    PyObject *cap = make_capsule(c, versioned, 1);
    Py_DECREF(c);
    return cap;
}

static PyObject *tensor_dlpack_device(q3py_tensor_object *t, PyObject *unused) {
    return t->device < 0 ? Py_BuildValue("(ii)", Q3_DL_CPU, 0) : Py_BuildValue("(ii)", Q3_DL_CUDA, t->device);
}

static PyObject *tensor_shape(q3py_tensor_object *t, void *c) { return q3py_int64s(t->shape, t->ndim, 0); }
static PyObject *tensor_strides(q3py_tensor_object *t, void *c) { return q3py_int64s(t->strides, t->ndim, 0); }
static PyObject *tensor_dtype(q3py_tensor_object *t, void *c) { return PyUnicode_FromString(q3_dtype_name(t->dtype)); }
static PyObject *tensor_ptr(q3py_tensor_object *t, void *c) { return PyLong_FromVoidPtr(t->data); }
static PyObject *tensor_device(q3py_tensor_object *t, void *c) { return q3py_device_name(t->device); }
static PyObject *tensor_nbytes(q3py_tensor_object *t, void *c) { return PyLong_FromSize_t(tensor_bytes(t)); }

static PyObject *tensor_repr(q3py_tensor_object *t) {
    char shape[160];
    q3_format_shape(shape, sizeof shape, t->ndim, t->shape);
    PyObject *dev = tensor_device(t, NULL);
    PyObject *r = dev ? PyUnicode_FromFormat("qwen3layer.Tensor(shape=%s, dtype=%s, device=%U%s)", shape,
                                             q3_dtype_name(t->dtype), dev, t->alloc ? "" : ", view")
                      : NULL;
    Py_XDECREF(dev);
    return r;
}

static PyMethodDef tensor_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))tensor_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None)\n--\n\n"
     "Export as a DLPack capsule (versioned when max_version >= (1, 0), else legacy)."},
    {"__dlpack_device__", (PyCFunction)tensor_dlpack_device, METH_NOARGS, "(device_type, device_id)"},
    {NULL},
};

static PyGetSetDef tensor_getset[] = {
    {"shape", (getter)tensor_shape, NULL, "dimensions", NULL},
    {"strides", (getter)tensor_strides, NULL, "strides in elements", NULL},
    {"dtype", (getter)tensor_dtype, NULL, "'float32' or 'bfloat16'", NULL},
    {"device", (getter)tensor_device, NULL, "'cpu' or 'cuda:N'", NULL},
    {"data_ptr", (getter)tensor_ptr, NULL, "address of the first element", NULL},
    {"nbytes", (getter)tensor_nbytes, NULL, "bytes covered by the elements", NULL},
    {NULL},
};

static PyType_Slot tensor_slots[] = {
    {Py_tp_dealloc, tensor_dealloc},
    {Py_tp_repr, tensor_repr},
    {Py_tp_methods, tensor_methods},
    {Py_tp_getset, tensor_getset},
    {Py_tp_doc, "Extension-owned tensor memory, exchanged zero-copy through DLPack."},
    {0, NULL},
};

PyType_Spec q3py_tensor_spec = {
    .name = "qwen3layer._C.Tensor",
    .basicsize = sizeof(q3py_tensor_object),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = tensor_slots,
};
