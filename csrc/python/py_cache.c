/* qwen3layer KVCache: the Python face of the engine's q3_cache (layout in cache.h).
 * Made by DecoderLayer.new_cache; its memory is allocated at creation and again only by
 * grow(). keys() and values() are zero-copy views of the blocks in use; they keep those
 * blocks alive through a views owner (below), so a view taken before a growth still reads the
 * blocks it was taken of. Its operations (reset, truncate, grow, reorder, ...) and the method
 * table are in py_cache_ops.c. Every check is the engine's: this file converts. */
#include "py_cache.h"

q3py_cache_object *q3py_cache_wrap(q3_module_state *st, q3_cache *c) {
    q3py_cache_object *o = (q3py_cache_object *)st->cache_type->tp_alloc(st->cache_type, 0); /* zeroed */
    if (o) o->cache = c;
    else q3_cache_destroy(c);
    return o;
}

q3py_cache_object *q3py_cache_object_new(q3_module_state *st, int batch, int64_t capacity,
                                     int kv_heads, int head_dim, q3_dtype dt, int device) {
    q3_cache *c;
    q3_error err;
    q3_status s;
    Q3PY_NOGIL(s = q3_cache_create_on(&c, batch, capacity, kv_heads, head_dim, dt, device, &err));
    return s == Q3_OK ? q3py_cache_wrap(st, c) : (q3py_cache_object *)q3_raise(st, &err);
}

static void cache_dealloc(q3py_cache_object *o) {
    PyTypeObject *tp = Py_TYPE(o);
    q3_cache_destroy(o->cache);
    PyObject_Free(o);
    Py_DECREF(tp);
}

/* The views owner: a capsule that every view of the cache's blocks holds as its base. While
 * the blocks are the cache's, its context is the cache object (a strong reference: a view keeps
 * the cache alive) and its pointer a q3_cache_blocks that owns nothing; the cache knows it by a
 * borrowed pointer, which the capsule clears when the last view goes. When the cache grows
 * (retire_views), the capsule takes the old blocks over and lets the cache go: it frees them
 * when the last view of them goes. */
static void views_owner_free(PyObject *capsule) {
    q3_cache_blocks *b = PyCapsule_GetPointer(capsule, "qwen3layer.cache_views");
    q3py_cache_object *o = PyCapsule_GetContext(capsule);
    if (o) {
        o->views_owner = NULL;
        Py_DECREF((PyObject *)o);
    }
    if (b) {
        q3_cache_blocks_free(b);
        PyMem_Free(b);
    }
}

static PyObject *views_owner(q3py_cache_object *o) {
    if (o->views_owner) return Py_NewRef(o->views_owner);
    q3_cache_blocks *b = PyMem_Calloc(1, sizeof *b);
    if (!b) return PyErr_NoMemory();
    b->device = q3_cache_device(o->cache);
    PyObject *capsule = PyCapsule_New(b, "qwen3layer.cache_views", views_owner_free);
    if (!capsule) {
        PyMem_Free(b);
        return NULL;
    }
    PyCapsule_SetContext(capsule, Py_NewRef((PyObject *)o));
    o->views_owner = capsule;
    return capsule;
}

int q3py_cache_retire_views(q3py_cache_object *o, q3_cache_blocks *old) {
    PyObject *capsule = o->views_owner;
    if (!capsule) {
        q3_cache_blocks_free(old);
        return 0;
    }
    q3_cache_blocks *b = PyCapsule_GetPointer(capsule, "qwen3layer.cache_views");
    if (!b) return -1;
    *b = *old;
    PyCapsule_SetContext(capsule, NULL);
    o->views_owner = NULL;
    Py_DECREF((PyObject *)o); /* the capsule's reference; the caller holds another */
    return 0;
}

