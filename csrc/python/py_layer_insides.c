/* The layer's insides on request (prefill/decode's return_router and return_attention): the
 * output tensors, made on the layer's device before the call runs and filled by the engine
 * from the call's own passes (q3_forward_args), and the tuple handed back. */
#include "py_layer_insides.h"

int q3py_insides_parse(q3_insides *ins, PyObject *router, PyObject *attention, PyObject *limit) {
    *ins = (q3_insides){0};
    if ((ins->router = PyObject_IsTrue(router)) < 0 || (ins->attention = PyObject_IsTrue(attention)) < 0) return -1;
    if (limit != Py_None && !ins->attention) {
        PyErr_SetString(PyExc_ValueError, "attention_limit: only with return_attention=True");
        return -1;
    }
    return q3py_attention_limit(limit, Q3_ATTENTION_LIMIT_DEFAULT, &ins->limit);
}

int q3py_insides_make(q3_insides *ins, q3_module_state *st, const q3_layer *layer, const q3_cache *c,
                    const q3_view *x, int device, q3_forward_args *a) {
    const q3_config *cfg = q3_layer_config(layer);
    if (ins->router) {
        int64_t shape[3];
        for (int d = 0; d < x->ndim - 1; d++) shape[d] = x->shape[d];
        shape[x->ndim - 1] = cfg->experts;
        if (!(ins->logits = q3py_tensor_new_on(st, Q3_F32, x->ndim, shape, device))) return -1;
        shape[x->ndim - 1] = cfg->top_k;
        if (!(ins->experts = q3py_tensor_new_on(st, Q3_I32, x->ndim, shape, device)) ||
            !(ins->weights = q3py_tensor_new_on(st, Q3_F32, x->ndim, shape, device)))
            return -1;
        a->router_logits = ins->logits->data;
        a->router_experts = ins->experts->data;
        a->router_weights = ins->weights->data;
    }
    if (ins->attention) {
        int64_t shape[4];
        q3_error err;
        if (q3py_status(q3_call_attention_maps(cfg, c, a, ins->limit, shape, &err), &err) < 0) return -1;
        if (!(ins->maps = q3py_tensor_new_on(st, Q3_F32, 4, shape, device))) return -1;
        a->attention = ins->maps->data;
        a->attention_context = shape[3];
    }
    return 0;
}

static PyObject *or_none(q3py_tensor_object *t) { return t ? Py_NewRef((PyObject *)t) : Py_NewRef(Py_None); }

PyObject *q3py_insides_result(q3_insides *ins, PyObject *y) {
    if (!y || (!ins->router && !ins->attention)) return y;
    PyObject *r = PyTuple_New(5);
    if (!r) {
        Py_DECREF(y);
        return NULL;
    }
    PyTuple_SET_ITEM(r, 0, y); /* each SET_ITEM takes the reference given */
    PyTuple_SET_ITEM(r, 1, or_none(ins->logits));
    PyTuple_SET_ITEM(r, 2, or_none(ins->experts));
    PyTuple_SET_ITEM(r, 3, or_none(ins->weights));
    PyTuple_SET_ITEM(r, 4, or_none(ins->maps));
    return r;
}

void q3py_insides_clear(q3_insides *ins) {
    Py_CLEAR(ins->logits);
    Py_CLEAR(ins->experts);
    Py_CLEAR(ins->weights);
    Py_CLEAR(ins->maps);
}
