/* layer.expert_half: the expert half of the layer (q3_layer_expert_half) on rows handed in,
 * for a caller that moves rows between processes (qwen3layer.parallel): tensors on the
 * layer's device (a CUDA layer's on its device; one elsewhere is refused, never copied).
 * Every argument is checked before the engine runs; a rejected call writes nothing.
 * Tensors of rows may have leading dims ([..., hidden]: their rows in order). */
#include "py_layer.h"

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
    q3_view rows = {0}, experts = {0}, weights = {0}, out = {0};
    PyObject *result = NULL;
    if (q3_view_acquire_on(rows_obj, "rows", &rows, self->device, 0, stream) < 0) goto done;
    if (q3py_check_rows(&rows, "rows", -1, c->hidden, "hidden") < 0) goto done;
    const int64_t n = q3py_rows_of(&rows);
    if (q3_view_acquire_on(experts_obj, "experts", &experts, self->device, Q3_VIEW_I32, stream) < 0 ||
        q3py_check_rows(&experts, "experts", n, c->top_k, "top_k") < 0)
        goto done;
    if (q3_view_acquire_on(weights_obj, "weights", &weights, self->device, 0, stream) < 0 ||
        q3py_check_rows(&weights, "weights", n, c->top_k, "top_k") < 0)
        goto done;
    if (weights.dtype != Q3_F32) {
        PyErr_Format(PyExc_TypeError, "weights: expected dtype float32 (the router's), got %s",
                     q3_dtype_name(weights.dtype));
        goto done;
    }
    if (out_obj != Py_None) {
        if (q3_view_acquire_on(out_obj, "out", &out, self->device, 0, stream) < 0 ||
            q3py_check_rows(&out, "out", n, c->hidden, "hidden") < 0)
            goto done;
        if (out.readonly) {
            PyErr_SetString(PyExc_ValueError, "out: expected a writable tensor, got a read-only one");
            goto done;
        }
        const q3_view *in[3] = {&rows, &experts, &weights};
        for (int i = 0; i < 3; i++)
            if (q3py_views_overlap(&out, in[i])) {
                PyErr_Format(PyExc_ValueError, "out: overlaps %s; expected separate memory",
                             i == 0 ? "rows" : i == 1 ? "experts" : "weights");
                goto done;
            }
        result = Py_NewRef(out_obj);
    } else {
        const int64_t shape[2] = {n, c->hidden};
        q3py_tensor_object *t = q3py_tensor_new_on(st, rows.dtype, 2, shape, self->device);
        if (!t) goto done;
        result = (PyObject *)t;
        out.data = t->data;
        out.dtype = rows.dtype;
    }
    const q3_expert_half_args a = {rows.data, rows.dtype, n, experts.data, weights.data, out.data, out.dtype, acc,
                                   stream};
    q3_error err;
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
    q3_view_release(&out);
    q3_view_release(&weights);
    q3_view_release(&experts);
    q3_view_release(&rows);
    return result;
}
