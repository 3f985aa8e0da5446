/* DLPack import: borrow a tensor from any producer (torch, numpy, cupy, ours) without a copy.
 * Protocol: ask __dlpack_device__ first (so a tensor on the wrong device is refused before it is
 * exported), then __dlpack__(max_version=(1, 0)) for a versioned capsule, falling back to the
 * legacy __dlpack__() for producers that predate max_version; a capsule itself (unused) is taken
 * without either call (its device checked with the rest; its stream was its maker's choice). The
 * capsule is renamed "used_..." once consumed; its deleter runs in q3_view_release. What a tensor
 * must be to be taken is the engine's to check (q3_view_from_managed, dlpack_export.c). */
#include <string.h>

#include "py_glue.h"

int q3py_dlpack_device(PyObject *obj, const char *arg, int *type, int *id) {
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
    if (!ok) PyErr_Format(PyExc_TypeError, "%s: __dlpack_device__ did not return (device_type, id)", arg);
    return ok ? 0 : -1;
}

static PyObject *export_capsule(PyObject *obj, int cuda, void *stream) {
    PyObject *meth = PyObject_GetAttrString(obj, "__dlpack__");
    if (!meth) return NULL;
    /* CUDA: the stream the consumer will use (1 is the legacy default stream, per DLPack) */
    PyObject *kw = cuda ? Py_BuildValue("{s:(ii),s:K}", "max_version", Q3_DL_MAJOR, Q3_DL_MINOR, "stream",
                                        (unsigned long long)(stream ? (uintptr_t)stream : 1))
                        : Py_BuildValue("{s:(ii)}", "max_version", Q3_DL_MAJOR, Q3_DL_MINOR);
    PyObject *cap = kw ? PyObject_VectorcallDict(meth, NULL, 0, kw) : NULL;
    if (!cap && PyErr_ExceptionMatches(PyExc_TypeError)) {
        /* a producer older than DLPack 1.0 does not know max_version: asked again without it */
        PyErr_Clear();
        cap = PyDict_DelItemString(kw, "max_version") == 0 ? PyObject_VectorcallDict(meth, NULL, 0, kw) : NULL;
    }
    Py_XDECREF(kw);
    Py_DECREF(meth);
    return cap;
}

int q3_view_acquire_on(PyObject *obj, const char *arg, q3_view *v, int device, int allow, void *stream) {
    memset(v, 0, sizeof *v);
    int type, id;
    q3_error err;
    const int given = PyCapsule_CheckExact(obj); /* (torch's export of a host tensor: ~6 us of Python) */
    if (!given && (q3py_dlpack_device(obj, arg, &type, &id) < 0 ||
                   q3py_status(q3_view_check_device(type, id, device, allow, arg, &err), &err) < 0))
        return -1;
    PyObject *cap = given ? Py_NewRef(obj) : export_capsule(obj, type != Q3_DL_CPU, stream);
    if (!cap) return -1;
    const int versioned = PyCapsule_IsValid(cap, "dltensor_versioned");
    if (!versioned && !PyCapsule_IsValid(cap, "dltensor")) {
        PyErr_Format(PyExc_TypeError, "%s: %s, got %R", arg,
                     given ? "expected an unused DLPack capsule" : "__dlpack__ did not return a DLPack capsule", cap);
        Py_DECREF(cap);
        return -1;
    }
    const q3_status s = q3_view_from_managed(v, PyCapsule_GetPointer(cap, versioned ? "dltensor_versioned" : "dltensor"),
                                             versioned, arg, device, allow, &err);
    if (v->managed) PyCapsule_SetName(cap, versioned ? "used_dltensor_versioned" : "used_dltensor"); /* taken */
    Py_DECREF(cap); /* one not taken is still its destructor's */
    if (s == Q3_OK) return 0;
    if (v->managed) q3_raise(NULL, &err); /* kept while the view is released below */
    else PyErr_SetString(PyExc_BufferError, err.msg); /* another DLPack version, not taken */
    q3_view_release(v);
    return -1;
}

void q3_view_release(q3_view *v) {
    if (!v->managed) return;
    /* a deleter may run Python code (a producer written with ctypes): never with our
     * exception pending, which it would fail on or replace (and one it raises is dropped) */
    q3_pending_error e;
    q3_error_stash(&e);
    q3_dlpack_delete(v->managed, v->versioned);
    v->managed = NULL;
    q3_error_unstash(&e);
}

int q3py_views_acquire(q3py_arg_view *a, int n, int device, void *stream) {
    for (int i = 0; i < n; i++) memset(&a[i].view, 0, sizeof a[i].view);
    for (int i = 0; i < n; i++)
        if (a[i].obj && q3_view_acquire_on(a[i].obj, a[i].arg, &a[i].view, device, a[i].allow, stream) < 0) return -1;
    return 0;
}

void q3py_views_release(q3py_arg_view *a, int n) {
    while (n-- > 0) q3_view_release(&a[n].view);
}
