/* The layer's two halves, for a caller that moves rows between them
 * (qwen3layer.placement.hybrid, qwen3layer.placement.parallel): layer.attention_half, a layer
 * call (py_layer_call.c's) stopped after the router, and layer.expert_half
 * (q3_layer_expert_half) on rows handed in: tensors on the layer's device (a CUDA layer's on
 * its device; one elsewhere is refused, never copied).
 * Every argument is checked before the engine runs; a rejected call writes nothing.
 * Tensors of rows may have leading dims ([..., hidden]: their rows in order). */
#include "py_layer.h"
#include "py_layer_insides.h"

int q3py_half_outputs(q3_module_state *st, const q3_config *cfg, int ndim, const int64_t *shape, q3_dtype dtype,
                      int device, q3py_tensor_object *t[4], q3_attention_half_out *o) {
    int64_t lead[Q3_MAX_DIM];
    memcpy(lead, shape, (size_t)ndim * sizeof *lead);
    lead[ndim - 1] = cfg->top_k;
    if (!(t[0] = q3py_tensor_new_on(st, Q3_F32, ndim, shape, device)) ||
        !(t[1] = q3py_tensor_new_on(st, dtype, ndim, shape, device)) ||
        !(t[2] = q3py_tensor_new_on(st, Q3_I32, ndim, lead, device)) ||
        !(t[3] = q3py_tensor_new_on(st, Q3_F32, ndim, lead, device)))
        return -1;
    *o = (q3_attention_half_out){t[0]->data, t[1]->data, dtype, t[2]->data, t[3]->data};
    return 0;
}

/* attention_half: (resid, normed, experts, weights), in the insides' tuple when asked for */
PyObject *q3py_layer_attention_half(q3py_layer_object *self, PyObject *x_obj, PyObject *cache_obj, int decode,
                                    PyObject *seq_obj, PyObject *chunk_obj, PyObject *stream_obj, q3_insides *ins,
                                    q3py_token_args tok) {
    q3py_call c;
    if (q3py_call_open(&c, self, x_obj, cache_obj, decode, seq_obj, chunk_obj, stream_obj, 1, tok) < 0) return NULL;
    q3py_tensor_object *t[4] = {NULL, NULL, NULL, NULL};
    q3_attention_half_out half;
    PyObject *result = NULL;
    if (q3py_half_outputs(c.st, q3_layer_config(self->layer), c.x.ndim, c.x.shape, c.x.dtype, self->device, t,
                          &half) == 0 &&
        q3py_insides_make(ins, c.st, self->layer, c.co->cache, &c.x, self->device, &c.a) == 0 &&
        q3py_call_run(&c, self, &half) == 0)
        result = PyTuple_Pack(4, t[0], t[1], t[2], t[3]);
    q3py_call_close(&c);
    for (int i = 0; i < 4; i++) Py_XDECREF(t[i]);
    result = q3py_insides_result(ins, result);
    q3py_insides_clear(ins);
    return result;
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
    if (acc && out_obj == Py_None) {
        PyErr_SetString(PyExc_ValueError, "out: accumulate=True adds into out, got out=None");
        return NULL;
    }
    q3_module_state *st = q3_state_of_type(Py_TYPE(self));
    if (!st) return NULL;
    const q3_config *c = q3_layer_config(self->layer);
    q3py_arg_view v[4] = {{.obj = rows_obj, .arg = "rows"}, {.obj = experts_obj, .arg = "experts", .allow = Q3_VIEW_I32},
                          {.obj = weights_obj, .arg = "weights"}, {.obj = out_obj == Py_None ? NULL : out_obj, .arg = "out"}};
    q3_view *rows = &v[0].view, *out = &v[3].view;
    PyObject *result = NULL;
    q3_error err;
    if (q3py_views_acquire(v, 4, self->device, stream) < 0 ||
        q3py_status(q3_expert_half_check_views(c, rows, &v[1].view, &v[2].view, v[3].obj ? out : NULL, &err), &err) < 0)
        goto done;
    const int64_t n = q3_view_rows(rows);
    if (out_obj != Py_None) {
        result = Py_NewRef(out_obj);
    } else {
        const int64_t shape[2] = {n, c->hidden};
        q3py_tensor_object *t = q3py_tensor_new_on(st, rows->dtype, 2, shape, self->device);
        if (!t) goto done;
        result = (PyObject *)t;
        out->data = t->data;
        out->dtype = rows->dtype;
    }
    const q3_expert_half_args a = {rows->data, rows->dtype, n, v[1].view.data, v[2].view.data, out->data, out->dtype,
                                   acc, stream};
    q3_status s;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    s = q3_layer_expert_half(self->layer, &a, &err);
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
    if (s != Q3_OK) {
        Py_CLEAR(result);
        q3_raise(st, &err);
    }
done:
    q3py_views_release(v, 4);
    return result;
}
