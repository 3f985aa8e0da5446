/* KVCache operations for generation (the engine's cache_ops.c): reorder, select,
 * repeat_interleave, crop, copy and copy_prefix. The copying ones refuse device caches with
 * NotImplementedError for now; each marks the cache busy while it copies without the GIL, so
 * that a layer call on another thread cannot append to it meanwhile. */
#include "py_cache.h"

static int refuse_device(const q3_cache *c, const char *op) {
    if (c->device < 0) return 0;
    PyErr_Format(PyExc_NotImplementedError,
                 "%s: the cache is on CUDA device %d; copying between sequences of a device cache is not "
                 "implemented yet (host caches only)", op, c->device);
    return -1;
}

/* index argument: a 1-D sequence of ints in [0, batch) (list, tuple, range, a torch or numpy
 * integer array). Returns a PyMem_Malloc'd array of *n entries, or NULL with an exception. */
static int *parse_index(PyObject *obj, int batch, Py_ssize_t *n) {
    if (PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "index: expected a 1-D sequence of ints, got int");
        return NULL;
    }
    PyObject *attr = PyObject_GetAttrString(obj, "ndim"); /* arrays: exactly one dimension */
    if (!attr) PyErr_Clear();
    else {
        const long ndim = PyLong_Check(attr) ? PyLong_AsLong(attr) : 1;
        Py_DECREF(attr);
        if (ndim != 1) {
            PyErr_Format(PyExc_ValueError, "index: expected 1 dimension, got %ld", ndim);
            return NULL;
        }
    }
    if ((attr = PyObject_GetAttrString(obj, "dtype")) == NULL) PyErr_Clear();
    else { /* arrays: an integer dtype ("torch.int64", "int32", "uint8"), not bool or float */
        PyObject *name = PyObject_Str(attr);
        Py_DECREF(attr);
        if (!name) return NULL;
        const char *u = PyUnicode_AsUTF8(name);
        const int ok = u && strstr(u, "int") != NULL;
        if (u && !ok) PyErr_Format(PyExc_TypeError, "index: expected an integer dtype, got %s", u);
        Py_DECREF(name);
        if (!ok) return NULL;
    }
    PyObject *seq = PySequence_Fast(obj, "index: expected a 1-D sequence of ints");
    if (!seq) return NULL;
    *n = PySequence_Fast_GET_SIZE(seq);
    int *index = PyMem_Malloc((size_t)(*n ? *n : 1) * sizeof *index);
    if (!index) {
        Py_DECREF(seq);
        return (int *)PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i), *v = PyBool_Check(item) ? NULL : PyNumber_Index(item);
        const long long x = v ? PyLong_AsLongLong(v) : -1;
        Py_XDECREF(v);
        if (!v || (x == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "index[%zd]: expected an int, got %.100s", i, Py_TYPE(item)->tp_name);
        } else if (x < 0 || x >= batch) {
            PyErr_Format(PyExc_IndexError, "index[%zd]: expected 0 <= index < %d (the cache's batch), got %lld",
                         i, batch, x);
        } else {
            index[i] = (int)x;
            continue;
        }
        Py_DECREF(seq);
        PyMem_Free(index);
        return NULL;
    }
    Py_DECREF(seq);
    return index;
}

/* A new cache of o's geometry and capacity for `batch` sequences: sequence i <- o's index[i] */
static PyObject *gather_new(q3_cache_object *o, const int *index, int batch) {
    const q3_cache *c = o->cache;
    q3_module_state *st = q3_state_of_type(Py_TYPE(o));
    if (!st || q3_py_cache_check_idle(o) < 0) return NULL;
    q3_cache_object *out = q3_cache_object_new(st, batch, c->capacity, c->kv_heads, c->head_dim, c->dtype, c->device);
    if (!out) return NULL;
    q3_error err;
    q3_status s;
    o->busy = 1; /* a layer call on another thread must not append while we read */
    Py_BEGIN_ALLOW_THREADS
    s = q3_cache_gather(out->cache, c, index, batch, &err);
    Py_END_ALLOW_THREADS
    o->busy = 0;
    if (s != Q3_OK) {
        Py_DECREF(out);
        return q3_raise(st, &err);
    }
    return (PyObject *)out;
}

PyObject *q3_py_cache_reorder(q3_cache_object *o, PyObject *args, PyObject *kw) {
    static char *names[] = {"index", NULL};
    PyObject *index_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O:reorder", names, &index_obj)) return NULL;
    q3_cache *c = o->cache;
    if (refuse_device(c, "reorder") < 0) return NULL;
    Py_ssize_t n;
    int *index = parse_index(index_obj, c->batch, &n);
    if (!index) return NULL;
    PyObject *result = NULL;
    if (n != c->batch) {
        PyErr_Format(PyExc_ValueError, "index: expected %d entries (the cache's batch), got %zd", c->batch, n);
    } else if (q3_py_cache_check_idle(o) == 0) {
        q3_error err;
        q3_status s;
        o->busy = 1;
        Py_BEGIN_ALLOW_THREADS
        s = q3_cache_reorder(c, index, (int)n, &err);
        Py_END_ALLOW_THREADS
        o->busy = 0;
        result = q3_status_or_none(s, &err);
    }
    PyMem_Free(index);
    return result;
}

