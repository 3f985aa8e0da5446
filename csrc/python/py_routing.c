/* _C.expert_counts: tokens per expert of one layer call, for qwen3layer.routing. The chosen
 * experts (a LayerTrace's experts, int32 [..., top_k], or any int32 tensor with __dlpack__)
 * are borrowed through DLPack; host tensors are counted in place (any strides), CUDA
 * tensors are copied to the host first: after a synchronisation of their device (the pass
 * that wrote them may still be queued on any stream), so the counts are of finished
 * choices. The counting is the engine's (csrc/engine/routing.c). */
#include <stdlib.h>

#include "py_glue.h"

/* obj's DLPack device: -1 for host memory (or anything else: the import then says why),
 * else the CUDA device index */
static int device_of(PyObject *obj) {
    PyObject *dev = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
    int type = Q3_DL_CPU, id = 0, device = -1;
    if (!dev) PyErr_Clear();
    else {
        if (PyArg_ParseTuple(dev, "ii", &type, &id) && type == Q3_DL_CUDA) device = id;
        PyErr_Clear();
        Py_DECREF(dev);
    }
    return device;
}

/* the view's int32 entries in a fresh contiguous host array of n (a CUDA view must be
 * contiguous); NULL with an exception */
static int32_t *device_to_host(const q3_view *v, int64_t n) {
    if (!v->contiguous) {
        PyErr_SetString(PyExc_ValueError, "experts: expected a contiguous tensor on a CUDA device (or a host "
                        "tensor of any layout), got a strided view");
        return NULL;
    }
    int32_t *host = malloc((size_t)(n ? n : 1) * sizeof *host);
    if (!host) return (int32_t *)PyErr_NoMemory();
    q3_error err;
    q3_status s;
    Py_BEGIN_ALLOW_THREADS /* the backend is loaded: checked before the import */
    s = q3_device_synchronize(v->device, &err);
    if (s == Q3_OK) s = q3_device_copy(host, v->data, (size_t)n * sizeof *host, 0, &err);
    Py_END_ALLOW_THREADS
    if (s != Q3_OK) {
        free(host);
        PyErr_Format(PyExc_RuntimeError, "experts: copying them from cuda:%d: %s", v->device, err.msg);
        return NULL;
    }
    return host;
}

static PyObject *expert_counts(PyObject *m, PyObject *args, PyObject *kw) {
    (void)m;
    static char *names[] = {"experts", "num_experts", NULL};
    PyObject *obj;
    int E;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Oi:expert_counts", names, &obj, &E)) return NULL;
    if (E < 1 || E > Q3_MAX_EXPERTS) {
        PyErr_Format(PyExc_ValueError, "num_experts: expected 1 <= num_experts <= %d, got %d", Q3_MAX_EXPERTS, E);
        return NULL;
    }
    const int device = device_of(obj);
    if (device >= 0 && !q3_cuda_loaded()) {
        PyErr_Format(PyExc_ValueError, "experts: expected a host tensor, or a CUDA one once the CUDA backend is "
                     "loaded (qwen3layer.cuda.load()), got a tensor on cuda:%d", device);
        return NULL;
    }
    q3_view v;
    if (q3_view_acquire_on(obj, "experts", &v, device, Q3_VIEW_HOST | Q3_VIEW_I32, NULL) < 0) return NULL;
    PyObject *result = NULL;
    int64_t *counts = malloc((size_t)E * sizeof *counts), n = 0;
    int32_t *host = NULL;
    if (!counts) {
        PyErr_NoMemory();
        goto done;
    }
    if (v.ndim < 1) {
        PyErr_SetString(PyExc_ValueError, "experts: expected at least 1 dimension ([..., top_k]), got a scalar");
        goto done;
    }
    q3_numel(v.ndim, v.shape, &n); /* fits: the import checked it */
    const int32_t *data = v.data;
    const int64_t *strides = v.strides;
    int64_t packed[Q3_MAX_DIM];
    if (v.device >= 0) {
        if (!(host = device_to_host(&v, n))) goto done;
        data = host;
        int64_t step = 1;
        for (int d = v.ndim - 1; d >= 0; d--) {
            packed[d] = step;
            step *= v.shape[d];
        }
        strides = packed;
    }
    q3_error err;
    q3_status s;
    Py_BEGIN_ALLOW_THREADS
    s = q3_count_experts(data, v.ndim, v.shape, strides, E, counts, &err);
    Py_END_ALLOW_THREADS
    if (s != Q3_OK) {
        q3_raise(NULL, &err);
        goto done;
    }
    if (!(result = PyList_New(E))) goto done;
    for (int e = 0; e < E; e++) {
        PyObject *c = PyLong_FromLongLong(counts[e]);
        if (!c) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, e, c);
    }
done:
    free(host);
    free(counts);
    q3_view_release(&v);
    return result;
}

PyMethodDef q3_routing_methods[] = {
    {"expert_counts", (PyCFunction)(void (*)(void))expert_counts, METH_VARARGS | METH_KEYWORDS,
     "expert_counts(experts, num_experts)\n--\n\nTokens per expert: a list of num_experts ints, how many "
     "entries of the int32 tensor experts ([..., top_k], host or CUDA) name each expert."},
    {NULL},
};
