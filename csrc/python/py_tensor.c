/* qwen3layer Tensor: a block of extension memory, on the host or a CUDA device (a layer
 * output, random weights: q3_tensor_alloc, csrc/cuda/buffers.c) or a view of engine memory (a
 * KV-cache sequence), exported zero-copy through DLPack (the managed tensor is the engine's:
 * csrc/engine/dlpack_export.c). torch.from_dlpack(t) and numpy.from_dlpack(t) share its
 * memory; the consumer's reference keeps it alive, dropped by the deleter on any thread, with
 * or without the GIL. copy_tensor and buffer_view make Tensors too. */
#include <string.h>

#include "py_glue.h"

/* a Tensor object [shape] of dt at data on device, its strides copied; NULL when out of memory */
static q3py_tensor_object *tensor_alloc(q3_module_state *st, void *data, q3_dtype dt, int ndim, const int64_t *shape,
                                        const int64_t *strides, int device) {
    q3py_tensor_object *t = (q3py_tensor_object *)st->tensor_type->tp_alloc(st->tensor_type, 0); /* zeroed */
    if (!t) return NULL;
    t->data = data, t->ndim = ndim, t->dtype = dt, t->device = device;
    memcpy(t->shape, shape, (size_t)ndim * sizeof *shape);
    memcpy(t->strides, strides, (size_t)ndim * sizeof *strides);
    return t;
}

/* the Tensor owning a new block (q3_tensor_alloc, q3_tensor_copy: status s), else NULL with the
 * exception (MemoryError without a message when the block or the object cannot be had) */
static q3py_tensor_object *tensor_own(q3_module_state *st, q3_status s, const q3_error *err, void *block, q3_dtype dt,
                                      int ndim, const int64_t *shape, const int64_t *strides, int device) {
    if (s != Q3_OK) return (q3py_tensor_object *)(s == Q3_ERR_NOMEM ? PyErr_NoMemory() : q3_raise(NULL, err));
    q3py_tensor_object *t = tensor_alloc(st, block, dt, ndim, shape, strides, device);
    if (t) t->alloc = block;
    else q3_tensor_free(block, dt, ndim, shape, device);
    return t;
}

q3py_tensor_object *q3py_tensor_new_on(q3_module_state *st, q3_dtype dt, int ndim, const int64_t *shape, int device) {
    void *block;
    int64_t strides[Q3_MAX_DIM];
    q3_error err;
    const q3_status s = q3_tensor_alloc(&block, dt, ndim, shape, strides, device, &err);
    return tensor_own(st, s, &err, block, dt, ndim, shape, strides, device);
}

q3py_tensor_object *q3py_tensor_view(q3_module_state *st, PyObject *base, void *data, q3_dtype dt,
                                 int ndim, const int64_t *shape, const int64_t *strides) {
    q3py_tensor_object *t = tensor_alloc(st, data, dt, ndim, shape, strides, -1);
    if (t) t->base = Py_NewRef(base);
    return t;
}

/* t as the engine reads a tensor (read-only: a view of a read-only buffer) */
static q3_view tensor_as_view(const q3py_tensor_object *t) {
    q3_view v = {.data = t->data, .ndim = t->ndim, .dtype = t->dtype, .device = t->device,
                 .contiguous = q3_strides_contiguous(t->ndim, t->shape, t->strides),
                 .readonly = t->buffer.obj && t->buffer.readonly};
    memcpy(v.shape, t->shape, sizeof v.shape);
    memcpy(v.strides, t->strides, sizeof v.strides);
    return v;
}

static void tensor_dealloc(q3py_tensor_object *t) {
    PyTypeObject *tp = Py_TYPE(t);
    if (t->alloc) q3_tensor_free(t->alloc, t->dtype, t->ndim, t->shape, t->device);
    Py_XDECREF(t->base);
    PyBuffer_Release(&t->buffer); /* nothing where buffer.obj is NULL */
    PyObject_Free(t);
    Py_DECREF(tp);
}

