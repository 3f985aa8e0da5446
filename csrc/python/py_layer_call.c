/* Layer calls: prefill, decode, new_cache. Every check happens before the engine runs, and
 * the engine checks again before its first write, so a rejected call changes nothing. */
#include "py_layer.h"
#include "py_layer_insides.h"

static q3py_cache_object *as_cache(PyObject *obj, q3_module_state *st) {
    if (PyObject_TypeCheck(obj, st->cache_type)) return (q3py_cache_object *)obj;
    PyErr_Format(PyExc_TypeError, "cache: expected a qwen3layer KVCache (from layer.new_cache), got %.100s",
                 Py_TYPE(obj)->tp_name);
    return NULL;
}

/* None -> 0 (the engine's default chunk); else a positive int */
static int parse_chunk(PyObject *obj, int64_t *chunk) {
    *chunk = 0;
    if (obj == Py_None) return 0;
    long long v = PyLong_Check(obj) && !PyBool_Check(obj) ? PyLong_AsLongLong(obj) : -1;
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v <= 0) {
        PyObject *r = PyObject_Repr(obj);
        PyErr_Format(PyExc_ValueError, "chunk_size: expected a positive int or None, got %S", r);
        Py_XDECREF(r);
        return -1;
    }
    *chunk = v;
    return 0;
}

static int shape_error(const char *arg, const char *want, const q3_view *v) {
    char got[128];
    q3_format_shape(got, sizeof got, v->ndim, v->shape);
    PyErr_Format(PyExc_ValueError, "%s: expected shape %s, got %s", arg, want, got);
    return -1;
}

/* Checks x against the call; fills n_seqs and tokens. */
static int check_x(const q3_view *x, const q3_config *cfg, const q3_cache *c, int decode,
                   int *n_seqs, int64_t *tokens) {
    char want[128];
    if (!x->contiguous) {
        char st[128];
        q3_format_shape(st, sizeof st, x->ndim, x->strides);
        PyErr_Format(PyExc_ValueError, "x: expected a contiguous tensor, got strides %s (call .contiguous())", st);
        return -1;
    }
    if (decode) {
        snprintf(want, sizeof want, "[batch=%d, hidden=%lld]", q3_cache_batch(c), (long long)cfg->hidden);
        if (x->ndim != 2 || x->shape[0] != q3_cache_batch(c) || x->shape[1] != cfg->hidden)
            return shape_error("x", want, x);
        *n_seqs = q3_cache_batch(c);
        *tokens = 1;
        return 0;
    }
    if (x->ndim == 2) {
        snprintf(want, sizeof want, "[tokens, hidden=%lld]", (long long)cfg->hidden);
        *n_seqs = 1;
    } else {
        snprintf(want, sizeof want, "[batch=%d, tokens, hidden=%lld] or [tokens, hidden=%lld]", q3_cache_batch(c),
                 (long long)cfg->hidden, (long long)cfg->hidden);
        if (x->ndim != 3 || x->shape[0] != q3_cache_batch(c)) return shape_error("x", want, x);
        *n_seqs = q3_cache_batch(c);
    }
    if (x->shape[x->ndim - 1] != cfg->hidden) return shape_error("x", want, x);
    *tokens = x->shape[x->ndim - 2];
    if (*tokens == 0) {
        PyErr_SetString(PyExc_ValueError, "x: expected at least 1 token, got 0");
        return -1;
    }
    return 0;
}

/* out= must be a writable contiguous CPU tensor of x's shape and dtype */
static int check_out(const q3_view *o, const q3_view *x) {
    if (o->dtype != x->dtype) {
        PyErr_Format(PyExc_TypeError, "out: expected dtype %s (x's), got %s", q3_dtype_name(x->dtype),
                     q3_dtype_name(o->dtype));
        return -1;
    }
    int same = o->ndim == x->ndim;
    for (int d = 0; same && d < x->ndim; d++) same = o->shape[d] == x->shape[d];
    if (!same) {
        char want[128];
        q3_format_shape(want, sizeof want, x->ndim, x->shape);
        return shape_error("out", want, o);
    }
    if (!o->contiguous) {
        PyErr_SetString(PyExc_ValueError, "out: expected a contiguous tensor");
        return -1;
    }
    if (o->readonly) {
        PyErr_SetString(PyExc_ValueError, "out: expected a writable tensor, got a read-only one");
        return -1;
    }
    /* y may be x itself (each pass reads its rows before it writes them), but rows of out
     * over other rows of x would be written before they are read */
    int64_t n;
    q3_numel(x->ndim, x->shape, &n); /* fits: checked at import */
    const uintptr_t bytes = (uintptr_t)n * q3_dtype_size(x->dtype), xa = (uintptr_t)x->data, oa = (uintptr_t)o->data;
    if (oa != xa && oa < xa + bytes && xa < oa + bytes) {
        PyErr_Format(PyExc_ValueError, "out: overlaps x partly (out starts %lld bytes %s x); expected separate "
                     "memory or out being x itself", (long long)(oa > xa ? oa - xa : xa - oa),
                     oa > xa ? "after" : "before");
        return -1;
    }
    return 0;
}

