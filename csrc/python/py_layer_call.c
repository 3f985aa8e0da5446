/* Layer calls, by mode: the parsing and the engine's checks every call shares (q3py_call_*,
 * for the attention passes too: py_pass_run.c), then prefill, decode and attention_half (call),
 * their arguments parsed in one place (parse_call), and new_cache, decode_graph, profiling;
 * the method table. Every check happens before the engine runs, and the engine checks again
 * before its first write, so a rejected call changes nothing. */
#include "py_layer.h"

static q3py_cache_object *as_cache(PyObject *obj, q3_module_state *st) {
    if (PyObject_TypeCheck(obj, st->cache_type)) return (q3py_cache_object *)obj;
    PyErr_Format(PyExc_TypeError, "cache: expected a qwen3layer KVCache (from layer.new_cache), got %.100s",
                 Py_TYPE(obj)->tp_name);
    return NULL;
}

/* The engine's interrupt poll between passes: takes the GIL briefly and runs the signal
 * handlers (Ctrl-C); an exception they raise stays set for the caller. */
static int interrupted(void *ctx) {
    q3py_call *p = ctx;
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
    q3_call_release(&c->a, c->seqs);
    q3_view_release(&c->x);
    for (int i = 0; i < 3; i++) q3_view_release(&c->token[i]);
}

/* Parses a call (cache, chunk_size, stream, seq, x, the per-token inputs: host tensors) into c
 * and runs the engine's checks of it (q3_call_prepare; half: the attention half's), before any
 * output is made: a call that cannot run allocates nothing. -1 with an exception, c released. */
int q3py_call_open(q3py_call *c, q3py_layer_object *self, const q3py_call_args *p, int half) {
    static const char *const names[3] = {"token_mask", "positions", "tree"};
    const int allow[3] = {Q3_VIEW_HOST | Q3_VIEW_BOOL, Q3_VIEW_HOST | Q3_VIEW_I64, Q3_VIEW_HOST | Q3_VIEW_BOOL};
    memset(c, 0, sizeof *c);
    int seq;
    const q3_view *tok[3] = {NULL, NULL, NULL};
    q3_error err;
    if (!(c->st = q3_state_of_type(Py_TYPE(self))) || !(c->co = as_cache(p->cache, c->st)) ||
        q3py_chunk(p->chunk, &c->a.chunk) < 0 ||
        q3py_stream_on(p->stream, self->device, "a cpu layer", &c->a.stream) < 0 ||
        (p->seq != Py_None && q3py_seq(p->seq, q3_cache_batch(c->co->cache), &seq) < 0) ||
        q3_view_acquire_on(p->x, "x", &c->x, self->device, 0, c->a.stream) < 0)
        return -1;
    int failed = 0;
    for (int i = 0; i < 3; i++) {
        tok[i] = p->tok[i] == Py_None ? NULL : &c->token[i];
        failed = failed || (tok[i] && q3_view_acquire_on(p->tok[i], names[i], &c->token[i], -1, allow[i], NULL) < 0);
    }
    c->a.interrupted = interrupted;
    c->a.interrupt_ctx = c;
    if (!failed && q3py_cache_check_idle(c->co) == 0 &&
        q3_call_prepare(self->layer, c->co->cache, &c->x, p->decode, p->seq != Py_None ? &seq : NULL, tok, half,
                        c->seqs, (int)(sizeof c->seqs / sizeof *c->seqs), &c->a, &err) == Q3_OK)
        return 0;
    if (!PyErr_Occurred()) q3_raise(c->st, &err); /* the engine's (a full cache: CacheFullError) */
    q3py_call_close(c);
    return -1;
}

/* The engine's forward (half NULL), attention half, or next pass of it (cur) of the opened call,
 * without the GIL and under the layer's lock, the cache busy meanwhile; -1 with an exception (an
 * interrupt's exception, from the signal handler, gets a note of what the engine did) */
int q3py_call_run(q3py_call *c, q3py_layer_object *self, const q3_attention_half_out *half, q3_pass_cursor *cur) {
    q3_error err;
    q3_status s;
    c->co->busy = 1;
    c->saved = PyEval_SaveThread();
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    s = cur ? q3_layer_attention_pass(self->layer, c->co->cache, &c->a, cur, half, &err)
        : half ? q3_layer_attention_half(self->layer, c->co->cache, &c->a, half, &err)
               : q3_layer_forward(self->layer, c->co->cache, &c->a, &err);
    PyThread_release_lock(self->lock);
    PyEval_RestoreThread(c->saved);
    c->co->busy = 0;
    if (s == Q3_OK) return 0;
    if (s == Q3_ERR_INTERRUPTED && PyErr_Occurred()) add_note(err.msg);
    else q3_raise(c->st, &err);
    return -1;
}

