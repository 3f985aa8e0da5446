/* Layer calls, by mode: the parsing and the engine's checks every call shares (q3py_call_*,
 * for the attention half too: py_layer_halves.c), then prefill and decode (forward), and
 * new_cache, decode_graph, profiling; the method table. Every check happens before the
 * engine runs, and the engine checks again before its first write, so a rejected call
 * changes nothing. */
#include "py_cache.h"
#include "py_layer.h"

static q3py_cache_object *as_cache(PyObject *obj, q3_module_state *st) {
    if (PyObject_TypeCheck(obj, st->cache_type)) return (q3py_cache_object *)obj;
    PyErr_Format(PyExc_TypeError, "cache: expected a qwen3layer KVCache (from layer.new_cache), got %.100s",
                 Py_TYPE(obj)->tp_name);
    return NULL;
}

static int interrupted(void *ctx) {
    q3py_interrupt_poll *p = ctx;
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

void q3py_call_close(q3py_call *c) {
    if (c->a.seqs && c->a.seqs != c->seqs) PyMem_Free((void *)c->a.seqs);
    q3_view_release(&c->x);
    for (int i = 0; i < 3; i++) q3_view_release(&c->token[i]);
}

/* token_mask, positions and tree (None: not given) into c->a: host tensors of x's rows (the
 * tree of x's rows by its tokens) */
static int call_token_inputs(q3py_call *c, q3py_token_args tok) {
    static const char *const names[3] = {"token_mask", "positions", "tree"};
    PyObject *const objs[3] = {tok.token_mask, tok.positions, tok.tree};
    for (int i = 0; i < 3; i++) {
        if (objs[i] == Py_None) continue;
        q3_error err;
        if (q3_view_acquire_on(objs[i], names[i], &c->token[i], -1, Q3_VIEW_HOST | (i == 1 ? Q3_VIEW_I64 : Q3_VIEW_BOOL),
                               NULL) < 0 ||
            q3py_status(i == 2 ? q3_call_check_tree_input(&c->token[i], &c->x, &err)
                               : q3_call_check_token_input(&c->token[i], &c->x, names[i], &err), &err) < 0)
            return -1;
    }
    c->a.token_mask = c->token[0].data;
    c->a.positions = c->token[1].data;
    c->a.tree = c->token[2].data;
    return 0;
}

/* the call's sequences: seq (x [tokens, hidden]: one, None the first) or every one of the
 * cache's batch; -1 with an exception */
static int call_seqs(q3py_call *c, int decode, PyObject *seq_obj) {
    const int n = c->a.n_seqs;
    c->a.seqs = c->seqs;
    if (!decode && c->x.ndim == 2) {
        int s = 0;
        if (seq_obj != Py_None && q3py_seq(seq_obj, q3_cache_batch(c->co->cache), &s) < 0) return -1;
        c->seqs[0] = s;
        return 0;
    }
    if (!decode && seq_obj != Py_None) {
        PyErr_SetString(PyExc_ValueError, "seq: expected None when x is [batch, tokens, hidden] (x covers every sequence)");
        return -1;
    }
    int32_t *list = n > (int)(sizeof c->seqs / sizeof c->seqs[0]) ? PyMem_Malloc((size_t)n * sizeof *list) : c->seqs;
    if (!list) {
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < n; i++) list[i] = i;
    c->a.seqs = list;
    return 0;
}

/* Parses a call (cache, chunk_size, stream, x against the cache, seq) into c and runs the
 * engine's checks of it (half: the attention half's), before any output is made: a call that
 * cannot run allocates nothing. -1 with an exception, c released. */
int q3py_call_open(q3py_call *c, q3py_layer_object *self, PyObject *x_obj, PyObject *cache_obj, int decode,
                     PyObject *seq_obj, PyObject *chunk_obj, PyObject *stream_obj, int half, q3py_token_args tok) {
    memset(c, 0, sizeof *c);
    int64_t chunk;
    void *stream;
    if (!(c->st = q3_state_of_type(Py_TYPE(self))) || !(c->co = as_cache(cache_obj, c->st)) ||
        q3py_chunk(chunk_obj, &chunk) < 0 || q3py_stream_on(stream_obj, self->device, "a cpu layer", &stream) < 0 ||
        q3_view_acquire_on(x_obj, "x", &c->x, self->device, 0, stream) < 0)
        return -1;
    c->a = (q3_forward_args){.x = c->x.data, .io_dtype = c->x.dtype, .chunk = chunk, .stream = stream,
                             .interrupted = interrupted, .interrupt_ctx = &c->poll};
    q3_error err;
    if (q3py_status(q3_call_check_x(q3_layer_config(self->layer), c->co->cache, &c->x, decode, &c->a.n_seqs,
                                    &c->a.tokens, &err), &err) < 0 ||
        call_seqs(c, decode, seq_obj) < 0 || call_token_inputs(c, tok) < 0) {
        q3py_call_close(c);
        return -1;
    }
    if (q3py_cache_check_idle(c->co) < 0) {
        q3py_call_close(c);
        return -1;
    }
    const q3_status s = half ? q3_layer_check_attention_half(self->layer, c->co->cache, &c->a, &err)
                             : q3_layer_check_call(self->layer, c->co->cache, &c->a, &err);
    if (s != Q3_OK) {
        q3_raise(c->st, &err);
        q3py_call_close(c);
        return -1;
    }
    return 0;
}

/* The engine's forward (half NULL) or attention half of the opened call, without the GIL and
 * under the layer's lock, the cache busy meanwhile; -1 with an exception (an interrupt's
 * exception, from the signal handler, gets a note of what the engine did) */
int q3py_call_run(q3py_call *c, q3py_layer_object *self, const q3_attention_half_out *half) {
    q3_error err;
    q3_status s;
    c->co->busy = 1;
    c->poll.saved = PyEval_SaveThread();
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    s = half ? q3_layer_attention_half(self->layer, c->co->cache, &c->a, half, &err)
             : q3_layer_forward(self->layer, c->co->cache, &c->a, &err);
    PyThread_release_lock(self->lock);
    PyEval_RestoreThread(c->poll.saved);
    c->co->busy = 0;
    if (s == Q3_OK) return 0;
    if (s == Q3_ERR_INTERRUPTED && PyErr_Occurred()) add_note(err.msg);
    else q3_raise(c->st, &err);
    return -1;
}

/* prefill and decode: y (out=, or a new tensor of x's shape and dtype), with the insides asked */
static PyObject *forward(q3py_layer_object *self, PyObject *x_obj, PyObject *cache_obj, int decode,
                         PyObject *seq_obj, PyObject *chunk_obj, PyObject *out_obj, PyObject *stream_obj,
                         q3_insides *ins, q3py_token_args tok) {
    q3py_call c;
    if (q3py_call_open(&c, self, x_obj, cache_obj, decode, seq_obj, chunk_obj, stream_obj, 0, tok) < 0) return NULL;
    PyObject *y = NULL;
    q3_view out = {0};
    const int made = q3py_insides_make(ins, c.st, self->layer, c.co->cache, &c.x, self->device, &c.a) == 0;
    if (made && out_obj != Py_None) {
        q3_error err;
        if (q3_view_acquire_on(out_obj, "out", &out, self->device, 0, c.a.stream) == 0 &&
            q3py_status(q3_call_check_out(&out, &c.x, &err), &err) == 0) {
            y = Py_NewRef(out_obj);
            c.a.y = out.data;
        }
    } else if (made && (y = (PyObject *)q3py_tensor_new_on(c.st, c.x.dtype, c.x.ndim, c.x.shape, self->device))) {
        c.a.y = ((q3py_tensor_object *)y)->data;
    }
    if (y && q3py_call_run(&c, self, NULL) < 0) Py_CLEAR(y);
    q3_view_release(&out);
    q3py_call_close(&c);
    y = q3py_insides_result(ins, y);
    q3py_insides_clear(ins);
    return y;
}

static PyObject *layer_prefill(q3py_layer_object *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"x", "cache", "seq", "chunk_size", "out", "stream", "return_router", "return_attention",
                            "attention_limit", "token_mask", "positions", "tree", NULL};
    PyObject *x, *cache, *seq = Py_None, *chunk = Py_None, *out = Py_None, *stream = Py_None;
    PyObject *router = Py_False, *attention = Py_False, *limit = Py_None;
    q3py_token_args tok = Q3PY_NO_TOKEN_ARGS;
    q3_insides ins;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|OO$OOOOOOOO:prefill", names, &x, &cache, &seq, &chunk, &out,
                                     &stream, &router, &attention, &limit, &tok.token_mask, &tok.positions,
                                     &tok.tree) ||
        q3py_insides_parse(&ins, router, attention, limit) < 0)
        return NULL;
    return forward(self, x, cache, 0, seq, chunk, out, stream, &ins, tok);
}