PyObject *q3_py_cache_select(q3_cache_object *o, PyObject *args, PyObject *kw) {
    static char *names[] = {"index", NULL};
    PyObject *index_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O:select", names, &index_obj)) return NULL;
    if (refuse_device(o->cache, "select") < 0) return NULL;
    Py_ssize_t n;
    int *index = parse_index(index_obj, o->cache->batch, &n);
    if (!index) return NULL;
    PyObject *result = NULL;
    if (n < 1 || n > INT_MAX)
        PyErr_Format(PyExc_ValueError, "index: expected 1 to %d entries, got %zd", INT_MAX, n);
    else
        result = gather_new(o, index, (int)n);
    PyMem_Free(index);
    return result;
}

PyObject *q3_py_cache_repeat_interleave(q3_cache_object *o, PyObject *args, PyObject *kw) {
    static char *names[] = {"n", NULL};
    long long n;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "L:repeat_interleave", names, &n)) return NULL;
    const q3_cache *c = o->cache;
    if (refuse_device(c, "repeat_interleave") < 0) return NULL;
    if (n < 1 || n > INT_MAX / c->batch) {
        PyErr_Format(PyExc_ValueError, "n: expected 1 <= n <= %d (a batch of at most %d from %d sequences), got %lld",
                     INT_MAX / c->batch, INT_MAX, c->batch, n);
        return NULL;
    }
    const int batch = c->batch * (int)n;
    int *index = PyMem_Malloc((size_t)batch * sizeof *index);
    if (!index) return PyErr_NoMemory();
    for (int i = 0; i < batch; i++) index[i] = i / (int)n;
    PyObject *result = gather_new(o, index, batch);
    PyMem_Free(index);
    return result;
}

PyObject *q3_py_cache_copy(q3_cache_object *o, PyObject *unused) {
    (void)unused;
    if (refuse_device(o->cache, "copy") < 0) return NULL;
    const int batch = o->cache->batch;
    int *index = PyMem_Malloc((size_t)batch * sizeof *index);
    if (!index) return PyErr_NoMemory();
    for (int i = 0; i < batch; i++) index[i] = i;
    PyObject *result = gather_new(o, index, batch);
    PyMem_Free(index);
    return result;
}

/* copy.deepcopy(cache): the memo needs nothing from us (copy records the result itself) */
PyObject *q3_py_cache_deepcopy(q3_cache_object *o, PyObject *memo) {
    (void)memo;
    return q3_py_cache_copy(o, NULL);
}

PyObject *q3_py_cache_crop(q3_cache_object *o, PyObject *args, PyObject *kw) {
    static char *names[] = {"length", "seq", NULL};
    long long length;
    PyObject *seq_obj = Py_None;
    int seq;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "L|O:crop", names, &length, &seq_obj)) return NULL;
    if (q3_py_cache_parse_seq(o->cache, seq_obj, 1, &seq) < 0 || q3_py_cache_check_idle(o) < 0) return NULL;
    q3_error err;
    return q3_status_or_none(q3_cache_crop(o->cache, seq, length, &err), &err);
}

PyObject *q3_py_cache_copy_prefix(q3_cache_object *o, PyObject *args, PyObject *kw) {
    static char *names[] = {"src_seq", "dst_seq", "length", NULL};
    long long src, dst, length;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LLL:copy_prefix", names, &src, &dst, &length)) return NULL;
    q3_cache *c = o->cache;
    if (refuse_device(c, "copy_prefix") < 0) return NULL;
    if (src < 0 || src >= c->batch || dst < 0 || dst >= c->batch) {
        const int bad_src = src < 0 || src >= c->batch;
        PyErr_Format(PyExc_IndexError, "%s: expected 0 <= %s < %d (the cache's batch), got %lld",
                     bad_src ? "src_seq" : "dst_seq", bad_src ? "src_seq" : "dst_seq", c->batch, bad_src ? src : dst);
        return NULL;
    }
    if (q3_py_cache_check_idle(o) < 0) return NULL;
    q3_error err;
    q3_status s;
    o->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    s = q3_cache_copy_prefix(c, (int)src, (int)dst, length, &err);
    Py_END_ALLOW_THREADS
    o->busy = 0;
    return q3_status_or_none(s, &err);
}
