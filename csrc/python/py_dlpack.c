/* DLPack import: borrow a tensor from any producer (torch, numpy, cupy, ours) without a
 * copy. Protocol: ask __dlpack_device__ first (so a tensor on the wrong device is refused
 * before it is exported), then __dlpack__(max_version=(1, 0)) for a versioned capsule,
 * falling back to the legacy __dlpack__() for producers that predate max_version. The
 * capsule is renamed "used_..." once consumed; its deleter runs in q3_view_release. What a
 * tensor must be to be taken is the engine's to check (q3_view_from_dlpack, tensor_view.c). */
#include <string.h>

#include "py_glue.h"

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
        /* a producer older than DLPack 1.0 does not know max_version: asked again without it */
        PyErr_Clear();
        cap = PyDict_DelItemString(kw, "max_version") == 0 ? PyObject_Call(meth, args, kw) : NULL;
    }
    Py_XDECREF(args);
    Py_XDECREF(kw);
    Py_DECREF(meth);
    return cap;
}

int q3py_view_require(const q3_view *v, const char *arg, int need) {
    q3_error err;
    return q3py_status(q3_view_require(v, arg, need, &err), &err);
}

int q3_view_acquire_on(PyObject *obj, const char *arg, q3_view *v, int device, int allow, void *stream) {
    memset(v, 0, sizeof *v);
    int type, id;
    q3_error err;
    if (query_device(obj, arg, &type, &id) < 0) return -1;
    if (q3_view_check_device(type, id, device, allow, arg, &err) != Q3_OK) {
        q3_raise(NULL, &err);
        return -1;
    }
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
    if (q3_view_from_dlpack(v, t, arg, device, allow, &err) != Q3_OK) {
        q3_view_release(v);
        q3_raise(NULL, &err);
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

int q3py_views_acquire(q3py_arg_view *a, int n, int device, void *stream) {
    for (int i = 0; i < n; i++) memset(&a[i].view, 0, sizeof a[i].view);
    for (int i = 0; i < n; i++)
        if (a[i].obj && q3_view_acquire_on(a[i].obj, a[i].arg, &a[i].view, device, a[i].allow, stream) < 0) return -1;
    return 0;
}

void q3py_views_release(q3py_arg_view *a, int n) {
    while (n-- > 0) q3_view_release(&a[n].view);
}