int q3py_cache_check_idle(q3py_cache_object *o) {
    if (o->busy) PyErr_SetString(PyExc_RuntimeError, "cache: in use by a running layer call on another thread");
    else if (o->passes_open)
        PyErr_SetString(PyExc_RuntimeError, "cache: in the middle of a layer call run pass by pass "
                        "(Layer.attention_passes); close() or abort() it first");
    return o->busy || o->passes_open ? -1 : 0;
}

int q3py_cache_run(q3py_cache_object *o, q3_cache_call_args *r) {
    if (q3py_cache_check_idle(o) < 0) return -1;
    q3_error err;
    q3_status s;
    o->busy = 1; /* a layer call on another thread must not append while the engine works */
    Q3PY_NOGIL(s = q3_cache_call(o->cache, r, &err));
    o->busy = 0;
    if (s == Q3_OK) return 0;
    q3_raise(q3_state_of_type(Py_TYPE(o)), &err);
    return -1;
}

/* a view's base is its blocks' views owner */
PyObject *q3py_cache_view(q3py_cache_object *o, PyObject *args, PyObject *kw, int values, int all) {
    static char *seq_names[] = {"seq", NULL}, *tokens_names[] = {"tokens", NULL};
    static const char *fmt[2][2] = {{"|O:keys", "|O:values"}, {"|O:all_keys", "|O:all_values"}};
    PyObject *obj = NULL;
    int64_t n = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, fmt[all][values], all ? tokens_names : seq_names, &obj)) return NULL;
    const int given = !obj ? !all : all ? q3py_int64(obj, "tokens", Q3PY_NONE_OK | Q3PY_BOOL_OK, NULL, &n)
                                        : q3py_int64(obj, "seq", 0, NULL, &n);
    q3_module_state *st = given < 0 ? NULL : q3_state_of_type(Py_TYPE(o));
    if (!st) return NULL;
    q3_cache_view v;
    q3_error err;
    if (q3_cache_view_of(o->cache, values, all ? NULL : &n, all && given ? &n : NULL, &v, &err) != Q3_OK)
        return q3_raise(st, &err);
    PyObject *owner = views_owner(o);
    if (!owner) return NULL;
    q3py_tensor_object *t = q3py_tensor_view(st, owner, v.base, q3_cache_dtype(o->cache), v.ndim, v.shape, v.strides);
    Py_DECREF(owner);
    if (t) t->device = q3_cache_device(o->cache);
    return (PyObject *)t;
}

/* lengths, padding, first_positions: a tuple of one count per sequence, the getter's closure
 * pointing at the engine's accessor */
typedef int64_t (*per_seq_getter)(const q3_cache *c, int seq);
static const per_seq_getter per_seq_getters[] = {q3_cache_length, q3_cache_padding, q3_cache_first_position};

static PyObject *cache_per_seq(q3py_cache_object *o, void *closure) {
    const per_seq_getter get = *(const per_seq_getter *)closure;
    PyObject *t = PyTuple_New(q3_cache_batch(o->cache));
    for (int i = 0; t && i < q3_cache_batch(o->cache); i++) {
        PyObject *v = PyLong_FromLongLong(get(o->cache, i));
        if (!v) Py_CLEAR(t);
        else PyTuple_SET_ITEM(t, i, v);
    }
    return t;
}

/* hidden: for each sequence, the tuple of its hidden tokens' indices */
static PyObject *cache_hidden(q3py_cache_object *o, void *closure) {
    const q3_cache *c = o->cache;
    PyObject *t = PyTuple_New(q3_cache_batch(c));
    for (int i = 0; t && i < q3_cache_batch(c); i++) {
        const int64_t n = q3_cache_hidden_tokens(c, i, NULL);
        int64_t *ids = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *ids);
        PyObject *seq = ids ? (q3_cache_hidden_tokens(c, i, ids), q3py_int64s(ids, n, 0)) : PyErr_NoMemory();
        PyMem_Free(ids);
        if (!seq) Py_CLEAR(t);
        else PyTuple_SET_ITEM(t, i, seq);
    }
    return t;
}