/* buffer_view's dtype: float32, bfloat16, float16, or a checkpoint's float8_e4m3fn weights and
 * GPTQ int32 words (and a split layer's int32 expert ids) */
static int buffer_dtype(PyObject *obj, void *out) {
    q3_dtype *dt = out;
    const int named = PyUnicode_Check(obj);
    if (named && PyUnicode_CompareWithASCIIString(obj, "int32") == 0) *dt = Q3_I32;
    else if (named && PyUnicode_CompareWithASCIIString(obj, "float8_e4m3fn") == 0) *dt = Q3_E4M3;
    else return q3py_dtype(obj, out);
    return 1;
}

PyObject *q3py_buffer_view(PyObject *module, PyObject *args) {
    PyObject *obj;
    long long offset;
    q3py_shape shape = {.min_ndim = 0};
    q3_dtype dt;
    if (!PyArg_ParseTuple(args, "OLO&O&:buffer_view", &obj, &offset, q3py_shape_arg, &shape, buffer_dtype, &dt))
        return NULL;
    Py_buffer buf;
    if (PyObject_GetBuffer(obj, &buf, PyBUF_SIMPLE) < 0) return NULL;
    q3_view v;
    q3_error err;
    q3py_tensor_object *t = NULL;
    if (q3py_status(q3_view_of_bytes(&v, buf.buf, buf.len, offset, dt, shape.ndim, shape.dims, &err), &err) == 0 &&
        (t = tensor_alloc(q3py_state(module), v.data, dt, v.ndim, v.shape, v.strides, -1))) {
        t->buffer = buf; /* the view's to release */
        return (PyObject *)t;
    }
    PyBuffer_Release(&buf);
    return NULL;
}

/* copy_tensor(tensor, device): a contiguous copy on `device` (-1: host) of an extension Tensor
 * (host or device), or of another producer's host tensor (torch, numpy: any dtype the
 * extension has), which is how host data reaches the SIMT executor's device. What may be
 * copied where, and the copy, are below (q3_tensor_copy, csrc/cuda/buffers.c). */
PyObject *q3py_copy_tensor(PyObject *m, PyObject *args) {
    PyObject *obj;
    int device;
    if (!PyArg_ParseTuple(args, "Oi:copy_tensor", &obj, &device)) return NULL;
    q3_module_state *st = q3py_state(m);
    q3_view v = {0};
    if (PyObject_TypeCheck(obj, st->tensor_type)) {
        v = tensor_as_view((const q3py_tensor_object *)obj);
    } else if (!PyObject_HasAttrString(obj, "__dlpack__")) {
        return PyErr_Format(PyExc_TypeError, "tensor: expected a qwen3layer Tensor or a host tensor with __dlpack__ "
                            "(torch, numpy), got %.100s", Py_TYPE(obj)->tp_name);
    } else if (q3_view_acquire_on(obj, "tensor", &v, -1, Q3_VIEW_ANY, NULL)) {
        return NULL;
    }
    void *block;
    int64_t strides[Q3_MAX_DIM];
    q3_error err;
    const q3_status s = q3_tensor_copy(&block, strides, &v, device, &err);
    q3py_tensor_object *c = tensor_own(st, s, &err, block, v.dtype, v.ndim, v.shape, strides, device);
    q3_view_release(&v);
    return (PyObject *)c;
}

/* ---- export ------------------------------------------------------------------------ */

/* Drops the exported tensor's reference; runs on the consumer's thread, GIL or not. */
static void release_owner(void *owner) {
    if (!Py_IsInitialized()) return; /* interpreter gone: nothing left to release */
    PyGILState_STATE g = PyGILState_Ensure();
    Py_DECREF((PyObject *)owner);
    PyGILState_Release(g);
}

/* A capsule never consumed (not renamed "used_...") still owns its tensor. */
static void capsule_free(PyObject *cap) {
    const int versioned = PyCapsule_IsValid(cap, "dltensor_versioned");
    if (versioned || PyCapsule_IsValid(cap, "dltensor"))
        q3_dlpack_delete(PyCapsule_GetPointer(cap, versioned ? "dltensor_versioned" : "dltensor"), versioned);
}