/* The engine's interrupt poll between passes: takes the GIL briefly and runs the signal
 * handlers (Ctrl-C); an exception they raise stays set for the caller. */
typedef struct {
    PyThreadState *saved; /* this thread's state while the GIL is released */
} interrupt_poll;

static int interrupted(void *ctx) {
    interrupt_poll *p = ctx;
    PyEval_RestoreThread(p->saved);
    const int stop = PyErr_CheckSignals() < 0;
    p->saved = PyEval_SaveThread();
    return stop;
}

/* exception.add_note(note) on the exception being raised */
static void add_note(const char *note) {
    q3_pending_error e;
    q3_error_stash(&e);
    PyObject *r = e.value ? PyObject_CallMethod(e.value, "add_note", "s", note) : NULL;
    Py_XDECREF(r);
    q3_error_unstash(&e);
}

/* the attention half's four outputs for x (shape [..., H]) on `device` (-1: the host): resid
 * fp32 and normed of x's dtype like x, experts int32 and weights fp32 [..., top_k]; pointed
 * at by *o. -1 with an exception (each made one is in t[] for the caller to release) */
static int make_half_outputs(q3_module_state *st, const q3_config *cfg, const q3_view *x, int device,
                             q3py_tensor_object *t[4], q3_attention_half_out *o) {
    int64_t lead[Q3_MAX_DIM];
    memcpy(lead, x->shape, sizeof lead);
    lead[x->ndim - 1] = cfg->top_k;
    if (!(t[0] = q3py_tensor_new_on(st, Q3_F32, x->ndim, x->shape, device)) ||
        !(t[1] = q3py_tensor_new_on(st, x->dtype, x->ndim, x->shape, device)) ||
        !(t[2] = q3py_tensor_new_on(st, Q3_I32, x->ndim, lead, device)) ||
        !(t[3] = q3py_tensor_new_on(st, Q3_F32, x->ndim, lead, device)))
        return -1;
    *o = (q3_attention_half_out){t[0]->data, t[1]->data, x->dtype, t[2]->data, t[3]->data};
    return 0;
}

