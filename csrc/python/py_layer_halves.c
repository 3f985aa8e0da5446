/* The layer's two halves, for a caller that moves rows between them
 * (qwen3layer.placement.hybrid, qwen3layer.placement.parallel): layer.attention_half's outputs,
 * for a layer call (py_layer_call.c's) stopped after the router, and layer.expert_half
 * (q3_layer_expert_half) on rows handed in: tensors on the layer's device (a CUDA layer's on
 * its device; one elsewhere is refused, never copied).
 * Every argument is checked before the engine runs; a rejected call writes nothing.
 * Tensors of rows may have leading dims ([..., hidden]: their rows in order).
 * And the insides on request (prefill/decode's return_router and return_attention): the
 * output tensors, made on the layer's device before the call runs (their specs the engine's,
 * q3_call_insides_specs) and filled by the engine from the call's own passes, and the tuple
 * handed back. */
#include "py_layer.h"

/* New tensors of spec [n] on `device` (-1: the host) as a tuple, None for a spec of ndim 0, their
 * data in data [n] (NULL for None); NULL with an exception */
static PyObject *tensors_made(q3_module_state *st, const q3_tensor_spec *spec, int n, int device, void **data) {
    PyObject *t = PyTuple_New(n);
    for (int i = 0; t && i < n; i++) {
        q3py_tensor_object *o = spec[i].ndim ? q3py_tensor_new_on(st, spec[i].dtype, spec[i].ndim, spec[i].shape, device)
                                             : NULL;
        data[i] = o ? o->data : NULL;
        if (spec[i].ndim && !o) Py_CLEAR(t);
        else PyTuple_SET_ITEM(t, i, o ? (PyObject *)o : Py_NewRef(Py_None)); /* takes the reference */
    }
    return t;
}

int q3py_insides_make(q3_insides *ins, q3py_call *c, const q3py_layer_object *self) {
    q3_tensor_spec spec[4];
    void *data[4];
    q3_error err;
    if (!ins->router && !ins->attention) return 0;
    if (q3py_status(q3_call_insides_specs(q3_layer_config(self->layer), c->co->cache, &c->x, &c->a, ins->router,
                                          ins->attention, ins->limit, spec, &err), &err) < 0 ||
        !(ins->made = tensors_made(c->st, spec, 4, self->device, data)))
        return -1;
    q3_call_insides_bind(&c->a, data, spec);
    return 0;
}

PyObject *q3py_insides_result(q3_insides *ins, PyObject *y) {
    PyObject *r = y && ins->made ? PyTuple_New(5) : y;
    for (int i = 0; r != y && r && i < 5; i++) /* each SET_ITEM takes the reference given */
        PyTuple_SET_ITEM(r, i, i ? Py_NewRef(PyTuple_GET_ITEM(ins->made, i - 1)) : y);
    if (!r) Py_XDECREF(y);
    Py_CLEAR(ins->made);
    return r;
}

PyObject *q3py_half_outputs(q3py_call *c, q3py_layer_object *self, int64_t tokens, q3_attention_half_out *o) {
    q3_tensor_spec spec[4];
    void *data[4];
    q3_attention_half_specs(q3_layer_config(self->layer), &c->x, &c->a, tokens, spec);
    PyObject *t = tensors_made(c->st, spec, 4, self->device, data);
    if (t) *o = q3_attention_half_outputs(data, c->x.dtype);
    return t;
}

PyObject *q3py_layer_expert_half(q3py_layer_object *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"rows", "experts", "weights", "out", "accumulate", "stream", NULL};
    PyObject *rows_obj, *experts_obj, *weights_obj, *out_obj = Py_None, *stream_obj = Py_None;
    int acc = 0;
    void *stream;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|$OpO:expert_half", names, &rows_obj, &experts_obj, &weights_obj,
                                     &out_obj, &acc, &stream_obj) ||
        q3py_stream_on(stream_obj, self->device, "a cpu layer", &stream) < 0)
        return NULL;
    if (acc && out_obj == Py_None)
        return PyErr_Format(PyExc_ValueError, "out: accumulate=True adds into out, got out=None");
    q3_module_state *st = q3_state_of_type(Py_TYPE(self));
    if (!st) return NULL;
    q3py_arg_view v[4] = {{.obj = rows_obj, .arg = "rows"}, {.obj = experts_obj, .arg = "experts", .allow = Q3_VIEW_I32},
                          {.obj = weights_obj, .arg = "weights"}, {.obj = out_obj == Py_None ? NULL : out_obj, .arg = "out"}};
    PyObject *result = NULL;
    q3_expert_half_args a;
    q3_tensor_spec made; /* out, when not given */
    q3_error err;
    q3_status s;
    if (q3py_views_acquire(v, 4, self->device, stream) == 0 &&
        q3py_status(q3_expert_half_prepare(q3_layer_config(self->layer), &v[0].view, &v[1].view, &v[2].view,
                                           v[3].obj ? &v[3].view : NULL, acc, stream, &a, &made, &err), &err) == 0) {
        q3py_tensor_object *t = v[3].obj ? NULL : q3py_tensor_new_on(st, made.dtype, made.ndim, made.shape, self->device);
        if (t) a.out = t->data;
        result = t ? (PyObject *)t : v[3].obj ? Py_NewRef(out_obj) : NULL;
    }
    if (result) {
        Q3PY_LAYER_LOCKED(self, s = q3_layer_expert_half(self->layer, &a, &err));
        if (s != Q3_OK) {
            Py_CLEAR(result);
            q3_raise(st, &err);
        }
    }
    q3py_views_release(v, 4);
    return result;
}
