/* KVCache operations for generation (the engine's cache_ops.c, cache_accept.c): reorder,
 * select, repeat_interleave, copy, copy_prefix and accept, on host and CUDA caches (crop and
 * grow: py_cache.c); the inputs of a tree verify.
 * Each runs through q3py_cache_run: the cache busy while the engine copies without the GIL, so
 * that a layer call on another thread cannot append to it meanwhile. The copying ones take
 * `stream=` (keyword only): on a CUDA cache the copies are queued on that cudaStream_t (an int,
 * as torch's `current_stream().cuda_stream`), after the caller's layer calls on it; None or 0
 * (no stream named, or the legacy default one): the device is synchronized before and after
 * them, so they are ordered against every stream. */
#include "py_cache.h"

/* the stream= of a copying call, for the cache's device */
static int stream_of(q3py_cache_object *o, PyObject *stream_obj, q3_cache_call_args *r) {
    return q3py_stream_on(stream_obj, q3_cache_device(o->cache), "a cache on the cpu", &r->stream);
}

/* reorder(index) in place, or select(index) -> a new cache */
static PyObject *by_index(q3py_cache_object *o, PyObject *args, PyObject *kw, const char *fmt, q3_cache_op op) {
    static char *names[] = {"index", "stream", NULL};
    PyObject *index_obj, *stream_obj = Py_None, *result = NULL;
    q3_cache_call_args r = {.op = op};
    q3_module_state *st = q3_state_of_type(Py_TYPE(o));
    int64_t *index;
    if (!st || !PyArg_ParseTupleAndKeywords(args, kw, fmt, names, &index_obj, &stream_obj) ||
        stream_of(o, stream_obj, &r) < 0 || !(index = q3py_index_list(index_obj, &r.n)))
        return NULL;
    r.index = index;
    if (q3py_cache_run(o, &r) == 0)
        result = op == Q3_CACHE_REORDER ? Py_NewRef(Py_None) : (PyObject *)q3py_cache_wrap(st, r.out);
    PyMem_Free(index);
    return result;
}

PyObject *q3py_cache_reorder(q3py_cache_object *o, PyObject *args, PyObject *kw) {
    return by_index(o, args, kw, "O|$O:reorder", Q3_CACHE_REORDER);
}
PyObject *q3py_cache_select(q3py_cache_object *o, PyObject *args, PyObject *kw) {
    return by_index(o, args, kw, "O|$O:select", Q3_CACHE_SELECT);
}

/* a call that makes a new cache (repeat_interleave, copy) */
static PyObject *new_cache(q3py_cache_object *o, q3_cache_call_args *r) {
    q3_module_state *st = q3_state_of_type(Py_TYPE(o));
    return !st || q3py_cache_run(o, r) < 0 ? NULL : (PyObject *)q3py_cache_wrap(st, r->out);
}

PyObject *q3py_cache_repeat_interleave(q3py_cache_object *o, PyObject *args, PyObject *kw) {
    static char *names[] = {"n", "stream", NULL};
    long long n;
    PyObject *stream_obj = Py_None;
    q3_cache_call_args r = {.op = Q3_CACHE_REPEAT_INTERLEAVE};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "L|$O:repeat_interleave", names, &n, &stream_obj) ||
        stream_of(o, stream_obj, &r) < 0)
        return NULL;
    r.n = n;
    return new_cache(o, &r);
}

PyObject *q3py_cache_copy(q3py_cache_object *o, PyObject *args, PyObject *kw) {
    static char *names[] = {"stream", NULL};
    PyObject *stream_obj = Py_None;
    q3_cache_call_args r = {.op = Q3_CACHE_COPY};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$O:copy", names, &stream_obj) || stream_of(o, stream_obj, &r) < 0)
        return NULL;
    return new_cache(o, &r);
}

/* copy.copy(cache) and copy.deepcopy(cache, memo): no stream named */
PyObject *q3py_cache_copy_noargs(q3py_cache_object *o, PyObject *unused) {
    q3_cache_call_args r = {.op = Q3_CACHE_COPY};
    return new_cache(o, &r);
}

