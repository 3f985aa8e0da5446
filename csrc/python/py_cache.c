/* qwen3layer KVCache: the Python face of the engine's q3_cache (layout in cache.h), made by
 * DecoderLayer.new_cache; memory allocated at creation and again only by grow(). keys() and
 * values() are zero-copy views of the blocks in use, each holding a reference to them (below):
 * a view taken before a growth still reads the blocks it was taken of. The operations (reset,
 * truncate, grow, reorder, ...) and the method table: py_cache_ops.c. Checks: the engine's. */
#include "py_glue.h"

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

/* a view's base: a capsule holding a reference to the blocks it reads (the engine's
 * q3_cache_blocks_ref), dropped when the view goes; so a view taken before a growth, or
 * outliving the cache, still reads the blocks it was taken of */
static void views_owner_free(PyObject *capsule) {
    q3_cache_blocks_unref(PyCapsule_GetPointer(capsule, "qwen3layer.cache_views"));
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
    q3_cache_blocks *blocks = q3_cache_blocks_ref(o->cache);
    PyObject *owner = PyCapsule_New(blocks, "qwen3layer.cache_views", views_owner_free);
    if (!owner) return q3_cache_blocks_unref(blocks), NULL;
    q3py_tensor_object *t = q3py_tensor_view(st, owner, v.base, q3_cache_dtype(o->cache), v.ndim, v.shape, v.strides);
    Py_DECREF(owner);
    if (t) t->device = q3_cache_device(o->cache);
    return (PyObject *)t;
}

/* the engine's counts (q3_cache_count), the getter's closure naming which: an int, or from
 * Q3_CC_LENGTH on (lengths, padding, first_positions, hidden) a tuple of one a sequence, hidden's
 * each the tuple of the sequence's hidden tokens' indices */
#define COUNT(id) (void *)(intptr_t)(id)
static PyObject *count_of(const q3_cache *c, q3_cache_count_id id, int seq) {
    const int64_t n = q3_cache_count(c, id, seq);
    if (id != Q3_CC_HIDDEN) return PyLong_FromLongLong(n);
    int64_t *ids = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *ids);
    PyObject *r = ids ? (q3_cache_hidden_tokens(c, seq, ids), q3py_int64s(ids, n, 0)) : PyErr_NoMemory();
    PyMem_Free(ids);
    return r;
}

/* PLAN_READS: the closure of plan_state, the tuple of the counts a call's plan reads */
#define PLAN_READS (Q3_CC_HIDDEN + 1)
static PyObject *cache_count(q3py_cache_object *o, void *closure) {
    const q3_cache_count_id id = (q3_cache_count_id)(intptr_t)closure;
    if (id < Q3_CC_LENGTH) return count_of(o->cache, id, 0);
    const int n = id == PLAN_READS ? 4 : q3_cache_batch(o->cache);
    PyObject *t = PyTuple_New(n);
    for (int i = 0; t && i < n; i++) {
        PyObject *v = id == PLAN_READS ? cache_count(o, COUNT(Q3_CC_LENGTH + i)) : count_of(o->cache, id, i);
        if (!v) Py_CLEAR(t);
        else PyTuple_SET_ITEM(t, i, v);
    }
    return t;
}

static PyObject *cache_dtype(q3py_cache_object *o, void *c) { return PyUnicode_FromString(q3_dtype_name(q3_cache_dtype(o->cache))); }
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
    {"lengths", (getter)cache_count, NULL, "tokens held by each sequence (tuple)", COUNT(Q3_CC_LENGTH)},
    {"capacity", (getter)cache_count, NULL, "tokens each sequence can hold", COUNT(Q3_CC_CAPACITY)},
    {"growths", (getter)cache_count, NULL, "the times grow() moved the cache into larger memory", COUNT(Q3_CC_GROWTHS)},
    {"padding", (getter)cache_count, NULL, "leading padding tokens of each sequence (tuple)", COUNT(Q3_CC_PADDING)},
    {"first_positions", (getter)cache_count, NULL, "the RoPE position of each sequence's first real token (tuple)",
     COUNT(Q3_CC_FIRST_POSITION)},
    {"plan_state", (getter)cache_count, NULL, "(lengths, padding, first_positions, hidden): what a call's plan "
     "reads of the cache, in one read", COUNT(PLAN_READS)},
    {"hidden", (getter)cache_count, NULL, "the hidden tokens of each sequence (a tuple of index tuples): those a "
     "call's token_mask hid from later queries", COUNT(Q3_CC_HIDDEN)},
    {"batch", (getter)cache_count, NULL, "number of sequences", COUNT(Q3_CC_BATCH)},
    {"num_kv_heads", (getter)cache_count, NULL, "KV heads", COUNT(Q3_CC_KV_HEADS)},
    {"head_dim", (getter)cache_count, NULL, "head dimension", COUNT(Q3_CC_HEAD_DIM)},
    {"dtype", (getter)cache_dtype, NULL, "storage dtype", NULL},
    {"nbytes", (getter)cache_count, NULL, "bytes of K and V together", COUNT(Q3_CC_BYTES)},
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