/* prefill, decode (half 0: y, out= or a new tensor of x's shape and dtype) and attention_half (half
 * 1: q3py_half_outputs' tuple), the insides asked after it */
static PyObject *call(q3py_layer_object *self, q3py_call_args *p, int half) {
    q3py_call c;
    if (q3py_call_open(&c, self, p, half) < 0) return NULL;
    PyObject *y = NULL;
    q3_view out = {0};
    q3_attention_half_out h;
    q3_error err;
    const int made = q3py_insides_make(&p->ins, &c, self) == 0;
    if (made && half) {
        y = q3py_half_outputs(&c, self, c.a.tokens, &h);
    } else if (made && p->out != Py_None) {
        if (q3_view_acquire_on(p->out, "out", &out, self->device, 0, c.a.stream) == 0 &&
            q3py_status(q3_call_check_out(&out, &c.x, &err), &err) == 0) {
            y = Py_NewRef(p->out);
            c.a.y = out.data;
        }
    } else if (made && (y = (PyObject *)q3py_tensor_new_on(c.st, c.x.dtype, c.x.ndim, c.x.shape, self->device))) {
        c.a.y = ((q3py_tensor_object *)y)->data;
    }
    if (y && q3py_call_run(&c, self, half ? &h : NULL, NULL) < 0) Py_CLEAR(y);
    q3_view_release(&out);
    q3py_call_close(&c);
    return q3py_insides_result(&p->ins, y);
}

/* prefill (mode 0), decode (1), attention_half (2), attention_passes (3): the arguments into a
 * q3py_call_args (keyword-only ones in one order, decode's less seq and chunk_size), then the
 * call */
static PyObject *parse_call(q3py_layer_object *self, PyObject *args, PyObject *kw, int mode) {
    static char *names[4][13] = {
        {"x", "cache", "seq", "chunk_size", "out", "stream", "return_router", "return_attention", "attention_limit",
         "token_mask", "positions", "tree", NULL},
        {"x", "cache", "out", "stream", "return_router", "return_attention", "attention_limit", "token_mask",
         "positions", NULL},
        {"x", "cache", "seq", "chunk_size", "decode", "stream", "return_router", "return_attention",
         "attention_limit", "token_mask", "positions", "tree", NULL},
        {"x", "cache", "seq", "chunk_size", "decode", "stream", "return_router", "return_attention",
         "attention_limit", "token_mask", "positions", "tree", NULL}};
    static const char *const formats[4] = {"OO|OO$OOOOOOOO:prefill", "OO|$OOOOOOO:decode",
                                           "OO|OO$OOOOOOOO:attention_half", "OO|OO$OOOOOOOO:attention_passes"};
    q3py_call_args p = {.seq = Py_None, .chunk = Py_None, .out = Py_None, .stream = Py_None,
                        .tok = {Py_None, Py_None, Py_None}};
    PyObject *decode = Py_False, *router = Py_False, *attention = Py_False, *limit = Py_None;
    PyObject **o[12] = {&p.seq, &p.chunk, mode >= 2 ? &decode : &p.out, &p.stream, &router, &attention, &limit,
                        &p.tok[0], &p.tok[1], &p.tok[2]};
    PyObject ***r = o + (mode == 1 ? 2 : 0); /* decode: from out on */
    if (!PyArg_ParseTupleAndKeywords(args, kw, formats[mode], names[mode], &p.x, &p.cache, r[0], r[1], r[2], r[3],
                                     r[4], r[5], r[6], r[7], r[8], r[9]) ||
        (p.decode = mode == 1 ? 1 : PyObject_IsTrue(decode)) < 0 || (p.ins.router = PyObject_IsTrue(router)) < 0 ||
        (p.ins.attention = PyObject_IsTrue(attention)) < 0)
        return NULL;
    if (limit != Py_None && !p.ins.attention)
        return PyErr_Format(PyExc_ValueError, "attention_limit: only with return_attention=True");
    if (q3py_attention_limit(limit, Q3_ATTENTION_LIMIT_DEFAULT, &p.ins.limit) < 0) return NULL;
    if (mode >= 2 && p.decode && (p.seq != Py_None || p.chunk != Py_None || p.tok[2] != Py_None))
        return PyErr_Format(PyExc_ValueError, "%s: decode=True takes no seq, chunk_size or tree (x [batch, hidden] is "
                            "one token of every sequence)", strchr(formats[mode], ':') + 1);
    return mode == 3 ? q3py_layer_attention_passes(self, &p) : call(self, &p, mode == 2);
}

#define CALL_METHOD(name, mode) \
    static PyObject *name(q3py_layer_object *self, PyObject *args, PyObject *kw) { \
        return parse_call(self, args, kw, mode); \
    }
CALL_METHOD(layer_prefill, 0)
CALL_METHOD(layer_decode, 1)
CALL_METHOD(layer_attention_half, 2)
CALL_METHOD(layer_attention_passes, 3)

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
