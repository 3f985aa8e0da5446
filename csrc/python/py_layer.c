/* qwen3layer._C.Layer: the engine layer behind qwen3layer.DecoderLayer.
 *
 * Construction borrows every weight through DLPack (no copy when it is contiguous and
 * of the layer's dtype, and on a CUDA device 16-byte aligned; otherwise one conversion,
 * now, recorded in `converted`).
 * prefill/decode check the call, release the GIL and run q3_layer_forward under the
 * layer's lock (the workspace is per layer). */
#include <string.h>

#include "../cuda/backend.h"
#include "py_layer.h"

#define FUSED_GATE_UP "mlp.experts.gate_up_proj"
#define FUSED_DOWN "mlp.experts.down_proj"


/* ---- weights --------------------------------------------------------------------- */

/* a converted copy, owned by the layer from now on (freed with it), named in `converted` */
static void *record_converted(q3_layer_object *self, const char *name, void *copy) {
    self->owned[self->n_owned++] = copy;
    PyObject *nm = PyUnicode_FromString(name);
    if (!nm || PyList_Append(self->converted, nm) < 0) {
        Py_XDECREF(nm);
        return NULL;
    }
    Py_DECREF(nm);
    return copy;
}

/* a copy of the contiguous device weight v (bytes long) in a new block of the layer's
 * device, or NULL with an exception */
static void *copy_on_device(q3_layer_object *self, const q3_view *v, size_t bytes, const char *arg) {
    const q3_cuda_ops *g = q3_cuda();
    void *dev = NULL;
    int code = g->set_device(self->device);
    if (!code) code = g->malloc_device(&dev, bytes ? bytes : 1);
    /* on the legacy default stream, which the producer's export was asked to order its
     * work before (DLPack stream 1); then waited for, as the upload of a host weight is */
    if (!code) code = g->copy_device_async(dev, v->data, bytes, NULL);
    if (!code) code = g->synchronize();
    if (code) {
        if (dev) g->free_device(dev);
        PyErr_Format(PyExc_MemoryError, "%s: cannot copy %zu bytes to an aligned block on cuda:%d: %s", arg, bytes,
                     self->device, g->error_string(code));
        return NULL;
    }
    return dev;
}

void *q3_layer_device_copy(q3_layer_object *self, const q3_view *v, size_t bytes, const char *name, const char *arg) {
    void *dev = NULL;
    if (v->device >= 0) {
        dev = copy_on_device(self, v, bytes, arg);
    } else { /* from the host: uploaded once, now */
        const q3_cuda_ops *g = q3_cuda();
        int code = g->set_device(self->device);
        if (!code) code = g->malloc_device(&dev, bytes ? bytes : 1);
        if (!code) code = g->copy(dev, v->data, bytes, 1);
        if (code) {
            if (dev) g->free_device(dev);
            PyErr_Format(PyExc_MemoryError, "%s: cannot copy %zu bytes to cuda:%d: %s", arg, bytes, self->device,
                         g->error_string(code));
            return NULL;
        }
    }
    return dev ? record_converted(self, name, dev) : NULL;
}

/* Imports weights[name] into the next view slot (not yet counted) and checks its shape;
 * `allow` as for q3_view_acquire_on. Returns the view, or NULL with an exception. */
q3_view *q3_layer_acquire_shaped(q3_layer_object *self, PyObject *weights, const char *name, int rank,
                               const int64_t *dims, int allow, char *arg, size_t arg_size) {
    PyObject *obj = PyDict_GetItemString(weights, name);
    if (!obj) {
        PyErr_Format(PyExc_ValueError, "weights: missing '%s'", name);
        return NULL;
    }
    snprintf(arg, arg_size, "weights['%s']", name);
    q3_view *v = &self->views[self->n_views];
    if (q3_view_acquire_on(obj, arg, v, self->device, allow, NULL) < 0) return NULL;
    int fits_shape = v->ndim == rank;
    for (int d = 0; fits_shape && d < rank; d++) fits_shape = v->shape[d] == dims[d];
    if (!fits_shape) {
        char want[96], got[96];
        q3_format_shape(want, sizeof want, rank, dims);
        q3_format_shape(got, sizeof got, v->ndim, v->shape);
        PyErr_Format(PyExc_ValueError, "%s: expected shape %s, got %s", arg, want, got);
        q3_view_release(v);
        return NULL;
    }
    return v;
}