static PyObject *run(q3py_layer_object *self, PyObject *x_obj, PyObject *cache_obj, int decode,
                     PyObject *seq_obj, PyObject *chunk_obj, PyObject *out_obj, PyObject *stream_obj,
                     q3_insides *ins, int half) {
    q3_module_state *st = q3_state_of_type(Py_TYPE(self));
    if (!st) return NULL;
    q3py_cache_object *co = as_cache(cache_obj, st);
    if (!co) return NULL;
    const q3_config *cfg = q3_layer_config(self->layer);
    int64_t chunk;
    if (parse_chunk(chunk_obj, &chunk) < 0) return NULL;

    void *stream;
    if (q3py_stream_on(stream_obj, self->device, "a cpu layer", &stream) < 0) return NULL;
    q3_view x, out = {0};
    if (q3_view_acquire_on(x_obj, "x", &x, self->device, 0, stream) < 0) return NULL;
    PyObject *result = NULL;
    q3py_tensor_object *halves[4] = {NULL, NULL, NULL, NULL}; /* the attention half's outputs */
    q3_attention_half_out half_out;
    int n_seqs;
    int64_t tokens;
    int32_t seqs[64]; /* the sequences of the call: no heap allocation for batches up to 64 */
    int32_t *seq_list = seqs;
    if (check_x(&x, cfg, co->cache, decode, &n_seqs, &tokens) < 0) goto done;
    if (!decode && x.ndim == 2) {
        int s = 0; /* None: the first sequence */
        if (seq_obj != Py_None && q3py_seq(seq_obj, q3_cache_batch(co->cache), 0, &s) < 0) goto done;
        seqs[0] = s;
    } else {
        if (!decode && seq_obj != Py_None) {
            PyErr_SetString(PyExc_ValueError,
                            "seq: expected None when x is [batch, tokens, hidden] (x covers every sequence)");
            goto done;
        }
        if (n_seqs > (int)(sizeof seqs / sizeof seqs[0]) &&
            !(seq_list = PyMem_Malloc((size_t)n_seqs * sizeof *seq_list))) {
            seq_list = seqs;
            PyErr_NoMemory();
            goto done;
        }
        for (int i = 0; i < n_seqs; i++) seq_list[i] = i;
    }
    if (co->busy) {
        PyErr_SetString(PyExc_RuntimeError, "cache: in use by a running layer call on another thread");
        goto done;
    }
    interrupt_poll poll = {NULL};
    q3_forward_args a = {.x = x.data, .io_dtype = x.dtype, .n_seqs = n_seqs, .seqs = seq_list, .tokens = tokens,
                         .chunk = chunk, .stream = stream, .interrupted = interrupted, .interrupt_ctx = &poll};
    q3_error err;
    q3_status s = half ? q3_layer_check_attention_half(self->layer, co->cache, &a, &err)
                       : q3_layer_check_call(self->layer, co->cache, &a, &err);
    if (s != Q3_OK) { /* before the output is made: a call that cannot run allocates nothing */
        q3_raise(st, &err);
        goto done;
    }
    if (half == 2) { /* the checks alone (with the insides' limit: their outputs made and dropped) */
        if (q3py_insides_make(ins, st, self->layer, co->cache, &x, self->device, &a) == 0) result = Py_NewRef(Py_None);
        goto done;
    }
    if (half) {
        if (make_half_outputs(st, cfg, &x, self->device, halves, &half_out) < 0 ||
            q3py_insides_make(ins, st, self->layer, co->cache, &x, self->device, &a) < 0)
            goto done;
        result = Py_NewRef(Py_None);
    } else if (q3py_insides_make(ins, st, self->layer, co->cache, &x, self->device, &a) < 0) {
        goto done;
    } else if (out_obj != Py_None) {
        if (q3_view_acquire_on(out_obj, "out", &out, self->device, 0, stream) < 0 || check_out(&out, &x) < 0) goto done;
        result = Py_NewRef(out_obj);
        a.y = out.data;
    } else {
        result = (PyObject *)q3py_tensor_new_on(st, x.dtype, x.ndim, x.shape, self->device);
        if (!result) goto done;
        a.y = ((q3py_tensor_object *)result)->data;
    }
    co->busy = 1;
    poll.saved = PyEval_SaveThread();
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    s = half ? q3_layer_attention_half(self->layer, co->cache, &a, &half_out, &err)
             : q3_layer_forward(self->layer, co->cache, &a, &err);
    PyThread_release_lock(self->lock);
    PyEval_RestoreThread(poll.saved);
    co->busy = 0;
    if (s == Q3_ERR_INTERRUPTED && PyErr_Occurred()) { /* the signal handler's exception, with what it did */
        Py_CLEAR(result);
        add_note(err.msg);
    } else if (s != Q3_OK) {
        Py_CLEAR(result);
        q3_raise(st, &err);
    }
done:
    if (seq_list != seqs) PyMem_Free(seq_list);
    q3_view_release(&out);
    q3_view_release(&x);
    if (half == 1) { /* (resid, normed, experts, weights), in the insides' tuple when asked for */
        if (result) Py_SETREF(result, PyTuple_Pack(4, halves[0], halves[1], halves[2], halves[3]));
        for (int i = 0; i < 4; i++) Py_XDECREF(halves[i]);
    }
    if (half == 2) {
        q3py_insides_clear(ins);
        return result;
    }
    result = q3py_insides_result(ins, result);
    q3py_insides_clear(ins);
    return result;
}

