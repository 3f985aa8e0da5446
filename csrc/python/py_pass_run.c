/* AttentionPasses: the attention half of one layer call run a pass at a time
 * (q3_layer_attention_passes_begin / _pass / _abort), for a caller that moves each pass's rows
 * to experts elsewhere before the next pass (qwen3layer.placement.passes: the split and
 * expert-parallel layers). Made by Layer.attention_passes, which checks the whole call once; an
 * iterator of each pass's (resid, normed, experts, weights); close() ends the call and returns its
 * insides, abort() (or leaving a `with` block open, or dropping the object open) rolls the
 * cache back to where the call began, in the engine. The cache takes no other call meanwhile. */
#include "py_layer.h"

typedef struct {
    PyObject_HEAD
    q3py_layer_object *layer; /* strong: the engine layer the passes run on */
    q3py_call call;           /* the checked call: x's view, the cache (strong, below), the arguments */
    PyObject *cache_obj;      /* strong: call.co */
    q3_insides ins;           /* the whole call's insides, written pass by pass */
    q3_pass_cursor cur;       /* the engine's: the passes, those run, whether the call is open */
    int held;                 /* 1 while the call's views and the cache's claim are held */
} q3py_passes_object;

/* the call ended: rolled back if still open (the engine's abort), the view of x, the sequences,
 * the cache's claim and the insides given back */
static void end(q3py_passes_object *self) {
    if (self->cur.open) q3_layer_attention_passes_abort(self->call.co->cache, &self->call.a, &self->cur);
    if (self->held) {
        self->held = self->call.co->passes_open = 0;
        q3py_call_close(&self->call);
    }
    Py_CLEAR(self->ins.made);
}

PyObject *q3py_layer_attention_passes(q3py_layer_object *layer, q3py_call_args *p) {
    q3_module_state *st = q3_state_of_type(Py_TYPE(layer));
    q3py_passes_object *self = st ? (q3py_passes_object *)st->passes_type->tp_alloc(st->passes_type, 0) : NULL;
    if (!self) return NULL; /* zeroed: nothing held, the cursor closed */
    self->layer = (q3py_layer_object *)Py_NewRef((PyObject *)layer);
    self->ins = p->ins; /* its outputs are made below, after the checks */
    /* the call's parsing and the engine's checks of the whole call (the attention half's) */
    if (q3py_call_open(&self->call, layer, p, 1) == 0) {
        self->cache_obj = Py_NewRef(p->cache);
        self->call.a.interrupted = NULL; /* the caller's loop runs between the passes: Ctrl-C lands there */
        self->held = self->call.co->passes_open = 1;
        q3_error err;
        if (q3py_insides_make(&self->ins, &self->call, layer) == 0 &&
            q3_layer_attention_passes_begin(layer->layer, self->call.co->cache, &self->call.a, &self->cur, &err) == Q3_OK)
            return (PyObject *)self;
        if (!PyErr_Occurred()) q3_raise(st, &err);
    }
    Py_DECREF(self); /* releases: nothing ran */
    return NULL;
}

static void passes_dealloc(q3py_passes_object *self) {
    PyTypeObject *tp = Py_TYPE(self);
    end(self);
    Py_XDECREF(self->cache_obj);
    Py_XDECREF((PyObject *)self->layer);
    PyObject_Free(self);
    Py_DECREF(tp);
}

/* the next pass's four outputs: x's leading dims with the pass's tokens, on the layer's device */
static PyObject *passes_next(q3py_passes_object *self) {
    q3py_call *c = &self->call;
    const int64_t tokens = q3_pass_cursor_tokens(&c->a, &self->cur); /* 0: every pass has run, or not open */
    q3_attention_half_out half;
    PyObject *result = tokens ? q3py_half_outputs(c, self->layer, tokens, &half) : NULL; /* NULL alone: StopIteration */
    if (!result || q3py_call_run(c, self->layer, &half, &self->cur) == 0) return result;
    Py_DECREF(result);
    end(self); /* the engine rolled the call back */
    return NULL;
}

/* ends the call (the engine's check that every pass has run) and returns its insides */
static PyObject *passes_close(q3py_passes_object *self, PyObject *unused) {
    (void)unused;
    q3_error err;
    if (q3py_status(q3_layer_attention_passes_end(&self->cur, &err), &err) < 0) return NULL;
    PyObject *insides = Py_NewRef(self->ins.made ? self->ins.made : Py_None);
    end(self);
    return insides;
}

static PyObject *passes_abort(q3py_passes_object *self, PyObject *unused) { end(self); Py_RETURN_NONE; }

static PyObject *passes_enter(PyObject *self, PyObject *unused) { return Py_NewRef(self); }

static PyObject *passes_exit(q3py_passes_object *self, PyObject *args) {
    end(self); /* a call left open (an exception, or no close()) is undone */
    Py_RETURN_FALSE;
}

static PyObject *get_passes(q3py_passes_object *self, void *c) { return PyLong_FromLongLong(self->cur.passes); }
static PyObject *get_done(q3py_passes_object *self, void *c) { return PyLong_FromLongLong(self->cur.done); }
static PyObject *get_open(q3py_passes_object *self, void *c) { return PyBool_FromLong(self->cur.open); }
static PyObject *get_next_token(q3py_passes_object *self, void *c) { return PyLong_FromLongLong(self->cur.next); }

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