/* Imports weights[name], checks its shape, and returns the pointer the engine will read:
 * the producer's memory, or a converted copy when dtype or layout do not fit. A CUDA
 * layer's weights must also start at a multiple of Q3_CUDA_WEIGHT_ALIGN bytes (the kernels'
 * 16-byte loads; csrc/cuda/q3_cuda.h says which, and why experts of a fused tensor follow
 * its base): a device weight elsewhere (a view at an odd offset) would fault there, so it
 * is copied once into a cudaMalloc block (256-byte aligned) and listed in `converted`. */
const void *q3_layer_take_weight(q3_layer_object *self, PyObject *weights, const char *name,
                               int rank, const int64_t *dims, q3_dtype dtype) {
    char arg[160];
    q3_view *v = q3_layer_acquire_shaped(self, weights, name, rank, dims, Q3_VIEW_HOST, arg, sizeof arg);
    if (!v) return NULL;
    const int aligned = v->device < 0 || (uintptr_t)v->data % Q3_CUDA_WEIGHT_ALIGN == 0;
    if (v->device == self->device && v->dtype == dtype && v->contiguous && aligned) {
        self->n_views++;
        return v->data;
    }
    if (v->device >= 0 && (v->dtype != dtype || !v->contiguous)) {
        PyErr_Format(PyExc_ValueError, "%s: a CUDA weight must be contiguous and of the layer's dtype (%s), got "
                     "a%s %s tensor", arg, q3_dtype_name(dtype), v->contiguous ? "" : " non-contiguous",
                     q3_dtype_name(v->dtype));
        q3_view_release(v);
        return NULL;
    }
    size_t n = 1;
    for (int d = 0; d < rank; d++) n *= (size_t)dims[d];
    const size_t bytes = n * q3_dtype_size(dtype);
    void *copy;
    if (v->device >= 0) { /* of the layer's dtype and contiguous, but not 16-byte aligned */
        copy = copy_on_device(self, v, bytes, arg);
        q3_view_release(v);
        if (!copy) return NULL;
        return record_converted(self, name, copy);
    }
    copy = q3_alloc(bytes);
    if (!copy) {
        q3_view_release(v);
        PyErr_NoMemory();
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    q3_copy_strided(copy, dtype, v->data, v->dtype, rank, v->shape, v->strides);
    Py_END_ALLOW_THREADS
    q3_view_release(v);
    if (self->device >= 0) { /* a host weight for a CUDA layer: uploaded once, now */
        void *dev = NULL;
        const q3_cuda_ops *g = q3_cuda();
        int code = g->set_device(self->device);
        if (!code) code = g->malloc_device(&dev, bytes);
        if (!code) code = g->copy(dev, copy, bytes, 1);
        q3_free(copy);
        if (code) {
            if (dev) g->free_device(dev);
            PyErr_Format(PyExc_MemoryError, "%s: cannot copy %zu bytes to cuda:%d: %s", arg, bytes, self->device,
                         g->error_string(code));
            return NULL;
        }
        copy = dev;
    }
    return record_converted(self, name, copy);
}

int q3_layer_record_ptr(q3_layer_object *self, const char *name, const void *p) {
    PyObject *addr = PyLong_FromVoidPtr((void *)p);
    const int rc = addr ? PyDict_SetItemString(self->weight_ptrs, name, addr) : -1;
    Py_XDECREF(addr);
    return rc;
}

static int take_experts(q3_layer_object *self, PyObject *weights, const q3_config *c, q3_dtype dt) {
    const int E = c->experts;
    const int64_t H = c->hidden, I = c->moe_inter;
    const void **gate = self->expert_ptrs, **up = gate + E, **down = up + E;
    if (PyDict_GetItemString(weights, FUSED_GATE_UP)) {
        /* transformers 5.x: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I] */
        const int64_t gu_dims[3] = {E, 2 * I, H}, d_dims[3] = {E, H, I};
        const char *gu = q3_layer_take_weight(self, weights, FUSED_GATE_UP, 3, gu_dims, dt);
        if (!gu) return -1;
        const char *dn = q3_layer_take_weight(self, weights, FUSED_DOWN, 3, d_dims, dt);
        if (!dn) return -1;
        const size_t es = q3_dtype_size(dt);
        for (int e = 0; e < E; e++) {
            gate[e] = gu + (size_t)e * 2 * I * H * es;
            up[e] = gu + ((size_t)e * 2 * I + I) * H * es;
            down[e] = dn + (size_t)e * H * I * es;
        }
        return q3_layer_record_ptr(self, FUSED_GATE_UP, gu) || q3_layer_record_ptr(self, FUSED_DOWN, dn) ? -1 : 0;
    }
    const void **slots[Q3_X_COUNT] = {gate, up, down};
    for (int e = 0; e < E; e++)
        for (int x = 0; x < Q3_X_COUNT; x++) {
            char name[96];
            int64_t dims[2];
            snprintf(name, sizeof name, "mlp.experts.%d.%s.weight", e, q3_expert_weight_name(x));
            q3_expert_weight_shape(c, x, dims);
            slots[x][e] = q3_layer_take_weight(self, weights, name, 2, dims, dt);
            if (!slots[x][e] || q3_layer_record_ptr(self, name, slots[x][e]) < 0) return -1;
        }
    return 0;
}

/* the dtype of weights[name], imported as `allow` lets */
static int weight_dtype(PyObject *weights, const char *name, int device, int allow, q3_dtype *dt) {
    PyObject *obj = PyDict_GetItemString(weights, name);
    if (!obj) {
        PyErr_Format(PyExc_ValueError, "weights: missing '%s'", name);
        return -1;
    }
    q3_view v;
    char arg[96];
    snprintf(arg, sizeof arg, "weights['%s']", name);
    if (q3_view_acquire_on(obj, arg, &v, device, allow, NULL) < 0) return -1;
    *dt = v.dtype;
    q3_view_release(&v);
    return 0;
}

int q3_layer_scale_dtype(PyObject *weights, int device, q3_dtype *sdt) {
    const char *name = "self_attn.q_proj.weight_scale_inv";
    if (!PyDict_GetItemString(weights, name)) {
        PyErr_Format(PyExc_ValueError, "weights['self_attn.q_proj.weight']: an FP8 weight without its scale: "
                     "missing '%s'", name);
        return -1;
    }
    return weight_dtype(weights, name, device, Q3_VIEW_HOST, sdt);
}

/* The weight format (the argument; None: FP8 when self_attn.q_proj.weight is float8_e4m3fn)
 * and the dtype of the layer (the argument, else the dtype of q_proj, or in the FP8 format
 * that of input_layernorm, whose dtype the norms and the router keep). */
static int layer_dtype(PyObject *weights, PyObject *dtype_obj, PyObject *format_obj, int device, q3_dtype *dt,
                       q3_weight_format *wf) {
    const char *q_proj = q3_dense_weight_name(Q3_W_Q_PROJ);
    if (format_obj == Py_None) {
        q3_dtype q_dt;
        if (weight_dtype(weights, q_proj, device, Q3_VIEW_HOST | Q3_VIEW_E4M3, &q_dt) < 0) return -1;
        *wf = q_dt == Q3_E4M3 ? Q3_WF_FP8_BLOCK128 : Q3_WF_DENSE;
    } else {
        if (!q3py_weight_format(format_obj, wf)) return -1;
    }
    if (dtype_obj != Py_None) return q3_parse_dtype(dtype_obj, "dtype", dt);
    return weight_dtype(weights, *wf == Q3_WF_DENSE ? q_proj : q3_dense_weight_name(Q3_W_INPUT_NORM), device,
                        Q3_VIEW_HOST, dt);
}

static PyObject *layer_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"config", "weights", "dtype", "device", "weight_format", NULL};
    PyObject *cfg_obj, *weights, *dtype_obj = Py_None, *format_obj = Py_None;
    int device = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO!|OiO:Layer", names, &cfg_obj, &PyDict_Type, &weights,
                                     &dtype_obj, &device, &format_obj))
        return NULL;
    if (device >= 0 && !q3_cuda()) {
        PyErr_SetString(PyExc_RuntimeError, "device: the CUDA backend is not loaded (qwen3layer.cuda.load())");
        return NULL;
    }
    q3_config cfg;
    q3_dtype dt, sdt = Q3_F32;
    q3_weight_format wf;
    if (q3_parse_config(cfg_obj, &cfg) < 0 || layer_dtype(weights, dtype_obj, format_obj, device, &dt, &wf) < 0 ||
        (wf == Q3_WF_FP8_BLOCK128 && q3_layer_scale_dtype(weights, device, &sdt) < 0))
        return NULL;
    const int fp8 = wf == Q3_WF_FP8_BLOCK128;

    q3_layer_object *self = (q3_layer_object *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->device = device < 0 ? -1 : device;
    self->scale_dtype = sdt;
    const int max_tensors = (Q3_W_DENSE_COUNT + Q3_X_COUNT * cfg.experts) * (fp8 ? 2 : 1); /* FP8: + scales */
    self->views = PyMem_Calloc((size_t)max_tensors, sizeof *self->views);
    self->owned = PyMem_Calloc((size_t)max_tensors, sizeof *self->owned);
    self->expert_ptrs = PyMem_Calloc((size_t)Q3_X_COUNT * cfg.experts * (fp8 ? 2 : 1), sizeof *self->expert_ptrs);
    self->converted = PyList_New(0);
    self->weight_ptrs = PyDict_New();
    self->lock = PyThread_allocate_lock();
    if (!self->views || !self->owned || !self->expert_ptrs || !self->converted || !self->weight_ptrs ||
        !self->lock) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    q3_weights w = {.dtype = dt, .device = self->device, .format = wf, .scale_dtype = sdt};
    for (int i = 0; i < Q3_W_DENSE_COUNT; i++) {
        int64_t dims[2], sdims[2];
        const int rank = q3_dense_weight_shape(&cfg, i, dims);
        const char *name = q3_dense_weight_name(i);
        if (fp8 && q3_dense_weight_is_matrix(i)) {
            q3_fp8_scale_shape(dims, sdims);
            w.dense[i] = q3_layer_take_fp8(self, weights, name, 2, dims, sdims, sdt, &w.dense_scale[i]);
        } else {
            w.dense[i] = q3_layer_take_weight(self, weights, name, rank, dims, dt);
            if (w.dense[i] && q3_layer_record_ptr(self, name, w.dense[i]) < 0) w.dense[i] = NULL;
        }
        if (!w.dense[i]) {
            Py_DECREF(self);
            return NULL;
        }
    }
    if ((fp8 ? q3_layer_take_fp8_experts(self, weights, &cfg, sdt) : take_experts(self, weights, &cfg, dt)) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    for (int x = 0; x < Q3_X_COUNT; x++) {
        w.experts[x] = self->expert_ptrs + (size_t)x * cfg.experts;
        if (fp8) w.expert_scales[x] = self->expert_ptrs + (size_t)(Q3_X_COUNT + x) * cfg.experts;
    }
    q3_error err;
    if (q3_layer_create(&self->layer, &cfg, &w, &err) != Q3_OK) {
        Py_DECREF(self);
        return q3_raise(NULL, &err);
    }
    return (PyObject *)self;
}

static void layer_dealloc(q3_layer_object *self) {
    PyTypeObject *tp = Py_TYPE(self);
    q3_layer_destroy(self->layer);
    for (int i = 0; self->views && i < self->n_views; i++) q3_view_release(&self->views[i]);
    for (int i = 0; self->owned && i < self->n_owned; i++) {
        if (self->device < 0) q3_free(self->owned[i]);
        else if (q3_cuda()) q3_cuda()->free_device(self->owned[i]);
    }
    PyMem_Free(self->views);
    PyMem_Free(self->owned);
    PyMem_Free(self->expert_ptrs);
    Py_XDECREF(self->converted);
    Py_XDECREF(self->weight_ptrs);
    if (self->lock) PyThread_free_lock(self->lock);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyType_Slot layer_slots[] = {
    {Py_tp_new, layer_new},
    {Py_tp_dealloc, layer_dealloc},
    {Py_tp_methods, q3_layer_methods},
    {Py_tp_getset, q3_layer_getset},
    {Py_tp_doc, "Layer(config, weights, dtype=None, device=-1, weight_format=None)\n--\n\nEngine layer; use "
                 "qwen3layer.DecoderLayer."},
    {0, NULL},
};

PyType_Spec q3_layer_spec = {
    .name = "qwen3layer._C.Layer",
    .basicsize = sizeof(q3_layer_object),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = layer_slots,
};
