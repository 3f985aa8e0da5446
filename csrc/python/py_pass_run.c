/* AttentionPasses: the attention half of one layer call run a pass at a time
 * (q3_layer_attention_passes_begin / _pass / _abort), for a caller that moves each pass's rows
 * to experts elsewhere before the next pass (qwen3layer.placement.passes: the split and
 * expert-parallel layers). Made by Layer.attention_passes, which checks the whole call once; an
 * iterator of each pass's (resid, normed, experts, weights); close() ends the call and returns its
 * insides, abort() (or leaving a `with` block open, or dropping the object open) rolls the
 * cache back to where the call began, in the engine. The cache takes no other call meanwhile. */
#include "py_cache.h"
#include "py_layer.h"

typedef struct {
    PyObject_HEAD
    q3py_layer_object *layer; /* strong: the engine layer the passes run on */
    q3py_call call;           /* the checked call: x's view, the cache (strong, below), the arguments */
    PyObject *cache_obj;      /* strong: call.co */
    q3_insides ins;           /* the whole call's insides, written pass by pass */
    q3_pass_cursor cur;
    int passes;               /* of the call */
    int done;                 /* passes run */
    int open;                 /* 1 until close(), abort() or a failed pass */
} q3py_passes_object;

/* the view of x, the sequences and the cache's claim given back; the insides kept for close() */
static void release(q3py_passes_object *self) {
    if (!self->open) return;
    self->open = 0;
    self->call.co->passes_open = 0;
    q3py_call_close(&self->call);
}

