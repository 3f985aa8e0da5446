/* The module's CUDA functions: opening the library, devices, synchronisation, the kept
 * device blocks, a layer's prefill MoE path, its measured choices and the times its measurements
 * take on the SIMT executor. Added to qwen3layer._C by py_module.c; the kernel self-check,
 * timings and thread schedules are qwen3layer._testing's (csrc/testing). */
#include "py_glue.h"

#include "py_layer.h"

static PyObject *cuda_open(PyObject *m, PyObject *arg) {
    const char *path = PyUnicode_AsUTF8(arg);
    if (!path) return NULL;
    q3_error err;
    q3_status s;
    int devices;
    Q3PY_NOGIL(s = q3_cuda_open(path, &devices, &err));
    return q3py_status(s, &err) < 0 ? NULL : PyLong_FromLong(devices);
}

static PyObject *cuda_blas_open(PyObject *m, PyObject *arg) {
    const char *path = arg == Py_None ? NULL : PyUnicode_AsUTF8(arg);
    q3_error err;
    if ((arg != Py_None && !path) || q3py_status(q3_cuda_require("cuda", &err), &err) < 0) return NULL;
    return PyBool_FromLong(q3_cuda_blas_open(path));
}

static PyObject *cuda_blas_enable(PyObject *m, PyObject *args) {
    PyObject *on = Py_None;
    if (!PyArg_ParseTuple(args, "|O:cuda_blas_enable", &on)) return NULL;
    const int flag = on == Py_None ? -1 : PyObject_IsTrue(on);
    q3_error err;
    if ((flag == -1 && on != Py_None) || q3py_status(q3_cuda_require("cuda", &err), &err) < 0) return NULL;
    return PyBool_FromLong(q3_cuda_blas_enable(flag));
}

static PyObject *cuda_device_count(PyObject *m, PyObject *unused) { return PyLong_FromLong(q3_cuda_device_count()); }

static PyObject *cuda_synchronize(PyObject *m, PyObject *args) {
    int device = 0;
    q3_error err;
    q3_status s;
    if (!PyArg_ParseTuple(args, "|i:cuda_synchronize", &device) ||
        q3py_status(q3_cuda_require("cuda_synchronize", &err), &err) < 0)
        return NULL;
    Q3PY_NOGIL(s = q3_device_synchronize(device, &err));
    if (s != Q3_OK) return PyErr_Format(PyExc_RuntimeError, "cuda_synchronize(%d): %s", device, err.msg);
    Py_RETURN_NONE;
}

/* the engine layer of a Layer object; NULL with TypeError */
static q3py_layer_object *layer_of(PyObject *m, PyObject *obj) {
    q3_module_state *st = PyModule_GetState(m);
    if (PyObject_TypeCheck(obj, st->layer_type)) return (q3py_layer_object *)obj;
    PyErr_Format(PyExc_TypeError, "layer: expected a Layer, got %s", Py_TYPE(obj)->tp_name);
    return NULL;
}

static PyObject *cuda_moe_path(PyObject *m, PyObject *args) {
    PyObject *obj, *name = Py_None;
    if (!PyArg_ParseTuple(args, "O|O:cuda_moe_path", &obj, &name)) return NULL;
    q3py_layer_object *self = layer_of(m, obj);
    if (!self) return NULL;
    if (name != Py_None && !PyUnicode_Check(name))
        return PyErr_Format(PyExc_TypeError, "path: expected a str or None, got %s", Py_TYPE(name)->tp_name);
    const char *chosen = name == Py_None ? NULL : PyUnicode_AsUTF8(name), *now = NULL;
    if (name != Py_None && !chosen) return NULL;
    q3_error err;
    q3_status s;
    Q3PY_LAYER_LOCKED(self, s = q3_layer_cuda_moe_path_named(self->layer, chosen, &now, &err));
    return q3py_status(s, &err) < 0 ? NULL : PyUnicode_FromString(now);
}

/* {path name: ms} or None -> the layer's measurements' times */
static PyObject *cuda_moe_inject_times(PyObject *m, PyObject *args) {
    PyObject *obj, *times = Py_None;
    if (!PyArg_ParseTuple(args, "O|O:cuda_moe_inject_times", &obj, &times)) return NULL;
    q3py_layer_object *self = layer_of(m, obj);
    if (!self) return NULL;
    if (times != Py_None && !PyDict_Check(times))
        return PyErr_Format(PyExc_TypeError, "times: expected a dict or None, got %s", Py_TYPE(times)->tp_name);
    float ms[Q3_MOE_PATHS];
    for (int i = 0; times != Py_None && i < Q3_MOE_PATHS; i++) {
        PyObject *v = PyDict_GetItemString(times, q3_moe_path_name(i));
        if (!v) return PyErr_Format(PyExc_ValueError, "times: expected a time for '%s'", q3_moe_path_name(i));
        const double d = PyFloat_AsDouble(v);
        if (d == -1.0 && PyErr_Occurred()) return NULL;
        ms[i] = (float)d;
    }
    q3_error err;
    q3_status s;
    Q3PY_LAYER_LOCKED(self, s = q3_layer_cuda_moe_inject_times(self->layer, times == Py_None ? NULL : ms, &err));
    return q3py_status(s, &err) < 0 ? NULL : Py_NewRef(Py_None);
}

