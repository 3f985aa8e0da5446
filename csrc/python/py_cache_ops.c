/* KVCache operations for generation (the engine's cache_ops.c): reorder, select,
 * repeat_interleave, crop, copy, copy_prefix and grow, on host and CUDA caches. Each marks the cache
 * busy while it copies without the GIL, so that a layer call on another thread cannot append
 * to it meanwhile. The copying ones take `stream=` (keyword only): on a CUDA cache the copies
 * are queued on that cudaStream_t (an int, as torch's `current_stream().cuda_stream`), after
 * the caller's layer calls on it; None or 0 (no stream named, or the legacy default one): the
 * device is synchronized before and after them, so they are ordered against every stream. */
#include "py_cache.h"

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
static PyObject *gather_new(q3py_cache_object *o, const int *index, int batch, void *stream) {
    const q3_cache *c = o->cache;
    q3_module_state *st = q3_state_of_type(Py_TYPE(o));
    if (!st || q3py_cache_check_idle(o) < 0) return NULL;
    q3py_cache_object *out = q3py_cache_object_new(st, batch, q3_cache_capacity(c), q3_cache_kv_heads(c), q3_cache_head_dim(c), q3_cache_dtype(c), q3_cache_device(c));
    if (!out) return NULL;
    q3_error err;
    q3_status s;
    o->busy = 1; /* a layer call on another thread must not append while we read */
    Py_BEGIN_ALLOW_THREADS
    s = q3_cache_gather(out->cache, c, index, batch, stream, &err);
    Py_END_ALLOW_THREADS
    o->busy = 0;
    if (s != Q3_OK) {
        Py_DECREF(out);
        return q3_raise(st, &err);
    }
    return (PyObject *)out;
}

PyObject *q3py_cache_reorder(q3py_cache_object *o, PyObject *args, PyObject *kw) {
    static char *names[] = {"index", "stream", NULL};
    PyObject *index_obj, *stream_obj = Py_None;
    void *stream;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$O:reorder", names, &index_obj, &stream_obj)) return NULL;
    q3_cache *c = o->cache;
    if (q3py_stream_on(stream_obj, q3_cache_device(c), "a cache on the cpu", &stream) < 0) return NULL;
    Py_ssize_t n;
    int *index = parse_index(index_obj, q3_cache_batch(c), &n);
    if (!index) return NULL;
    PyObject *result = NULL;
    if (n != q3_cache_batch(c)) {
        PyErr_Format(PyExc_ValueError, "index: expected %d entries (the cache's batch), got %zd", q3_cache_batch(c), n);
    } else if (q3py_cache_check_idle(o) == 0) {
        q3_error err;
        q3_status s;
        o->busy = 1;
        Py_BEGIN_ALLOW_THREADS
        s = q3_cache_reorder(c, index, (int)n, stream, &err);
        Py_END_ALLOW_THREADS
        o->busy = 0;
        result = q3_status_or_none(s, &err);
    }
    PyMem_Free(index);
    return result;
}

PyObject *q3py_cache_select(q3py_cache_object *o, PyObject *args, PyObject *kw) {
    static char *names[] = {"index", "stream", NULL};
    PyObject *index_obj, *stream_obj = Py_None;
    void *stream;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$O:select", names, &index_obj, &stream_obj)) return NULL;
    if (q3py_stream_on(stream_obj, q3_cache_device(o->cache), "a cache on the cpu", &stream) < 0) return NULL;
    Py_ssize_t n;
    int *index = parse_index(index_obj, q3_cache_batch(o->cache), &n);
    if (!index) return NULL;
    PyObject *result = NULL;
    if (n < 1 || n > INT_MAX)
        PyErr_Format(PyExc_ValueError, "index: expected 1 to %d entries, got %zd", INT_MAX, n);
    else
        result = gather_new(o, index, (int)n, stream);
    PyMem_Free(index);
    return result;
}

PyObject *q3py_cache_repeat_interleave(q3py_cache_object *o, PyObject *args, PyObject *kw) {
    static char *names[] = {"n", "stream", NULL};
    long long n;
    PyObject *stream_obj = Py_None;
    void *stream;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "L|$O:repeat_interleave", names, &n, &stream_obj)) return NULL;
    const q3_cache *c = o->cache;
    if (q3py_stream_on(stream_obj, q3_cache_device(c), "a cache on the cpu", &stream) < 0) return NULL;
    if (n < 1 || n > INT_MAX / q3_cache_batch(c)) {
        PyErr_Format(PyExc_ValueError, "n: expected 1 <= n <= %d (a batch of at most %d from %d sequences), got %lld",
                     INT_MAX / q3_cache_batch(c), INT_MAX, q3_cache_batch(c), n);
        return NULL;
    }
    const int batch = q3_cache_batch(c) * (int)n;
    int *index = PyMem_Malloc((size_t)batch * sizeof *index);
    if (!index) return PyErr_NoMemory();
    for (int i = 0; i < batch; i++) index[i] = i / (int)n;
    PyObject *result = gather_new(o, index, batch, stream);
    PyMem_Free(index);
    return result;
}