static PyObject *layer_prefill(q3py_layer_object *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"x", "cache", "seq", "chunk_size", "out", "stream", "return_router", "return_attention",
                            "attention_limit", NULL};
    PyObject *x, *cache, *seq = Py_None, *chunk = Py_None, *out = Py_None, *stream = Py_None;
    PyObject *router = Py_False, *attention = Py_False, *limit = Py_None;
    q3_insides ins;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|OO$OOOOO:prefill", names, &x, &cache, &seq, &chunk, &out, &stream,
                                     &router, &attention, &limit) ||
        q3py_insides_parse(&ins, router, attention, limit) < 0)
        return NULL;
    return run(self, x, cache, 0, seq, chunk, out, stream, &ins, 0);
}

static PyObject *layer_decode(q3py_layer_object *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"x", "cache", "out", "stream", "return_router", "return_attention", "attention_limit",
                            NULL};
    PyObject *x, *cache, *out = Py_None, *stream = Py_None;
    PyObject *router = Py_False, *attention = Py_False, *limit = Py_None;
    q3_insides ins;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|$OOOOO:decode", names, &x, &cache, &out, &stream, &router,
                                     &attention, &limit) ||
        q3py_insides_parse(&ins, router, attention, limit) < 0)
        return NULL;
    return run(self, x, cache, 1, Py_None, Py_None, out, stream, &ins, 0);
}

static PyObject *layer_attention_half(q3py_layer_object *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"x", "cache", "seq", "chunk_size", "decode", "check_only", "return_router",
                            "return_attention", "attention_limit", "stream", NULL};
    PyObject *x, *cache, *seq = Py_None, *chunk = Py_None, *stream = Py_None;
    PyObject *router = Py_False, *attention = Py_False, *limit = Py_None;
    int decode = 0, check_only = 0;
    q3_insides ins;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|OO$ppOOOO:attention_half", names, &x, &cache, &seq, &chunk,
                                     &decode, &check_only, &router, &attention, &limit, &stream) ||
        q3py_insides_parse(&ins, router, attention, limit) < 0)
        return NULL;
    if (decode && (seq != Py_None || chunk != Py_None)) {
        PyErr_SetString(PyExc_ValueError, "attention_half: decode=True takes no seq or chunk_size (x [batch, hidden] "
                        "is one token of every sequence)");
        return NULL;
    }
    return run(self, x, cache, decode, seq, chunk, Py_None, stream, &ins, check_only ? 2 : 1);
}

static PyObject *layer_new_cache(q3py_layer_object *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"max_tokens", "batch", "dtype", NULL};
    long long max_tokens;
    int batch = 1;
    PyObject *dtype_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "L|iO:new_cache", names, &max_tokens, &batch, &dtype_obj))
        return NULL;
    q3_dtype dt = q3_layer_dtype(self->layer);
    if (dtype_obj != Py_None && q3_parse_dtype(dtype_obj, "dtype", &dt) < 0) return NULL;
    q3_module_state *st = q3_state_of_type(Py_TYPE(self));
    if (!st) return NULL;
    const q3_config *c = q3_layer_config(self->layer);
    return (PyObject *)q3py_cache_object_new(st, batch, max_tokens, c->kv_heads, c->head_dim, dt, self->device);
}

static PyObject *layer_decode_graph(q3py_layer_object *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"cache", "batch", "dtype", NULL};
    PyObject *cache_obj, *batch_obj = Py_None, *dtype_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OO:decode_graph", names, &cache_obj, &batch_obj, &dtype_obj))
        return NULL;
    q3_module_state *st = q3_state_of_type(Py_TYPE(self));
    if (!st) return NULL;
    q3py_cache_object *co = as_cache(cache_obj, st);
    if (!co) return NULL;
    q3_dtype dt = q3_layer_dtype(self->layer);
    if (dtype_obj != Py_None && q3_parse_dtype(dtype_obj, "dtype", &dt) < 0) return NULL;
    long long batch = q3_cache_batch(co->cache);
    if (batch_obj != Py_None) {
        if (!PyLong_Check(batch_obj) || PyBool_Check(batch_obj)) {
            PyErr_Format(PyExc_TypeError, "batch: expected an int or None, got %.100s", Py_TYPE(batch_obj)->tp_name);
            return NULL;
        }
        batch = PyLong_AsLongLong(batch_obj);
        if (batch == -1 && PyErr_Occurred()) return NULL;
    }
    const int most = q3_cache_batch(co->cache) < Q3_GRAPH_MAX_BATCH ? q3_cache_batch(co->cache) : Q3_GRAPH_MAX_BATCH;
    if (batch < 1 || batch > most) {
        PyErr_Format(PyExc_ValueError, "batch: expected 1 to %d (the cache's batch, at most %d), got %lld", most,
                     Q3_GRAPH_MAX_BATCH, batch);
        return NULL;
    }
    if (self->device < 0) {
        PyErr_SetString(PyExc_ValueError, "decode_graph: expected a layer on a CUDA device, got a cpu layer");
        return NULL;
    }
    PyObject *g;
    /* not while a call of this layer runs; waited for without the GIL, which a running call
     * takes between its passes */
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    Py_END_ALLOW_THREADS
    g = q3py_graph_new(st, (PyObject *)self, self->layer, self->device, co, (int)batch, dt);
    PyThread_release_lock(self->lock);
    return g;
}