/* {(lo, hi): (chosen, {path: ms})} of a CUDA layer's measured size classes */
static PyObject *cuda_moe_choice(PyObject *m, PyObject *args) {
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "O:cuda_moe_choice", &obj)) return NULL;
    const q3py_layer_object *self = layer_of(m, obj);
    if (!self) return NULL;
    q3_moe_class k[Q3_MOE_SIZE_CLASSES];
    const int n = q3_layer_cuda_moe_classes(self->layer, k);
    PyObject *out = PyDict_New();
    for (int c = 0; out && c < n; c++) {
        PyObject *times = PyDict_New();
        for (int i = 0; times && i < Q3_MOE_PATHS; i++) {
            PyObject *t = k[c].ms[i] < 0.0f ? NULL : PyFloat_FromDouble(k[c].ms[i]);
            if (k[c].ms[i] >= 0.0f && (!t || PyDict_SetItemString(times, q3_moe_path_name(i), t) < 0)) Py_CLEAR(times);
            Py_XDECREF(t);
        }
        /* N: value takes times (NULL: value NULL, the exception kept) */
        PyObject *value = Py_BuildValue("(sN)", q3_moe_path_name(k[c].path), times);
        PyObject *key = value ? Py_BuildValue("(LL)", (long long)k[c].lo, (long long)k[c].hi) : NULL;
        if (!key || !value || PyDict_SetItem(out, key, value) < 0) Py_CLEAR(out);
        Py_XDECREF(key);
        Py_XDECREF(value);
    }
    return out;
}

static PyObject *cuda_empty_cache(PyObject *m, PyObject *unused) {
    q3_device_release_kept();
    Py_RETURN_NONE;
}

/* [(device, nbytes, address)] of the kept blocks (csrc/cuda/buffers.c), oldest first */
static PyObject *cuda_cached_blocks(PyObject *m, PyObject *unused) {
    int device;
    size_t bytes;
    void *p;
    const int n = q3_device_kept(0, &device, &bytes, &p);
    PyObject *list = PyList_New(n);
    for (int i = 0; list && i < n; i++) {
        q3_device_kept(i, &device, &bytes, &p);
        PyObject *item = Py_BuildValue("(inK)", device, (Py_ssize_t)bytes, (unsigned long long)(uintptr_t)p);
        if (!item) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, item);
    }
    return list;
}

PyMethodDef q3_cuda_methods[] = {
    {"cuda_empty_cache", cuda_empty_cache, METH_NOARGS,
     "cuda_empty_cache()\n--\n\nFrees the device blocks of dead tensors kept for reuse by new ones."},
    {"cuda_cached_blocks", cuda_cached_blocks, METH_NOARGS,
     "cuda_cached_blocks()\n--\n\n[(device, nbytes, address)] of the device blocks kept for reuse, oldest first."},
    {"cuda_open", cuda_open, METH_O,
     "cuda_open(path)\n--\n\nLoads the CUDA launcher library; returns the CUDA devices it sees. With none it is "
     "not made the backend (another library may be opened after it)."},
    {"cuda_blas_open", cuda_blas_open, METH_O,
     "cuda_blas_open(path)\n--\n\nOpen cuBLAS for the prefill GEMMs (path None: the usual names); True if usable."},
    {"cuda_blas_enable", cuda_blas_enable, METH_VARARGS,
     "cuda_blas_enable(on=None)\n--\n\nThe prefill GEMMs through cuBLAS (True) or our WMMA kernel (False), where "
     "cuBLAS was opened; None only reads. Returns whether cuBLAS is in use now."},
    {"cuda_device_count", cuda_device_count, METH_NOARGS,
     "cuda_device_count()\n--\n\nCUDA devices visible (0 before cuda_open or without a driver)."},
    {"cuda_synchronize", cuda_synchronize, METH_VARARGS,
     "cuda_synchronize(device=0)\n--\n\nWaits until everything queued on the device has run."},
    {"cuda_moe_path", cuda_moe_path, METH_VARARGS,
     "cuda_moe_path(layer, path=None)\n--\n\nThe prefill MoE path of a CUDA layer: 'measured' (the default: the "
     "fastest of the paths a pass can take, timed on the layer's first pass of each size class), or one forced: "
     "'per_expert_wmma', 'per_expert_cublas', 'grouped_wmma' or 'grouped_cublas' (cublasGemmGroupedBatchedEx). None "
     "only reads it. Returns the setting."},
    {"cuda_moe_inject_times", cuda_moe_inject_times, METH_VARARGS,
     "cuda_moe_inject_times(layer, times=None)\n--\n\nFor tests on the SIMT executor (whose event times mean "
     "nothing): {path: ms} for every path, which the layer's measurements then take instead of the events'; None: "
     "the events'."},
    {"cuda_moe_choice", cuda_moe_choice, METH_VARARGS,
     "cuda_moe_choice(layer)\n--\n\nA CUDA layer's measured prefill MoE paths: {(lo, hi): (chosen, {path: ms})} "
     "for each size class measured (passes of lo..hi rows)."},
    {NULL},
};
