/* The glue's shared conversions (py_convert.h): engine statuses to exceptions, and every
 * argument converter the calls share or make (dtype, stream, seq, shape, chunk_size,
 * attention_limit, device, index lists, ints for the engine): the checks of
 * what a Python object is before it becomes a C value, in this one file. */
#include <string.h>

#include "py_glue.h"

PyObject *q3_raise(q3_module_state *st, const q3_error *err) {
    if (err->status == Q3_ERR_CALLER && PyErr_Occurred()) return NULL; /* the glue's own, raised already */
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
    else if (s && (!strcmp(s, "float16") || !strcmp(s, "fp16"))) *out = Q3_F16;
    else {
        PyErr_Format(PyExc_TypeError, "%s: expected 'float32', 'bfloat16' or 'float16', got %R", arg, obj);
        return -1;
    }
    return 0;
}

int q3py_dtype(PyObject *obj, void *out) { return q3_parse_dtype(obj, "dtype", out) == 0; }
int q3py_dtype_or_none(PyObject *obj, void *out) { return obj == Py_None || q3py_dtype(obj, out); }

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

/* None -> 0 (the engine's default chunk); else a positive int */
int q3py_chunk(PyObject *obj, int64_t *chunk) {
    *chunk = 0;
    const int given = q3py_int64(obj, "chunk_size", Q3PY_NONE_OK, "expected a positive int or None", chunk);
    if (given > 0 && *chunk <= 0)
        PyErr_Format(PyExc_ValueError, "chunk_size: expected a positive int or None, got %R", obj);
    return given < 0 || PyErr_Occurred() ? -1 : 0;
}

/* attention_limit: None -> dflt; else a non-negative int of bytes (past int64: no limit, more
 * than any machine has) */
int q3py_attention_limit(PyObject *obj, int64_t dflt, int64_t *limit) {
    *limit = dflt;
    const int given = q3py_int64(obj, "attention_limit", Q3PY_NONE_OK, NULL, limit);
    /* past int64 and above 0 (obj > False): no limit */
    if (given < 0 && PyErr_ExceptionMatches(PyExc_OverflowError) && PyObject_RichCompareBool(obj, Py_False, Py_GT) > 0) {
        PyErr_Clear();
        *limit = INT64_MAX;
    } else if (given > 0 && *limit < 0) {
        PyErr_Format(PyExc_ValueError, "attention_limit: expected a number of bytes >= 0 or None, got %R", obj);
    }
    return PyErr_Occurred() ? -1 : 0;
}

/* device: an int, -1 (the host) or a CUDA device (NULL: not given, -1); with the stream to
 * queue on */
int q3py_place(PyObject *device_obj, PyObject *stream_obj, int *device, void **stream) {
    const long d = !device_obj || !PyLong_Check(device_obj) || PyBool_Check(device_obj) ? -1 : PyLong_AsLong(device_obj);
    *device = d < -1 || d > 1024 ? -1 : (int)d;
    if (device_obj && (!PyLong_Check(device_obj) || PyBool_Check(device_obj)))
        PyErr_Format(PyExc_TypeError, "device: expected an int (-1: the host, else a CUDA device), got %.100s",
                     Py_TYPE(device_obj)->tp_name);
    else if (d < -1 || d > 1024)
        PyErr_Format(PyExc_ValueError, "device: expected -1 (the host) or a CUDA device index, got %ld", d);
    return PyErr_Occurred() ? -1 : q3py_stream_on(stream_obj, *device, "host tensors (device=-1)", stream);
}

int q3py_int64(PyObject *obj, const char *arg, int flags, const char *too_big, int64_t *out) {
    if (obj == Py_None && (flags & Q3PY_NONE_OK)) return 0;
    /* an int, or what stands for one (numpy's, a 0-d torch tensor's __index__) */
    PyObject *v = PyBool_Check(obj) && !(flags & Q3PY_BOOL_OK) ? NULL : PyIndex_Check(obj) ? PyNumber_Index(obj) : NULL;
    if (!v) {
        if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s: expected an int%s, got %.100s", arg,
                         flags & Q3PY_NONE_OK ? " or None" : "", Py_TYPE(obj)->tp_name);
        }
        return -1;
    }
    int overflow;
    *out = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow && too_big) PyErr_Format(PyExc_ValueError, "%s: %s, got %R", arg, too_big, v);
    else if (overflow) *out = PyLong_AsLongLong(v); /* raises its OverflowError */
    Py_DECREF(v);
    return PyErr_Occurred() ? -1 : 1;
}

/* index argument: a 1-D sequence of ints (list, tuple, range, a torch or numpy integer array),
 * as int64 for the engine (which checks each against the batch). Returns a PyMem_Malloc'd
 * array of *n entries, or NULL with an exception. */
int64_t *q3py_index_list(PyObject *obj, const char *arg, int64_t *n) {
    PyObject *attr = PyObject_GetAttrString(obj, "ndim"); /* arrays: exactly one dimension */
    if (!attr) PyErr_Clear();
    else {
        const long ndim = PyLong_Check(attr) ? PyLong_AsLong(attr) : 1;
        Py_DECREF(attr);
        if (ndim != 1) return (int64_t *)PyErr_Format(PyExc_ValueError, "%s: expected 1 dimension, got %ld", arg, ndim);
    }
    if ((attr = PyObject_GetAttrString(obj, "dtype")) == NULL) PyErr_Clear();
    else { /* arrays: an integer dtype ("torch.int64", "int32", "uint8"), not bool or float */
        PyObject *name = PyObject_Str(attr);
        Py_DECREF(attr);
        if (!name) return NULL;
        const char *u = PyUnicode_AsUTF8(name);
        const int ok = u && strstr(u, "int") != NULL;
        if (u && !ok) PyErr_Format(PyExc_TypeError, "%s: expected an integer dtype, got %s", arg, u);
        Py_DECREF(name);
        if (!ok) return NULL;
    }
    PyObject *seq = PySequence_Fast(obj, "");
    if (!seq && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: expected a 1-D sequence of ints, got %.100s", arg, Py_TYPE(obj)->tp_name);
    }
    if (!seq) return NULL;
    *n = PySequence_Fast_GET_SIZE(seq);
    int64_t *index = PyMem_Malloc((size_t)(*n ? *n : 1) * sizeof *index);
    if (!index) PyErr_NoMemory();
    for (Py_ssize_t i = 0; index && i < *n; i++) {
        char entry[80];
        snprintf(entry, sizeof entry, "%s[%zd]", arg, i);
        if (q3py_int64(PySequence_Fast_GET_ITEM(seq, i), entry, 0, "expected a 64-bit int", &index[i]) > 0) continue;
        PyMem_Free(index);
        index = NULL;
    }
    Py_DECREF(seq);
    return index;
}

PyObject *q3py_int64s(const int64_t *v, Py_ssize_t n, int as_list) {
    PyObject *out = as_list ? PyList_New(n) : PyTuple_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *x = PyLong_FromLongLong(v[i]);
        if (!x) Py_CLEAR(out);
        else if (as_list) PyList_SET_ITEM(out, i, x);
        else PyTuple_SET_ITEM(out, i, x);
    }
    return out;
}