static PyObject *layer_set_profiling(q3py_layer_object *self, PyObject *on) {
    const int flag = PyObject_IsTrue(on);
    if (flag < 0) return NULL;
    q3_error err;
    q3_status s;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK); /* not while a call runs (it takes the GIL between passes) */
    Py_END_ALLOW_THREADS
    s = q3_layer_profiling(self->layer, flag, &err);
    PyThread_release_lock(self->lock);
    if (s != Q3_OK) return q3_raise(NULL, &err);
    Py_RETURN_NONE;
}

static PyObject *layer_profile_seconds(q3py_layer_object *self, PyObject *unused) {
    (void)unused;
    double seconds[32];
    const int n = q3_layer_profile_read(self->layer, seconds, 32);
    PyObject *d = PyDict_New();
    for (int i = 0; d && i < n; i++) {
        PyObject *v = PyFloat_FromDouble(seconds[i]);
        if (!v || PyDict_SetItemString(d, q3_stage_name(i), v) < 0) Py_CLEAR(d);
        Py_XDECREF(v);
    }
    return d;
}

#define KW (METH_VARARGS | METH_KEYWORDS)
PyMethodDef q3py_layer_methods[] = {
    {"set_profiling", (PyCFunction)layer_set_profiling, METH_O,
     "set_profiling(on)\n--\n\nTime every stage of the calls from now on (totals reset)."},
    {"profile_seconds", (PyCFunction)layer_profile_seconds, METH_NOARGS,
     "profile_seconds()\n--\n\n{stage: seconds} accumulated since set_profiling(True)."},
    {"prefill", (PyCFunction)(void (*)(void))layer_prefill, KW,
     "prefill(x, cache, seq=None, chunk_size=None, *, out=None, stream=None, return_router=False, "
     "return_attention=False, attention_limit=None)\n--\n\n"
     "x [tokens, hidden] appended to sequence seq (default 0), or [batch, tokens, hidden] to every "
     "sequence. Returns a Tensor of x's shape and dtype (or out); with return_router or return_attention "
     "the tuple (y, router_logits, router_experts, router_weights, attention), None for what was not asked."},
    {"decode", (PyCFunction)(void (*)(void))layer_decode, KW,
     "decode(x, cache, *, out=None, stream=None, return_router=False, return_attention=False, "
     "attention_limit=None)\n--\n\nx [batch, hidden]: one token for each sequence of the cache. "
     "stream: a CUDA layer's cudaStream_t (int), NULL: the default stream. The insides as prefill's."},
    {"decode_graph", (PyCFunction)(void (*)(void))layer_decode_graph, KW,
     "decode_graph(cache, batch=None, dtype=None)\n--\n\nCaptures one decode step of sequences 0 .. batch - 1 "
     "(default: all) of the cache in a CUDA graph; returns a DecodeGraph."},
    {"attention_half", (PyCFunction)(void (*)(void))layer_attention_half, KW,
     "attention_half(x, cache, seq=None, chunk_size=None, *, decode=False, check_only=False, return_router=False, "
     "return_attention=False, attention_limit=None, stream=None)\n--\n\n"
     "The layer up to its experts, for x as prefill (decode=True: as decode) takes it: the K/V appended to the "
     "cache. Returns (resid, normed, experts, weights): x + attention fp32 and post_attention_layernorm of it of "
     "x's dtype, of x's shape, and the router's top-k expert ids (int32) and weights (fp32), [..., top_k]. "
     "check_only: the call's checks alone (raising what the call would), returning None. With return_router or "
     "return_attention: (that tuple, router_logits, router_experts, router_weights, attention) as prefill's."},
    {"expert_half", (PyCFunction)(void (*)(void))q3py_layer_expert_half, KW,
     "expert_half(rows, experts, weights, *, out=None, accumulate=False, stream=None)\n--\n\n"
     "rows [n, hidden], experts [n, top_k] int32 (-1: an expert held elsewhere), weights [n, top_k] fp32: "
     "out [n, hidden] (=, or += with accumulate) the weighted sum of each row's experts that this layer holds. "
     "out: fp32 or bf16 (None: a new tensor of rows' dtype). stream: a CUDA layer's cudaStream_t. Returns out."},
    {"new_cache", (PyCFunction)(void (*)(void))layer_new_cache, KW,
     "new_cache(max_tokens, batch=1, dtype=None)\n--\n\nA KVCache for this layer's geometry."},
    {NULL},
};

