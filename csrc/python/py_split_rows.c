/* _C.take_rows and _C.combine_rows: the rows of a layer whose experts are split between
 * places (qwen3layer/placement/hybrid.py, qwen3layer/placement/parallel.py), on host tensors
 * or, device=d, on CUDA device d's (queued on `stream`), every tensor on that one device
 * (others refused by the import, never copied). The views are the engine's to check
 * (q3_take_rows_check, q3_combine_rows: csrc/engine/split_rows.c); a refused call writes
 * nothing. */
#include "py_glue.h"

PyObject *q3py_take_rows(PyObject *module, PyObject *args, PyObject *kw) {
    static char *names[] = {"src", "rows", "out", "device", "stream", NULL};
    PyObject *src_obj, *rows_obj, *out_obj = Py_None, *device_obj = NULL, *stream_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|O$OO:take_rows", names, &src_obj, &rows_obj, &out_obj, &device_obj,
                                     &stream_obj))
        return NULL;
    int device;
    void *stream;
    if (q3py_place(device_obj, stream_obj, &device, &stream) < 0) return NULL;
    const int given = out_obj != Py_None;
    q3_view src = {0}, rows = {0}, out = {0};
    q3_error err;
    q3_status s = Q3_OK;
    PyObject *result = NULL;
    if (q3_view_acquire_on(src_obj, "src", &src, device, 0, stream) == 0 &&
        q3_view_acquire_on(rows_obj, "rows", &rows, device, Q3_VIEW_I32, stream) == 0 &&
        (!given || q3_view_acquire_on(out_obj, "out", &out, device, 0, stream) == 0) &&
        q3py_status(q3_take_rows_check(&src, &rows, given ? &out : NULL, &err), &err) == 0) {
        /* out [n, hidden] of src's dtype, made when not given (the views are checked) */
        const int64_t shape[2] = {rows.shape[0], src.shape[src.ndim - 1]};
        result = given ? Py_NewRef(out_obj)
                       : (PyObject *)q3py_tensor_new_on(q3py_state(module), src.dtype, 2, shape, device);
        void *dst = given ? out.data : result ? ((q3py_tensor_object *)result)->data : NULL;
        if (result) {
            Py_BEGIN_ALLOW_THREADS
            s = q3_take_rows(dst, &src, &rows, stream, &err);
            Py_END_ALLOW_THREADS
        }
    }
    if (q3py_status(s, &err) < 0) Py_CLEAR(result);
    q3_view_release(&out);
    q3_view_release(&rows);
    q3_view_release(&src);
    return result;
}

PyObject *q3py_combine_rows(PyObject *module, PyObject *args, PyObject *kw) {
    (void)module;
    static char *names[] = {"resid", "parts", "rows", "out", "device", "stream", NULL};
    PyObject *resid_obj, *parts_obj, *rows_obj, *out_obj = Py_None, *device_obj = NULL, *stream_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|O$OO:combine_rows", names, &resid_obj, &parts_obj, &rows_obj,
                                     &out_obj, &device_obj, &stream_obj))
        return NULL;
    int device;
    void *stream;
    if (q3py_place(device_obj, stream_obj, &device, &stream) < 0) return NULL;
    const int given = out_obj != Py_None;
    q3_view resid = {0}, parts = {0}, rows = {0}, out = {0};
    q3_error err;
    PyObject *result = NULL;
    if (q3_view_acquire_on(resid_obj, "resid", &resid, device, 0, stream) == 0 &&
        q3_view_acquire_on(parts_obj, "parts", &parts, device, 0, stream) == 0 &&
        q3_view_acquire_on(rows_obj, "rows", &rows, device, Q3_VIEW_I32, stream) == 0 &&
        (!given || q3_view_acquire_on(out_obj, "out", &out, device, 0, stream) == 0)) {
        q3_status s;
        Py_BEGIN_ALLOW_THREADS
        s = q3_combine_rows(&resid, &parts, &rows, given ? &out : NULL, stream, &err);
        Py_END_ALLOW_THREADS
        if (q3py_status(s, &err) == 0) result = Py_NewRef(Py_None);
    }
    q3_view_release(&out);
    q3_view_release(&rows);
    q3_view_release(&parts);
    q3_view_release(&resid);
    return result;
}
