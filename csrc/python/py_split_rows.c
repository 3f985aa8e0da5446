/* _C.take_rows and _C.combine_rows: the rows of a layer whose experts are split between
 * places (qwen3layer/placement/hybrid.py, qwen3layer/placement/parallel.py), on host tensors
 * or, device=d, on CUDA device d's (queued on `stream`), every tensor on that one device
 * (others refused by the import, never copied). The views are the engine's to check
 * (q3_take_rows_check, q3_combine_rows: csrc/engine/split_rows.c); a refused call writes
 * nothing. */
#include "py_glue.h"

PyObject *q3py_take_rows(PyObject *module, PyObject *args, PyObject *kw) {
    static char *names[] = {"src", "rows", "out", "device", "stream", NULL};
    q3py_arg_view v[3] = {{.arg = "src"}, {.arg = "rows", .allow = Q3_VIEW_I32}, {.obj = Py_None, .arg = "out"}};
    PyObject *device_obj = NULL, *stream_obj = Py_None, *result = NULL;
    int device;
    void *stream;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|O$OO:take_rows", names, &v[0].obj, &v[1].obj, &v[2].obj,
                                     &device_obj, &stream_obj) ||
        q3py_place(device_obj, stream_obj, &device, &stream) < 0)
        return NULL;
    const q3_view *src = &v[0].view, *rows = &v[1].view, *out = v[2].obj != Py_None ? &v[2].view : NULL;
    if (!out) v[2].obj = NULL;
    q3_error err;
    q3_status s = Q3_OK;
    if (q3py_views_acquire(v, 3, device, stream) == 0 &&
        q3py_status(q3_take_rows_check(src, rows, out, &err), &err) == 0) {
        /* out [n, hidden] of src's dtype, made when not given (the views are checked) */
        const int64_t shape[2] = {rows->shape[0], src->shape[src->ndim - 1]};
        result = out ? Py_NewRef(v[2].obj)
                     : (PyObject *)q3py_tensor_new_on(q3py_state(module), src->dtype, 2, shape, device);
        void *dst = out ? out->data : result ? ((q3py_tensor_object *)result)->data : NULL;
        if (result) Q3PY_NOGIL(s = q3_take_rows(dst, src, rows, stream, &err));
    }
    if (q3py_status(s, &err) < 0) Py_CLEAR(result);
    q3py_views_release(v, 3);
    return result;
}

PyObject *q3py_combine_rows(PyObject *module, PyObject *args, PyObject *kw) {
    static char *names[] = {"resid", "parts", "rows", "out", "device", "stream", NULL};
    q3py_arg_view v[4] = {{.arg = "resid"}, {.arg = "parts"}, {.arg = "rows", .allow = Q3_VIEW_I32},
                          {.obj = Py_None, .arg = "out"}};
    PyObject *device_obj = NULL, *stream_obj = Py_None, *result = NULL;
    int device;
    void *stream;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|O$OO:combine_rows", names, &v[0].obj, &v[1].obj, &v[2].obj,
                                     &v[3].obj, &device_obj, &stream_obj) ||
        q3py_place(device_obj, stream_obj, &device, &stream) < 0)
        return NULL;
    const q3_view *out = v[3].obj != Py_None ? &v[3].view : NULL;
    if (!out) v[3].obj = NULL;
    q3_error err;
    if (q3py_views_acquire(v, 4, device, stream) == 0) {
        q3_status s;
        Q3PY_NOGIL(s = q3_combine_rows(&v[0].view, &v[1].view, &v[2].view, out, stream, &err));
        if (q3py_status(s, &err) == 0) result = Py_NewRef(Py_None);
    }
    q3py_views_release(v, 4);
    return result;
}