static PyObject *make_capsule(q3py_tensor_object *t, int versioned, int copied) {
    void *managed;
    q3_error err;
    const q3_view v = tensor_as_view(t);
    if (q3_dlpack_export(&managed, &v, versioned, copied, t, release_owner, &err) != Q3_OK) return PyErr_NoMemory();
    Py_INCREF(t); /* the managed tensor's, dropped by its deleter */
    PyObject *cap = PyCapsule_New(managed, versioned ? "dltensor_versioned" : "dltensor", capsule_free);
    if (!cap) q3_dlpack_delete(managed, versioned);
    return cap;
}

static PyObject *tensor_dlpack(q3py_tensor_object *t, PyObject *args, PyObject *kw) {
    static char *names[] = {"stream", "max_version", "dl_device", "copy", NULL};
    PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
    int device[2], versioned;
    unsigned major = 0, minor;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$OOOO:__dlpack__", names, &stream, &max_version, &dl_device, &copy) ||
        (dl_device != Py_None && !PyArg_ParseTuple(dl_device, "ii", &device[0], &device[1])) ||
        (max_version != Py_None && !PyArg_ParseTuple(max_version, "II", &major, &minor)))
        return NULL;
    const int want_copy = copy != Py_None && PyObject_IsTrue(copy);
    const q3_view v = tensor_as_view(t);
    q3_error err;
    if (q3_dlpack_export_check(&v, stream != Py_None, dl_device != Py_None ? device : NULL, major, want_copy,
                               &versioned, &err) != Q3_OK)
        return PyErr_Format(PyExc_BufferError, "%s", err.msg);
    if (!want_copy) return make_capsule(t, versioned, 0);
    q3_module_state *st = q3_state_of_type(Py_TYPE(t));
    q3py_tensor_object *c = st ? q3py_tensor_new(st, t->dtype, t->ndim, t->shape) : NULL;
    if (!c) return NULL;
    q3_copy_strided(c->data, t->dtype, t->data, t->dtype, t->ndim, t->shape, t->strides);
    PyObject *cap = make_capsule(c, versioned, 1);
    Py_DECREF(c);
    return cap;
}

static PyObject *tensor_dlpack_device(q3py_tensor_object *t, PyObject *unused) {
    const q3_dl_device d = q3_dlpack_device(t->device);
    return Py_BuildValue("(ii)", d.device_type, d.device_id);
}

static PyObject *tensor_shape(q3py_tensor_object *t, void *c) { return q3py_int64s(t->shape, t->ndim, 0); }
static PyObject *tensor_strides(q3py_tensor_object *t, void *c) { return q3py_int64s(t->strides, t->ndim, 0); }
static PyObject *tensor_dtype(q3py_tensor_object *t, void *c) { return PyUnicode_FromString(q3_dtype_name(t->dtype)); }
static PyObject *tensor_ptr(q3py_tensor_object *t, void *c) { return PyLong_FromVoidPtr(t->data); }
static PyObject *tensor_device(q3py_tensor_object *t, void *c) { return q3py_device_name(t->device); }
static PyObject *tensor_nbytes(q3py_tensor_object *t, void *c) {
    return PyLong_FromSize_t(q3_tensor_bytes(t->dtype, t->ndim, t->shape));
}

static PyObject *tensor_repr(q3py_tensor_object *t) {
    char shape[160], device[24];
    q3_format_shape(shape, sizeof shape, t->ndim, t->shape);
    q3_format_device(device, sizeof device, t->device);
    return PyUnicode_FromFormat("qwen3layer.Tensor(shape=%s, dtype=%s, device=%s%s)", shape, q3_dtype_name(t->dtype),
                                device, t->alloc ? "" : ", view");
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
    {"dtype", (getter)tensor_dtype, NULL, "'float32', 'bfloat16' or 'float16'", NULL},
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
