/* _C.take_rows and _C.combine_rows: the rows of a layer whose experts are split between
 * places (qwen3layer/placement/hybrid.py, qwen3layer/placement/parallel.py), on host tensors
 * or, device=d, on CUDA device d's (queued on `stream`), every tensor on that one device
 * (others refused, never copied). Every argument is checked before the engine runs; a
 * refused call writes nothing. Tensors of rows may have leading dims ([..., hidden]: their
 * rows in order). */
#include "py_glue.h"

int q3py_check_rows(const q3_view *v, const char *arg, int64_t rows, int64_t cols, const char *cols_name) {
    q3_error err;
    return q3py_status(q3_view_check_rows(v, arg, rows, cols, cols_name, &err), &err);
}

/* rows: a contiguous int32 tensor [n] */
static int check_index(const q3_view *rows, int64_t n) {
    if (rows->ndim != 1 || (n >= 0 && rows->shape[0] != n) || !rows->contiguous) {
        char got[128];
        q3_format_shape(got, sizeof got, rows->ndim, rows->shape);
        if (n >= 0)
            PyErr_Format(PyExc_ValueError, "rows: expected a contiguous int32 tensor [%lld] (one per part), got %s",
                         (long long)n, got);
        else
            PyErr_Format(PyExc_ValueError, "rows: expected a contiguous int32 tensor [n], got %s", got);
        return -1;
    }
    return 0;
}

/* device: an int, -1 (the host) or a CUDA device (NULL: not given, -1); with the stream to
 * queue on */
static int parse_place(PyObject *device_obj, PyObject *stream_obj, int *device, void **stream) {
    *device = -1;
    if (!device_obj) return q3py_stream_on(stream_obj, -1, "host tensors (device=-1)", stream);
    if (!PyLong_Check(device_obj) || PyBool_Check(device_obj)) {
        PyErr_Format(PyExc_TypeError, "device: expected an int (-1: the host, else a CUDA device), got %.100s",
                     Py_TYPE(device_obj)->tp_name);
        return -1;
    }
    const long d = PyLong_AsLong(device_obj);
    if (d == -1 && PyErr_Occurred()) return -1;
    if (d < -1 || d > 1024) {
        PyErr_Format(PyExc_ValueError, "device: expected -1 (the host) or a CUDA device index, got %ld", d);
        return -1;
    }
    *device = (int)d;
    return q3py_stream_on(stream_obj, *device, "host tensors (device=-1)", stream);
}

PyObject *q3py_take_rows(PyObject *module, PyObject *args, PyObject *kw) {
    static char *names[] = {"src", "rows", "out", "device", "stream", NULL};
    PyObject *src_obj, *rows_obj, *out_obj = Py_None, *device_obj = NULL, *stream_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|O$OO:take_rows", names, &src_obj, &rows_obj, &out_obj, &device_obj,
                                     &stream_obj))
        return NULL;
    int device;
    void *stream;
    if (parse_place(device_obj, stream_obj, &device, &stream) < 0) return NULL;
    q3_module_state *st = PyModule_GetState(module);
    q3_view src = {0}, rows = {0}, out = {0};
    PyObject *result = NULL;
    if (q3_view_acquire_on(src_obj, "src", &src, device, 0, stream) < 0) goto done;
    if (src.ndim < 2) {
        PyErr_SetString(PyExc_ValueError, "src: expected a tensor [..., hidden] (rows to take from)");
        goto done;
    }
    const int64_t H = src.shape[src.ndim - 1], R = q3_view_rows(&src);
    if (q3py_check_rows(&src, "src", -1, H, "hidden") < 0) goto done;
    if (q3_view_acquire_on(rows_obj, "rows", &rows, device, Q3_VIEW_I32, stream) < 0 || check_index(&rows, -1) < 0)
        goto done;
    const int64_t n = rows.shape[0];
    if (out_obj != Py_None) {
        if (q3_view_acquire_on(out_obj, "out", &out, device, 0, stream) < 0 ||
            q3py_check_rows(&out, "out", n, H, "hidden") < 0 || q3py_view_require(&out, "out", Q3_NEED_WRITABLE) < 0)
            goto done;
        if (out.dtype != src.dtype) {
            PyErr_Format(PyExc_TypeError, "out: expected dtype %s (src's: rows are moved, not converted), got %s",
                         q3_dtype_name(src.dtype), q3_dtype_name(out.dtype));
            goto done;
        }
        if (q3_views_overlap(&out, &src) || q3_views_overlap(&out, &rows)) {
            PyErr_SetString(PyExc_ValueError, "out: overlaps src or rows; expected separate memory");
            goto done;
        }
        result = Py_NewRef(out_obj);
    } else {
        const int64_t shape[2] = {n, H};
        q3py_tensor_object *t = q3py_tensor_new_on(st, src.dtype, 2, shape, device);
        if (!t) goto done;
        result = (PyObject *)t;
        out.data = t->data;
    }
    q3_error err;
    q3_status s;
    Py_BEGIN_ALLOW_THREADS
    s = q3_take_rows(out.data, src.data, src.dtype, R, H, rows.data, n, device, stream, &err);
    Py_END_ALLOW_THREADS
    if (s != Q3_OK) {
        Py_CLEAR(result);
        q3_raise(st, &err);
    }