PyObject *q3py_layer_attention_passes(q3py_layer_object *layer, PyObject *x_obj, PyObject *cache_obj, int decode,
                                      PyObject *seq_obj, PyObject *chunk_obj, PyObject *stream_obj, q3_insides *ins,
                                      q3py_token_args tok) {
    q3_module_state *st = q3_state_of_type(Py_TYPE(layer));
    if (!st) return NULL;
    q3py_passes_object *self = PyObject_New(q3py_passes_object, st->passes_type);
    if (!self) return NULL;
    self->layer = (q3py_layer_object *)Py_NewRef((PyObject *)layer);
    self->cache_obj = NULL;
    self->cur = (q3_pass_cursor){0};
    self->ins = *ins; /* its outputs are made below, after the checks */
    self->open = self->done = self->passes = 0;
    /* the call's parsing and the engine's checks of the whole call (the attention half's) */
    if (q3py_call_open(&self->call, layer, x_obj, cache_obj, decode, seq_obj, chunk_obj, stream_obj, 1, tok) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    self->cache_obj = Py_NewRef(cache_obj);
    self->call.a.interrupted = NULL; /* the caller's loop runs between the passes: Ctrl-C lands there */
    self->open = 1;
    self->call.co->passes_open = 1;
    q3_error err;
    if (q3py_insides_make(&self->ins, st, layer->layer, self->call.co->cache, &self->call.x, layer->device,
                          &self->call.a) < 0 ||
        q3_layer_attention_passes_begin(layer->layer, self->call.co->cache, &self->call.a, &self->cur, &err) !=
            Q3_OK) {
        if (!PyErr_Occurred()) q3_raise(st, &err);
        Py_DECREF(self); /* releases: nothing ran */
        return NULL;
    }
    const int64_t step = q3_pass_cursor_tokens(&self->call.a, &self->cur);
    self->passes = (int)((self->call.a.tokens + step - 1) / step); /* tokens >= 1, checked */
    return (PyObject *)self;
}

static void passes_dealloc(q3py_passes_object *self) {
    PyTypeObject *tp = Py_TYPE(self);
    if (self->open) q3_layer_attention_passes_abort(self->call.co->cache, &self->call.a, &self->cur);
    release(self);
    q3py_insides_clear(&self->ins);
    Py_XDECREF(self->cache_obj);
    Py_XDECREF((PyObject *)self->layer);
    PyObject_Free(self);
    Py_DECREF(tp);
}

/* the next pass's four outputs: x's leading dims with the pass's tokens, on the layer's device */
static PyObject *passes_next(q3py_passes_object *self) {
    if (!self->open || self->done == self->passes) return NULL; /* StopIteration */
    q3py_call *c = &self->call;
    int64_t shape[Q3_MAX_DIM];
    memcpy(shape, c->x.shape, sizeof shape);
    if (c->a.tokens > 1) shape[c->x.ndim - 2] = q3_pass_cursor_tokens(&c->a, &self->cur); /* x [..., tokens, H] */
    q3py_tensor_object *t[4] = {NULL, NULL, NULL, NULL};
    q3_attention_half_out half;
    PyObject *result = NULL;
    if (q3py_half_outputs(c->st, q3_layer_config(self->layer->layer), c->x.ndim, shape, c->x.dtype,
                          self->layer->device, t, &half) == 0) {
        q3_error err;
        q3_status s;
        c->co->busy = 1;
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(self->layer->lock, WAIT_LOCK);
        s = q3_layer_attention_pass(self->layer->layer, c->co->cache, &c->a, &self->cur, &half, &err);
        PyThread_release_lock(self->layer->lock);
        Py_END_ALLOW_THREADS
        c->co->busy = 0;
        if (s == Q3_OK) {
            self->done++;
            result = PyTuple_Pack(4, t[0], t[1], t[2], t[3]);
        } else {
            release(self); /* the engine rolled the call back */
            q3_raise(c->st, &err);
        }
    }
    for (int i = 0; i < 4; i++) Py_XDECREF(t[i]);
    return result;
}

static PyObject *passes_close(q3py_passes_object *self, PyObject *unused) {
    (void)unused;
    if (!self->open) {
        PyErr_SetString(PyExc_RuntimeError, "close: the call is not open (closed, aborted, or a pass failed)");
        return NULL;
    }
    if (self->done < self->passes) {
        PyErr_Format(PyExc_RuntimeError, "close: %d of the call's %d passes have run; run the rest, or abort() to "
                     "roll the cache back", self->done, self->passes);
        return NULL;
    }
    release(self);
    PyObject *r = q3py_insides_result(&self->ins, Py_NewRef(Py_None));
    q3py_insides_clear(&self->ins);
    if (!r || r == Py_None) return r;
    PyObject *insides = PyTuple_GetSlice(r, 1, 5); /* (router_logits, experts, weights, attention) */
    Py_DECREF(r);
    return insides;
}

static PyObject *passes_abort(q3py_passes_object *self, PyObject *unused) {
    (void)unused;
    if (self->open) q3_layer_attention_passes_abort(self->call.co->cache, &self->call.a, &self->cur);
    release(self);
    q3py_insides_clear(&self->ins);
    Py_RETURN_NONE;
}

static PyObject *passes_enter(PyObject *self, PyObject *unused) {
    (void)unused;
    return Py_NewRef(self);
}

static PyObject *passes_exit(q3py_passes_object *self, PyObject *args) {
    (void)args;
    PyObject *r = passes_abort(self, NULL); /* a call left open (an exception, or no close()) is undone */
    Py_XDECREF(r);
    if (!r) return NULL;
    Py_RETURN_FALSE;
}

static PyObject *get_passes(q3py_passes_object *self, void *c) { (void)c; return PyLong_FromLong(self->passes); }
static PyObject *get_done(q3py_passes_object *self, void *c) { (void)c; return PyLong_FromLong(self->done); }
static PyObject *get_open(q3py_passes_object *self, void *c) { (void)c; return PyBool_FromLong(self->open); }
static PyObject *get_next_token(q3py_passes_object *self, void *c) {
    (void)c;
    return PyLong_FromLongLong(self->cur.next);
}

static PyMethodDef passes_methods[] = {
    {"close", (PyCFunction)passes_close, METH_NOARGS,
     "close()\n--\n\nEnds the call once every pass has run: the cache keeps what the passes appended. Returns the "
     "call's insides (router_logits, router_experts, router_weights, attention), None for what was not asked, or "
     "None when nothing was."},
    {"abort", (PyCFunction)passes_abort, METH_NOARGS,
     "abort()\n--\n\nEnds the call and rolls every sequence of it back to where the call began (nothing if the "
     "call is no longer open)."},
    {"__enter__", passes_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)passes_exit, METH_VARARGS, "Aborts the call if it is still open."},
    {NULL},
};

static PyGetSetDef passes_getset[] = {
    {"passes", (getter)get_passes, NULL, "the call's passes", NULL},
    {"done", (getter)get_done, NULL, "the passes run so far", NULL},
    {"open", (getter)get_open, NULL, "whether the call is open (neither closed, aborted, nor failed)", NULL},
    {"next_token", (getter)get_next_token, NULL, "the first token of each sequence the next pass takes", NULL},
    {NULL},
};

static PyType_Slot passes_slots[] = {
    {Py_tp_dealloc, passes_dealloc},
    {Py_tp_iter, PyObject_SelfIter},
    {Py_tp_iternext, passes_next},
    {Py_tp_methods, passes_methods},
    {Py_tp_getset, passes_getset},
    {Py_tp_doc, "The attention half of one layer call, a pass at a time; made by Layer.attention_passes."},
    {0, NULL},
};

PyType_Spec q3py_passes_spec = {
    .name = "qwen3layer._C.AttentionPasses",
    .basicsize = sizeof(q3py_passes_object),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = passes_slots,
};