static PyObject *copy_on(q3py_cache_object *o, void *stream) {
    const int batch = q3_cache_batch(o->cache);
    int *index = PyMem_Malloc((size_t)batch * sizeof *index);
    if (!index) return PyErr_NoMemory();
    for (int i = 0; i < batch; i++) index[i] = i;
    PyObject *result = gather_new(o, index, batch, stream);
    PyMem_Free(index);
    return result;
}

PyObject *q3py_cache_copy(q3py_cache_object *o, PyObject *args, PyObject *kw) {
    static char *names[] = {"stream", NULL};
    PyObject *stream_obj = Py_None;
    void *stream;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$O:copy", names, &stream_obj)) return NULL;
    if (q3py_stream_on(stream_obj, q3_cache_device(o->cache), "a cache on the cpu", &stream) < 0) return NULL;
    return copy_on(o, stream);
}

/* copy.copy(cache): no stream named */
PyObject *q3py_cache_copy_noargs(q3py_cache_object *o, PyObject *unused) {
    (void)unused;
    return copy_on(o, NULL);
}

/* copy.deepcopy(cache): the memo needs nothing from us (copy records the result itself) */
PyObject *q3py_cache_deepcopy(q3py_cache_object *o, PyObject *memo) {
    (void)memo;
    return copy_on(o, NULL);
}

PyObject *q3py_cache_crop(q3py_cache_object *o, PyObject *args, PyObject *kw) {
    static char *names[] = {"length", "seq", NULL};
    long long length;
    PyObject *seq_obj = Py_None;
    int seq;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "L|O:crop", names, &length, &seq_obj)) return NULL;
    if (q3py_seq(seq_obj, q3_cache_batch(o->cache), 1, &seq) < 0 || q3py_cache_check_idle(o) < 0) return NULL;
    q3_error err;
    return q3_status_or_none(q3_cache_crop(o->cache, seq, length, &err), &err);
}

PyObject *q3py_cache_copy_prefix(q3py_cache_object *o, PyObject *args, PyObject *kw) {
    static char *names[] = {"src_seq", "dst_seq", "length", "stream", NULL};
    long long src, dst, length;
    PyObject *stream_obj = Py_None;
    void *stream;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LLL|$O:copy_prefix", names, &src, &dst, &length, &stream_obj))
        return NULL;
    q3_cache *c = o->cache;
    if (q3py_stream_on(stream_obj, q3_cache_device(c), "a cache on the cpu", &stream) < 0) return NULL;
    if (src < 0 || src >= q3_cache_batch(c) || dst < 0 || dst >= q3_cache_batch(c)) {
        const int bad_src = src < 0 || src >= q3_cache_batch(c);
        PyErr_Format(PyExc_IndexError, "%s: expected 0 <= %s < %d (the cache's batch), got %lld",
                     bad_src ? "src_seq" : "dst_seq", bad_src ? "src_seq" : "dst_seq", q3_cache_batch(c), bad_src ? src : dst);
        return NULL;
    }
    if (q3py_cache_check_idle(o) < 0) return NULL;
    q3_error err;
    q3_status s;
    o->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    s = q3_cache_copy_prefix(c, (int)src, (int)dst, length, stream, &err);
    Py_END_ALLOW_THREADS
    o->busy = 0;
    return q3_status_or_none(s, &err);
}

PyObject *q3py_cache_grow(q3py_cache_object *o, PyObject *args, PyObject *kw) {
    static char *names[] = {"max_tokens", "stream", NULL};
    PyObject *capacity_obj, *stream_obj = Py_None;
    void *stream;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$O:grow", names, &capacity_obj, &stream_obj)) return NULL;
    if (!PyLong_Check(capacity_obj) || PyBool_Check(capacity_obj)) {
        PyErr_Format(PyExc_TypeError, "max_tokens: expected an int, got %.100s", Py_TYPE(capacity_obj)->tp_name);
        return NULL;
    }
    int overflow;
    const long long capacity = PyLong_AsLongLongAndOverflow(capacity_obj, &overflow);
    if (overflow || (capacity == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "max_tokens: expected at most 2^40 (the positions RoPE takes), got %R",
                     capacity_obj);
        return NULL;
    }
    q3_cache *c = o->cache;
    if (q3py_stream_on(stream_obj, q3_cache_device(c), "a cache on the cpu", &stream) < 0) return NULL;
    if (q3py_cache_check_idle(o) < 0) return NULL;
    q3_error err;
    q3_status s;
    q3_cache_blocks old;
    o->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    s = q3_cache_grow(c, capacity, stream, &old, &err);
    Py_END_ALLOW_THREADS
    o->busy = 0;
    if (s != Q3_OK) return q3_raise(q3_state_of_type(Py_TYPE(o)), &err);
    if (old.k && q3py_cache_retire_views(o, &old) < 0) return NULL; /* old.k NULL: it held that many already */
    Py_RETURN_NONE;
}