static PyObject *layer_decode(q3py_layer_object *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"x", "cache", "out", "stream", "return_router", "return_attention", "attention_limit",
                            "token_mask", "positions", NULL};
    PyObject *x, *cache, *out = Py_None, *stream = Py_None;
    PyObject *router = Py_False, *attention = Py_False, *limit = Py_None;
    q3py_token_args tok = Q3PY_NO_TOKEN_ARGS;
    q3_insides ins;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|$OOOOOOO:decode", names, &x, &cache, &out, &stream, &router,
                                     &attention, &limit, &tok.token_mask, &tok.positions) ||
        q3py_insides_parse(&ins, router, attention, limit) < 0)
        return NULL;
    return forward(self, x, cache, 1, Py_None, Py_None, out, stream, &ins, tok);
}

/* attention_half and attention_passes: their arguments, then the whole call or its passes */
static PyObject *attention_call(q3py_layer_object *self, PyObject *args, PyObject *kw, int by_pass) {
    static char *names[] = {"x", "cache", "seq", "chunk_size", "decode", "return_router", "return_attention",
                            "attention_limit", "stream", "token_mask", "positions", "tree", NULL};
    PyObject *x, *cache, *seq = Py_None, *chunk = Py_None, *stream = Py_None;
    PyObject *router = Py_False, *attention = Py_False, *limit = Py_None;
    q3py_token_args tok = Q3PY_NO_TOKEN_ARGS;
    int decode = 0;
    q3_insides ins;
    if (!PyArg_ParseTupleAndKeywords(args, kw, by_pass ? "OO|OO$pOOOOOOO:attention_passes"
                                                       : "OO|OO$pOOOOOOO:attention_half",
                                     names, &x, &cache, &seq, &chunk, &decode, &router, &attention, &limit, &stream,
                                     &tok.token_mask, &tok.positions, &tok.tree) ||
        q3py_insides_parse(&ins, router, attention, limit) < 0)
        return NULL;
    if (decode && (seq != Py_None || chunk != Py_None || tok.tree != Py_None)) {
        PyErr_Format(PyExc_ValueError, "%s: decode=True takes no seq, chunk_size or tree (x [batch, hidden] is one "
                     "token of every sequence)", by_pass ? "attention_passes" : "attention_half");
        return NULL;
    }
    return by_pass ? q3py_layer_attention_passes(self, x, cache, decode, seq, chunk, stream, &ins, tok)
                   : q3py_layer_attention_half(self, x, cache, decode, seq, chunk, stream, &ins, tok);
}