static PyObject *get_dtype(q3py_layer_object *self, void *c) {
    (void)c;
    return PyUnicode_FromString(q3_dtype_name(q3_layer_dtype(self->layer)));
}
static PyObject *get_converted(q3py_layer_object *self, void *c) { (void)c; return PyList_AsTuple(self->converted); }
static PyObject *get_weight_ptrs(q3py_layer_object *self, void *c) { (void)c; return PyDict_Copy(self->weight_ptrs); }
static PyObject *get_device(q3py_layer_object *self, void *c) {
    (void)c;
    return PyLong_FromLong(self->device);
}
static PyObject *get_weight_format(q3py_layer_object *self, void *c) {
    (void)c;
    return PyUnicode_FromString(q3_weight_format_name(q3_layer_weight_format(self->layer)));
}
static PyObject *get_scale_dtype(q3py_layer_object *self, void *c) {
    (void)c;
    if (q3_layer_weight_format(self->layer) == Q3_WF_DENSE) Py_RETURN_NONE;
    return PyUnicode_FromString(q3_dtype_name(self->scale_dtype));
}
static PyObject *get_weight_bytes(q3py_layer_object *self, void *c) {
    (void)c;
    return PyLong_FromLongLong(q3_layer_weight_bytes(self->layer));
}
static PyObject *get_workspace(q3py_layer_object *self, void *c) {
    (void)c;
    return PyLong_FromSize_t(q3_layer_workspace_bytes(self->layer));
}

static PyObject *get_held_experts(q3py_layer_object *self, void *c) {
    (void)c;
    const int E = q3_layer_config(self->layer)->experts;
    PyObject *ids = PyTuple_New(q3_layer_held_experts(self->layer));
    for (int e = 0, i = 0; ids && e < E; e++) {
        if (!q3_layer_holds_expert(self->layer, e)) continue;
        PyObject *v = PyLong_FromLong(e);
        if (!v) {
            Py_CLEAR(ids);
            break;
        }
        PyTuple_SET_ITEM(ids, i++, v);
    }
    return ids;
}

PyGetSetDef q3py_layer_getset[] = {
    {"held_experts", (getter)get_held_experts, NULL, "the ids of the experts the layer holds, ascending", NULL},
    {"dtype", (getter)get_dtype, NULL, "dtype of the activations, the norms and the router (and of the "
     "projection matrices in the dense format)", NULL},
    {"weight_format", (getter)get_weight_format, NULL, "'dense' or 'fp8_e4m3_block128'", NULL},
    {"scale_dtype", (getter)get_scale_dtype, NULL, "FP8: dtype of the block scales; dense: None", NULL},
    {"weight_bytes", (getter)get_weight_bytes, NULL, "bytes of all the weights as read (FP8: scales included)",
     NULL},
    {"converted", (getter)get_converted, NULL, "names of weights converted at construction", NULL},
    {"weight_ptrs", (getter)get_weight_ptrs, NULL, "name -> address the engine reads", NULL},
    {"workspace_bytes", (getter)get_workspace, NULL, "activation workspace held now", NULL},
    {"device", (getter)get_device, NULL, "-1 for cpu, else the CUDA device", NULL},
    {NULL},
};