static PyObject *cache_capacity(q3py_cache_object *o, void *c) { return PyLong_FromLongLong(q3_cache_capacity(o->cache)); }
static PyObject *cache_growths(q3py_cache_object *o, void *c) { return PyLong_FromLongLong(q3_cache_growths(o->cache)); }
static PyObject *cache_batch(q3py_cache_object *o, void *c) { return PyLong_FromLong(q3_cache_batch(o->cache)); }
static PyObject *cache_kv_heads(q3py_cache_object *o, void *c) { return PyLong_FromLong(q3_cache_kv_heads(o->cache)); }
static PyObject *cache_head_dim(q3py_cache_object *o, void *c) { return PyLong_FromLong(q3_cache_head_dim(o->cache)); }
static PyObject *cache_dtype(q3py_cache_object *o, void *c) { return PyUnicode_FromString(q3_dtype_name(q3_cache_dtype(o->cache))); }
static PyObject *cache_nbytes(q3py_cache_object *o, void *c) { return PyLong_FromSize_t(q3_cache_bytes(o->cache)); }
static PyObject *cache_device(q3py_cache_object *o, void *c) { return q3py_device_name(q3_cache_device(o->cache)); }

static PyObject *cache_repr(q3py_cache_object *o) {
    const q3_cache *c = o->cache;
    return PyUnicode_FromFormat("KVCache(batch=%d, capacity=%lld, kv_heads=%d, head_dim=%d, dtype=%s, "
                                "filled=%lld/%lld tokens, %zu MiB)",
                                q3_cache_batch(c), (long long)q3_cache_capacity(c), q3_cache_kv_heads(c), q3_cache_head_dim(c),
                                q3_dtype_name(q3_cache_dtype(c)), (long long)q3_cache_held(c),
                                (long long)q3_cache_capacity(c) * q3_cache_batch(c), q3_cache_bytes(c) >> 20);
}

static PyGetSetDef cache_getset[] = {
    {"lengths", (getter)cache_per_seq, NULL, "tokens held by each sequence (tuple)", (void *)&per_seq_getters[0]},
    {"capacity", (getter)cache_capacity, NULL, "tokens each sequence can hold", NULL},
    {"growths", (getter)cache_growths, NULL, "the times grow() moved the cache into larger memory", NULL},
    {"padding", (getter)cache_per_seq, NULL, "leading padding tokens of each sequence (tuple)", (void *)&per_seq_getters[1]},
    {"first_positions", (getter)cache_per_seq, NULL, "the RoPE position of each sequence's first real token (tuple)",
     (void *)&per_seq_getters[2]},
    {"hidden", (getter)cache_hidden, NULL, "the hidden tokens of each sequence (a tuple of index tuples): those a "
     "call's token_mask hid from later queries", NULL},
    {"batch", (getter)cache_batch, NULL, "number of sequences", NULL},
    {"num_kv_heads", (getter)cache_kv_heads, NULL, "KV heads", NULL},
    {"head_dim", (getter)cache_head_dim, NULL, "head dimension", NULL},
    {"dtype", (getter)cache_dtype, NULL, "storage dtype", NULL},
    {"nbytes", (getter)cache_nbytes, NULL, "bytes of K and V together", NULL},
    {"device", (getter)cache_device, NULL, "where K and V live: 'cpu' or 'cuda:N'", NULL},
    {NULL},
};

static PyType_Slot cache_slots[] = {
    {Py_tp_dealloc, cache_dealloc},
    {Py_tp_repr, cache_repr},
    {Py_tp_methods, q3py_cache_methods},
    {Py_tp_getset, cache_getset},
    {Py_tp_doc, "KV cache owned by the extension; create it with DecoderLayer.new_cache()."},
    {0, NULL},
};

PyType_Spec q3py_cache_spec = {
    .name = "qwen3layer._C.KVCache",
    .basicsize = sizeof(q3py_cache_object),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = cache_slots,
};
