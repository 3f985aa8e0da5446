/* The glue's shared conversions (py_convert.h): engine statuses to exceptions, the arguments
 * many calls take (dtype, stream, seq), the MoE paths' names. */
#include <string.h>

#include "py_glue.h"

PyObject *q3_raise(q3_module_state *st, const q3_error *err) {
    PyObject *type = PyExc_RuntimeError;
    switch (err->status) {
    case Q3_ERR_VALUE: type = PyExc_ValueError; break;
    case Q3_ERR_TYPE: type = PyExc_TypeError; break;
    case Q3_ERR_INDEX: type = PyExc_IndexError; break;
    case Q3_ERR_CACHE_FULL: type = st ? st->cache_full_error : PyExc_RuntimeError; break;
    case Q3_ERR_NOMEM: type = PyExc_MemoryError; break;
    default: break;
    }
    PyErr_SetString(type, err->msg);
    return NULL;
}

int q3py_status(q3_status s, const q3_error *err) {
    if (s == Q3_OK) return 0;
    q3_raise(NULL, err);
    return -1;
}

int q3_parse_dtype(PyObject *obj, const char *arg, q3_dtype *out) {
    const char *s = PyUnicode_Check(obj) ? PyUnicode_AsUTF8(obj) : NULL;
    if (s && (!strcmp(s, "float32") || !strcmp(s, "fp32"))) *out = Q3_F32;
    else if (s && (!strcmp(s, "bfloat16") || !strcmp(s, "bf16"))) *out = Q3_BF16;
    else {
        PyObject *r = PyObject_Repr(obj);
        PyErr_Format(PyExc_TypeError, "%s: expected 'float32' or 'bfloat16', got %S", arg, r);
        Py_XDECREF(r);
        return -1;
    }
    return 0;
}


int q3py_dtype(PyObject *obj, void *out) { return q3_parse_dtype(obj, "dtype", out) == 0; }

int q3py_stream(PyObject *obj, void *out) {
    void **stream = out;
    *stream = NULL;
    if (obj == Py_None) return 1;
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "stream: expected an int (a cudaStream_t) or None, got %.100s",
                     Py_TYPE(obj)->tp_name);
        return 0;
    }
    *stream = PyLong_AsVoidPtr(obj);
    return *stream || !PyErr_Occurred();
}

int q3py_stream_on(PyObject *obj, int device, const char *cpu_object, void **out) {
    *out = NULL;
    if (obj != Py_None && device < 0) {
        PyErr_Format(PyExc_ValueError, "stream: expected None for %s", cpu_object);
        return -1;
    }
    return q3py_stream(obj, out) ? 0 : -1;
}

int q3py_shape_arg(PyObject *obj, void *out) {
    q3py_shape *shape = out;
    PyObject *seq = PySequence_Fast(obj, "shape: expected a sequence of ints");
    if (!seq) return 0;
    const Py_ssize_t ndim = PySequence_Fast_GET_SIZE(seq);
    int ok = ndim >= shape->min_ndim && ndim <= Q3_MAX_DIM;
    for (Py_ssize_t d = 0; ok && d < ndim; d++) {
        shape->dims[d] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, d));
        ok = shape->dims[d] >= 0 && !PyErr_Occurred();
    }
    Py_DECREF(seq);
    const char *range = shape->min_ndim ? "1 to" : "at most";
    if (!ok && PyErr_ExceptionMatches(PyExc_OverflowError)) {
        PyErr_Clear(); /* a dim past int64 is a bad shape like any other */
        PyErr_Format(PyExc_ValueError, "shape: expected %s %d non-negative ints of int64, got %R", range, Q3_MAX_DIM,
                     obj);
    } else if (!ok && !PyErr_Occurred()) {
        PyErr_Format(PyExc_ValueError, "shape: expected %s %d non-negative ints", range, Q3_MAX_DIM);
    }
    shape->ndim = (int)ndim;
    return ok;
}

int q3py_seq(PyObject *obj, int batch, int *seq) {
    if (!PyLong_Check(obj) || PyBool_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "seq: expected an int, got %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    int overflow;
    const long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow || v < INT32_MIN || v > INT32_MAX) { /* past an int: the engine's range test cannot see it */
        PyErr_Format(PyExc_IndexError, "seq: expected 0 <= seq < %d (the cache's batch), got %R", batch, obj);
        return -1;
    }
    *seq = (int)v; /* the range: the engine's check of the call */
    return 0;
}

int q3py_held_experts(PyObject *obj, int E, uint8_t **held) {
    *held = NULL;
    PyObject *seq = PySequence_Fast(obj, "experts: expected a sequence of expert ids (ints) or None");
    if (!seq) return -1;
    uint8_t *h = PyMem_Calloc((size_t)E, 1);
    if (!h) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        long long e = -1;
        if (PyLong_Check(item) && !PyBool_Check(item)) {
            int overflow;
            e = PyLong_AsLongLongAndOverflow(item, &overflow);
            if (overflow) e = -1;
        } else {
            PyErr_Format(PyExc_TypeError, "experts[%zd]: expected an int, got %.100s", i, Py_TYPE(item)->tp_name);
        }
        if (!PyErr_Occurred() && (e < 0 || e >= E))
            PyErr_Format(PyExc_ValueError, "experts[%zd]: expected an expert id in [0, %d) (num_experts), got %R", i,
                         E, item);
        if (!PyErr_Occurred() && h[e])
            PyErr_Format(PyExc_ValueError, "experts[%zd]: expert %lld appears twice", i, e);
        if (PyErr_Occurred()) {
            PyMem_Free(h);
            Py_DECREF(seq);
            return -1;
        }
        h[e] = 1;
    }
    Py_DECREF(seq);
    *held = h;
    return 0;
}