static PyObject *layer_attention_half(q3py_layer_object *self, PyObject *args, PyObject *kw) {
    return attention_call(self, args, kw, 0);
}

static PyObject *layer_attention_passes(q3py_layer_object *self, PyObject *args, PyObject *kw) {
    return attention_call(self, args, kw, 1);
}

static PyObject *layer_new_cache(q3py_layer_object *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"max_tokens", "batch", "dtype", NULL};
    long long max_tokens;
    int batch = 1;
    q3_dtype dt = q3_layer_dtype(self->layer);
    q3_module_state *st = q3_state_of_type(Py_TYPE(self));
    if (!st || !PyArg_ParseTupleAndKeywords(args, kw, "L|iO&:new_cache", names, &max_tokens, &batch,
                                            q3py_dtype_or_none, &dt))
        return NULL;
    const q3_config *c = q3_layer_config(self->layer);
    return (PyObject *)q3py_cache_object_new(st, batch, max_tokens, c->kv_heads, c->head_dim, dt, self->device);
}

static PyObject *layer_decode_graph(q3py_layer_object *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"cache", "batch", "dtype", NULL};
    PyObject *cache_obj, *batch_obj = Py_None;
    q3_dtype dt = q3_layer_dtype(self->layer);
    q3_module_state *st = q3_state_of_type(Py_TYPE(self));
    if (!st || !PyArg_ParseTupleAndKeywords(args, kw, "O|OO&:decode_graph", names, &cache_obj, &batch_obj,
                                            q3py_dtype_or_none, &dt))
        return NULL;
    q3py_cache_object *co = as_cache(cache_obj, st);
    int64_t batch = co ? q3_cache_batch(co->cache) : 0;
    if (!co || q3py_int64(batch_obj, "batch", Q3PY_NONE_OK, NULL, &batch) < 0) return NULL;
    /* not while a call of this layer runs (waited for without the GIL, which a running call takes
     * between its passes); the capture, which makes Python objects, under the lock with the GIL */
    Q3PY_NOGIL(PyThread_acquire_lock(self->lock, WAIT_LOCK));
    PyObject *g = q3py_graph_new(st, (PyObject *)self, self->layer, co, batch, dt);
    PyThread_release_lock(self->lock);
    return g;
}