PyObject *q3py_cache_copy_prefix(q3py_cache_object *o, PyObject *args, PyObject *kw) {
    static char *names[] = {"src_seq", "dst_seq", "length", "stream", NULL};
    long long src, dst, length;
    PyObject *stream_obj = Py_None;
    q3_cache_call_args r = {.op = Q3_CACHE_COPY_PREFIX};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LLL|$O:copy_prefix", names, &src, &dst, &length, &stream_obj) ||
        stream_of(o, stream_obj, &r) < 0)
        return NULL;
    r.src_seq = src;
    r.seq = dst;
    r.n = length;
    return q3py_cache_run_none(o, &r);
}

PyObject *q3py_cache_accept(q3py_cache_object *o, PyObject *args, PyObject *kw) {
    static char *names[] = {"seq", "kept", "stream", NULL};
    long long seq;
    PyObject *kept_obj, *stream_obj = Py_None, *result;
    q3_cache_call_args r = {.op = Q3_CACHE_ACCEPT};
    int64_t *kept;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LO|$O:accept", names, &seq, &kept_obj, &stream_obj) ||
        stream_of(o, stream_obj, &r) < 0 || !(kept = q3py_index_list(kept_obj, &r.n)))
        return NULL;
    r.seq = seq;
    r.index = kept;
    result = q3py_cache_run_none(o, &r);
    PyMem_Free(kept);
    return result;
}

/* _tree_inputs(parents, seq=None): (tree, positions) of a verify call (the engine's
 * q3_tree_inputs), host tensors: parents [T] (sequence seq, default 0) or [batch, T] int64 */
PyObject *q3py_cache_tree_inputs(q3py_cache_object *o, PyObject *args, PyObject *kw) {
    static char *names[] = {"parents", "seq", NULL};
    PyObject *parents_obj, *seq_obj = Py_None, *result = NULL;
    q3_module_state *st = q3_state_of_type(Py_TYPE(o));
    q3_view parents = {0};
    q3_error err;
    if (!st || !PyArg_ParseTupleAndKeywords(args, kw, "O|O:_tree_inputs", names, &parents_obj, &seq_obj) ||
        q3_view_acquire_on(parents_obj, "parents", &parents, -1, Q3_VIEW_HOST | Q3_VIEW_I64, NULL) < 0)
        return NULL;
    const int batch = q3_cache_batch(o->cache), whole = parents.ndim == 2, n_seqs = whole ? batch : 1;
    const int64_t want[2] = {batch, parents.ndim > 0 ? parents.shape[parents.ndim - 1] : 0};
    const int64_t T = want[1], tree_shape[3] = {n_seqs, T, T};
    int seq = 0;
    if (parents.ndim != 1 && !whole)
        PyErr_Format(PyExc_ValueError, "parents: expected shape [tokens] or [batch=%d, tokens], got %d dims", batch,
                     parents.ndim);
    else if (q3py_status(q3_view_check_shape(&parents, "parents", parents.ndim, want + !whole, &err), &err) == 0 &&
             q3py_view_require(&parents, "parents", Q3_NEED_CONTIGUOUS) == 0 &&
             (whole || seq_obj == Py_None || q3py_seq(seq_obj, batch, &seq) == 0)) {
        int32_t *seqs = PyMem_Malloc((size_t)n_seqs * sizeof *seqs);
        q3py_tensor_object *tree = q3py_tensor_new_on(st, Q3_BOOL, whole ? 3 : 2, tree_shape + !whole, -1);
        q3py_tensor_object *pos = q3py_tensor_new_on(st, Q3_I64, parents.ndim, parents.shape, -1);
        if (!seqs) PyErr_NoMemory();
        for (int i = 0; seqs && i < n_seqs; i++) seqs[i] = whole ? i : seq;
        if (seqs && tree && pos &&
            q3py_status(q3_tree_inputs(o->cache, seqs, n_seqs, parents.data, T, tree->data, pos->data, &err),
                        &err) == 0)
            result = PyTuple_Pack(2, (PyObject *)tree, (PyObject *)pos);
        PyMem_Free(seqs);
        Py_XDECREF(tree);
        Py_XDECREF(pos);
    }
    q3_view_release(&parents);
    return result;
}
