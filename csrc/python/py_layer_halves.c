/* layer.expert_half: the expert half of the layer (q3_layer_expert_half) on rows handed in,
 * for a caller that moves rows between processes (qwen3layer.parallel): tensors on the
 * layer's device (a CUDA layer's on its device; one elsewhere is refused, never copied).
 * Every argument is checked before the engine runs; a rejected call writes nothing.
 * combine_rows: on host tensors. */
#include "py_layer.h"

/* v is a contiguous tensor [rows, cols] (rows < 0: any) of one of the dtypes allowed */
static int check_2d(const q3_view *v, const char *arg, int64_t rows, int64_t cols, const char *cols_name) {
    if (v->ndim != 2 || (rows >= 0 && v->shape[0] != rows) || v->shape[1] != cols) {
        char got[128];
        q3_format_shape(got, sizeof got, v->ndim, v->shape);
        if (rows >= 0)
            PyErr_Format(PyExc_ValueError, "%s: expected shape [%lld, %s=%lld] (rows'), got %s", arg, (long long)rows,
                         cols_name, (long long)cols, got);
        else
            PyErr_Format(PyExc_ValueError, "%s: expected shape [n, %s=%lld], got %s", arg, cols_name,
                         (long long)cols, got);
        return -1;
    }
    if (!v->contiguous) {
        PyErr_Format(PyExc_ValueError, "%s: expected a contiguous tensor (call .contiguous())", arg);
        return -1;
    }
    return 0;
}

static size_t view_bytes(const q3_view *v) { return (size_t)(v->shape[0] * v->shape[1]) * q3_dtype_size(v->dtype); }

static int overlaps(const q3_view *a, const q3_view *b) {
    const uintptr_t pa = (uintptr_t)a->data, pb = (uintptr_t)b->data;
    return pa < pb + view_bytes(b) && pb < pa + view_bytes(a) && view_bytes(a) && view_bytes(b);
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
    q3_view rows = {0}, experts = {0}, weights = {0}, out = {0};
    PyObject *result = NULL;
    if (q3_view_acquire_on(rows_obj, "rows", &rows, self->device, 0, stream) < 0) goto done;
    if (check_2d(&rows, "rows", -1, c->hidden, "hidden") < 0) goto done;
    const int64_t n = rows.shape[0];
    if (q3_view_acquire_on(experts_obj, "experts", &experts, self->device, Q3_VIEW_I32, stream) < 0 ||
        check_2d(&experts, "experts", n, c->top_k, "top_k") < 0)
        goto done;
    if (q3_view_acquire_on(weights_obj, "weights", &weights, self->device, 0, stream) < 0 ||
        check_2d(&weights, "weights", n, c->top_k, "top_k") < 0)
        goto done;
    if (weights.dtype != Q3_F32) {
        PyErr_Format(PyExc_TypeError, "weights: expected dtype float32 (the router's), got %s",
                     q3_dtype_name(weights.dtype));
        goto done;
    }
    if (out_obj != Py_None) {
        if (q3_view_acquire_on(out_obj, "out", &out, self->device, 0, stream) < 0 ||
            check_2d(&out, "out", n, c->hidden, "hidden") < 0)
            goto done;
        if (out.readonly) {
            PyErr_SetString(PyExc_ValueError, "out: expected a writable tensor, got a read-only one");
            goto done;
        }
        const q3_view *in[3] = {&rows, &experts, &weights};
        for (int i = 0; i < 3; i++)
            if (overlaps(&out, in[i])) {
                PyErr_Format(PyExc_ValueError, "out: overlaps %s; expected separate memory",
                             i == 0 ? "rows" : i == 1 ? "experts" : "weights");
                goto done;
            }
        result = Py_NewRef(out_obj);
    } else {
        q3py_tensor_object *t = q3py_tensor_new_on(st, rows.dtype, 2, rows.shape, self->device);
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

PyObject *q3py_combine_rows(PyObject *module, PyObject *args, PyObject *kw) {
    static char *names[] = {"resid", "parts", "rows", "out", NULL};
    PyObject *resid_obj, *parts_obj, *rows_obj, *out_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|O:combine_rows", names, &resid_obj, &parts_obj, &rows_obj,
                                     &out_obj))
        return NULL;
    q3_module_state *st = PyModule_GetState(module);
    q3_view resid = {0}, parts = {0}, rows = {0}, out = {0};
    PyObject *result = NULL;
    if (q3_view_acquire_on(resid_obj, "resid", &resid, -1, 0, NULL) < 0) goto done;
    if (resid.ndim != 2 || resid.dtype != Q3_F32 || !resid.contiguous || resid.readonly) {
        PyErr_SetString(PyExc_ValueError, "resid: expected a writable contiguous float32 tensor [R, hidden]");
        goto done;
    }
    const int64_t R = resid.shape[0], H = resid.shape[1];
    char hidden[32];
    snprintf(hidden, sizeof hidden, "hidden");
    if (q3_view_acquire_on(parts_obj, "parts", &parts, -1, 0, NULL) < 0 ||
        check_2d(&parts, "parts", -1, H, hidden) < 0)
        goto done;
    if (q3_view_acquire_on(rows_obj, "rows", &rows, -1, Q3_VIEW_I32, NULL) < 0) goto done;
    if (rows.ndim != 1 || rows.shape[0] != parts.shape[0] || !rows.contiguous) {
        char got[128];
        q3_format_shape(got, sizeof got, rows.ndim, rows.shape);
        PyErr_Format(PyExc_ValueError, "rows: expected a contiguous int32 tensor [%lld] (one per part), got %s",
                     (long long)parts.shape[0], got);
        goto done;
    }
    if (out_obj != Py_None) {
        if (q3_view_acquire_on(out_obj, "out", &out, -1, 0, NULL) < 0 || check_2d(&out, "out", R, H, hidden) < 0)
            goto done;
        if (out.readonly) {
            PyErr_SetString(PyExc_ValueError, "out: expected a writable tensor, got a read-only one");
            goto done;
        }
        if (out.data != resid.data && (overlaps(&out, &resid) || overlaps(&out, &parts))) {
            PyErr_SetString(PyExc_ValueError, "out: overlaps resid or parts; expected separate memory");
            goto done;
        }
    }
    if (overlaps(&resid, &parts)) {
        PyErr_SetString(PyExc_ValueError, "parts: overlaps resid; expected separate memory");
        goto done;
    }
    q3_error err;
    q3_status s;
    Py_BEGIN_ALLOW_THREADS
    s = q3_combine_rows(resid.data, R, H, parts.data, parts.dtype, rows.data, parts.shape[0],
                        out_obj != Py_None ? out.data : NULL, out.dtype, &err);
    Py_END_ALLOW_THREADS
    if (s != Q3_OK) q3_raise(st, &err);
    else result = Py_NewRef(Py_None);
done:
    q3_view_release(&out);
    q3_view_release(&rows);
    q3_view_release(&parts);
    q3_view_release(&resid);
    return result;
}