static PyObject *layer_set_profiling(q3py_layer_object *self, PyObject *on) {
    const int flag = PyObject_IsTrue(on);
    if (flag < 0) return NULL;
    q3_error err;
    q3_status s;
    Q3PY_LAYER_LOCKED(self, s = q3_layer_profiling(self->layer, flag, &err)); /* not while a call runs */
    return s == Q3_OK ? Py_NewRef(Py_None) : q3_raise(NULL, &err);
}

static PyObject *layer_profile_seconds(q3py_layer_object *self, PyObject *unused) {
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
    /* prefill, decode, decode_graph and attention_half are DecoderLayer's (qwen3layer/layer.py documents
     * them); stream: a CUDA layer's cudaStream_t (an int; None: the default stream) */
    {"prefill", (PyCFunction)(void (*)(void))layer_prefill, KW,
     "prefill(x, cache, seq=None, chunk_size=None, *, out=None, stream=None, return_router=False, "
     "return_attention=False, attention_limit=None, token_mask=None, positions=None, tree=None)\n--\n\n"
     "DecoderLayer.prefill's call, on this layer's device."},
    {"decode", (PyCFunction)(void (*)(void))layer_decode, KW,
     "decode(x, cache, *, out=None, stream=None, return_router=False, return_attention=False, "
     "attention_limit=None, token_mask=None, positions=None)\n--\n\nDecoderLayer.decode's call."},
    {"decode_graph", (PyCFunction)(void (*)(void))layer_decode_graph, KW,
     "decode_graph(cache, batch=None, dtype=None)\n--\n\nDecoderLayer.decode_graph's call: a DecodeGraph."},
    {"attention_half", (PyCFunction)(void (*)(void))layer_attention_half, KW,
     "attention_half(x, cache, seq=None, chunk_size=None, *, decode=False, return_router=False, "
     "return_attention=False, attention_limit=None, stream=None, token_mask=None, positions=None, tree=None)"
     "\n--\n\nDecoderLayer.attention_half's call: (resid, normed, experts, weights), the insides after them as asked."},
    {"attention_passes", (PyCFunction)(void (*)(void))layer_attention_passes, KW,
     "attention_passes(x, cache, seq=None, chunk_size=None, *, decode=False, return_router=False, "
     "return_attention=False, attention_limit=None, stream=None, token_mask=None, positions=None, tree=None)\n--\n\n"
     "attention_half's call a pass at a time: the whole call checked (and its insides made) now, then an "
     "AttentionPasses whose iteration runs pass after pass, each giving that pass's (resid, normed, experts, "
     "weights), x's leading dims with the pass's tokens. close() ends the call (returning its insides), abort() "
     "rolls the cache back to where it began; the cache takes no other call until then."},
    {"expert_half", (PyCFunction)(void (*)(void))q3py_layer_expert_half, KW,
     "expert_half(rows, experts, weights, *, out=None, accumulate=False, stream=None)\n--\n\n"
     "DecoderLayer.expert_half's call. Returns out."},
    {"new_cache", (PyCFunction)(void (*)(void))layer_new_cache, KW,
     "new_cache(max_tokens, batch=1, dtype=None)\n--\n\nA KVCache for this layer's geometry."},
    {NULL},
};