done:
    q3_view_release(&out);
    q3_view_release(&rows);
    q3_view_release(&src);
    return result;
}

PyObject *q3py_combine_rows(PyObject *module, PyObject *args, PyObject *kw) {
    static char *names[] = {"resid", "parts", "rows", "out", "device", "stream", NULL};
    PyObject *resid_obj, *parts_obj, *rows_obj, *out_obj = Py_None, *device_obj = NULL, *stream_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|O$OO:combine_rows", names, &resid_obj, &parts_obj, &rows_obj,
                                     &out_obj, &device_obj, &stream_obj))
        return NULL;
    int device;
    void *stream;
    if (parse_place(device_obj, stream_obj, &device, &stream) < 0) return NULL;
    q3_module_state *st = PyModule_GetState(module);
    q3_view resid = {0}, parts = {0}, rows = {0}, out = {0};
    PyObject *result = NULL;
    if (q3_view_acquire_on(resid_obj, "resid", &resid, device, 0, stream) < 0) goto done;
    if (resid.ndim < 2 || resid.dtype != Q3_F32 || !resid.contiguous || resid.readonly) {
        PyErr_SetString(PyExc_ValueError, "resid: expected a writable contiguous float32 tensor [R, hidden]");
        goto done;
    }
    const int64_t R = q3_view_rows(&resid), H = resid.shape[resid.ndim - 1];
    if (q3_view_acquire_on(parts_obj, "parts", &parts, device, 0, stream) < 0 ||
        q3py_check_rows(&parts, "parts", -1, H, "hidden") < 0)
        goto done;
    const int64_t n = q3_view_rows(&parts);
    if (q3_view_acquire_on(rows_obj, "rows", &rows, device, Q3_VIEW_I32, stream) < 0 || check_index(&rows, n) < 0)
        goto done;
    if (out_obj != Py_None) {
        if (q3_view_acquire_on(out_obj, "out", &out, device, 0, stream) < 0 ||
            q3py_check_rows(&out, "out", R, H, "hidden") < 0 || q3py_view_require(&out, "out", Q3_NEED_WRITABLE) < 0)
            goto done;
        if (out.data != resid.data && (q3_views_overlap(&out, &resid) || q3_views_overlap(&out, &parts))) {
            PyErr_SetString(PyExc_ValueError, "out: overlaps resid or parts; expected separate memory");
            goto done;
        }
    }
    if (q3_views_overlap(&resid, &parts)) {
        PyErr_SetString(PyExc_ValueError, "parts: overlaps resid; expected separate memory");
        goto done;
    }
    q3_error err;
    q3_status s;
    Py_BEGIN_ALLOW_THREADS
    s = q3_combine_rows(resid.data, R, H, parts.data, parts.dtype, rows.data, n, out_obj != Py_None ? out.data : NULL,
                        out.dtype, device, stream, &err);
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
