/* qwen3layer._C.Layer: the engine layer behind qwen3layer.DecoderLayer.
 *
 * Construction borrows every weight through DLPack (no copy when it is contiguous and
 * of the layer's dtype, and on a CUDA device 16-byte aligned; otherwise one conversion,
 * now, recorded in `converted`).
 * prefill/decode check the call, release the GIL and run q3_layer_forward under the
 * layer's lock (the workspace is per layer). */
#include <string.h>

#include "py_layer.h"



/* ---- weights --------------------------------------------------------------------- */

/* a converted copy, owned by the layer from now on (freed with it), named in `converted` */
static void *record_converted(q3py_layer_object *self, const char *name, void *copy) {
    self->owned[self->n_owned++] = copy;
    PyObject *nm = PyUnicode_FromString(name);
    if (!nm || PyList_Append(self->converted, nm) < 0) {
        Py_XDECREF(nm);
        return NULL;
    }
    Py_DECREF(nm);
    return copy;
}

/* bytes of src (on src_device, -1: host) copied into a new block of the layer's device
 * (csrc/cuda/buffers.c), or NULL with MemoryError naming arg: a device weight not 16-byte
 * aligned, or a host weight uploaded once, now */
static void *upload(q3py_layer_object *self, const void *src, int src_device, size_t bytes, const char *arg) {
    void *dev;
    q3_error err;
    if (q3_device_upload(&dev, self->device, src, src_device, bytes, &err) == Q3_OK) return dev;
    PyErr_Format(PyExc_MemoryError, "%s: cannot copy %zu bytes to %scuda:%d: %s", arg, bytes,
                 src_device >= 0 ? "an aligned block on " : "", self->device, err.msg);
    return NULL;
}

void *q3py_layer_device_copy(q3py_layer_object *self, const q3_view *v, size_t bytes, const char *name, const char *arg) {
    void *dev = upload(self, v->data, v->device, bytes, arg);
    return dev ? record_converted(self, name, dev) : NULL;
}

/* Imports weights[name] into the next view slot (not yet counted) and checks its shape;
 * `allow` as for q3_view_acquire_on. Returns the view, or NULL with an exception. */
q3_view *q3py_layer_acquire_shaped(q3py_layer_object *self, PyObject *weights, const char *name, int rank,
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
const void *q3py_layer_take_weight(q3py_layer_object *self, PyObject *weights, const char *name,
                               int rank, const int64_t *dims, q3_dtype dtype) {
    char arg[160];
    q3_view *v = q3py_layer_acquire_shaped(self, weights, name, rank, dims, Q3_VIEW_HOST, arg, sizeof arg);
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
        copy = upload(self, v->data, v->device, bytes, arg);
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
        void *dev = upload(self, copy, -1, bytes, arg);
        q3_free(copy);
        if (!dev) return NULL;
        copy = dev;
    }
    return record_converted(self, name, copy);
}

int q3py_layer_record_ptr(q3py_layer_object *self, const char *name, const void *p) {
    PyObject *addr = PyLong_FromVoidPtr((void *)p);
    const int rc = addr ? PyDict_SetItemString(self->weight_ptrs, name, addr) : -1;
    Py_XDECREF(addr);
    return rc;
}

/* A projection matrix (or fused experts) weights[name] of shape dims: in the FP8 format with
 * its scale_inv of shape sdims into *scale (q3py_layer_take_fp8), else of the layer's dtype;
 * its address recorded in weight_ptrs. NULL with an exception. */
static const void *take_matrix(q3py_layer_object *self, PyObject *weights, const char *name, int rank,
                               const int64_t *dims, const int64_t *sdims, const q3_weights *w, const void **scale) {
    if (w->format == Q3_WF_FP8_BLOCK128)
        return q3py_layer_take_fp8(self, weights, name, rank, dims, sdims, w->scale_dtype, scale);
    const void *p = q3py_layer_take_weight(self, weights, name, rank, dims, w->dtype);
    return p && q3py_layer_record_ptr(self, name, p) == 0 ? p : NULL;
}

/* 0 when the fused experts of `experts` are on a device; else -1 with an exception: a CUDA layer holding
 * a subset uploads only its experts, and the fused host tensors hold every one (a fused
 * tensor already on the device is borrowed whole, nothing allocated) */
static int fused_on_host(PyObject *weights, int experts) {
    for (int f = 0; f < Q3_FUSED_COUNT; f++) {
        const char *name = q3_fused_expert_name(f);
        PyObject *obj = PyDict_GetItemString(weights, name), *dev = NULL;
        int type = 0, id = 0;
        if (!obj) continue; /* missing: take_matrix names it */
        if (!(dev = PyObject_CallMethod(obj, "__dlpack_device__", NULL))) {
            PyErr_Clear(); /* not a tensor: take_matrix says so */
            continue;
        }
        const int ok = PyArg_ParseTuple(dev, "ii", &type, &id);
        Py_DECREF(dev);
        if (!ok) PyErr_Clear();
        if (ok && type == 1) { /* kDLCPU */
            PyErr_Format(PyExc_ValueError, "%s: a CUDA layer holding a subset of the experts takes host experts per "
                         "expert (mlp.experts.{e}.*.weight, only the held ones uploaded), got the fused host tensor "
                         "of all %d", name, experts);
            return -1;
        }
    }
    return 0;
}

/* The experts into w: transformers 5.x's fused tensors as they are (the engine slices them,
 * q3_fused_expert_shape), or mlp.experts.{e}.{gate,up,down}_proj.weight (and their scales)
 * into self->expert_ptrs [Q3_X_COUNT][E] (then [Q3_X_COUNT][E] scales); of a layer holding a
 * subset (w->held), only the held experts' names are read, the others' pointers stay NULL. */
static int take_experts(q3py_layer_object *self, PyObject *weights, const q3_config *c, q3_weights *w) {
    if (PyDict_GetItemString(weights, q3_fused_expert_name(Q3_FUSED_GATE_UP))) {
        if (w->held && self->device >= 0 && fused_on_host(weights, c->experts) != 0) return -1;
        for (int f = 0; f < Q3_FUSED_COUNT; f++) {
            int64_t dims[3], sdims[3];
            q3_fused_expert_shape(c, f, 0, dims);
            q3_fused_expert_shape(c, f, 1, sdims);
            w->fused[f] = take_matrix(self, weights, q3_fused_expert_name(f), 3, dims, sdims, w, &w->fused_scales[f]);
            if (!w->fused[f]) return -1;
        }
        return 0;
    }
    const int E = c->experts;
    const void **ptrs = self->expert_ptrs;
    for (int e = 0; e < E; e++)
        for (int x = 0; x < Q3_X_COUNT && (!w->held || w->held[e]); x++) {
            char name[96];
            int64_t dims[2], sdims[2];
            snprintf(name, sizeof name, "mlp.experts.%d.%s.weight", e, q3_expert_weight_name(x));
            q3_expert_weight_shape(c, x, dims);
            q3_fp8_scale_shape(dims, sdims);
            ptrs[x * E + e] = take_matrix(self, weights, name, 2, dims, sdims, w, &ptrs[(Q3_X_COUNT + x) * E + e]);
            if (!ptrs[x * E + e]) return -1;
        }
    for (int x = 0; x < Q3_X_COUNT; x++) {
        w->experts[x] = ptrs + (size_t)x * E;
        if (w->format == Q3_WF_FP8_BLOCK128) w->expert_scales[x] = ptrs + (size_t)(Q3_X_COUNT + x) * E;
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
    char arg[128];
    snprintf(arg, sizeof arg, "weights['%s']", name);
    if (q3_view_acquire_on(obj, arg, &v, device, allow, NULL) < 0) return -1;
    *dt = v.dtype;
    q3_view_release(&v);
    return 0;
}

int q3py_layer_scale_dtype(PyObject *weights, int device, q3_dtype *sdt) {
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

/* an expert-only FP8 layer's scale dtype: its first held expert's gate_proj scale's (or the
 * fused gate_up_proj's) */
static int experts_scale_dtype(PyObject *weights, int E, const uint8_t *held, q3_dtype *sdt) {
    char name[96];
    int e = 0;
    while (held && e < E - 1 && !held[e]) e++;
    if (PyDict_GetItemString(weights, q3_fused_expert_name(Q3_FUSED_GATE_UP)))
        snprintf(name, sizeof name, "%s_scale_inv", q3_fused_expert_name(Q3_FUSED_GATE_UP));
    else
        snprintf(name, sizeof name, "mlp.experts.%d.gate_proj.weight_scale_inv", e);
    return weight_dtype(weights, name, -1, Q3_VIEW_HOST, sdt);
}

static PyObject *layer_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"config", "weights", "dtype", "device", "weight_format", "experts", "experts_only", NULL};
    PyObject *cfg_obj, *weights, *dtype_obj = Py_None, *format_obj = Py_None, *experts_obj = Py_None;
    int device = -1, experts_only = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO!|OiOO$p:Layer", names, &cfg_obj, &PyDict_Type, &weights,
                                     &dtype_obj, &device, &format_obj, &experts_obj, &experts_only))
        return NULL;
    if (experts_only && (device >= 0 || dtype_obj == Py_None || format_obj == Py_None)) {
        PyErr_Format(PyExc_ValueError, "experts_only: an expert-only layer is a host layer (device=-1) given its dtype "
                     "and weight_format (it has no q_proj to read them from), got device=%d, dtype=%R, "
                     "weight_format=%R", device, dtype_obj, format_obj);
        return NULL;
    }
    if (device >= 0 && !q3_cuda_loaded()) {
        PyErr_SetString(PyExc_RuntimeError, "device: the CUDA backend is not loaded (qwen3layer.cuda.load())");
        return NULL;
    }
    q3_config cfg;
    q3_dtype dt, sdt = Q3_F32;
    q3_weight_format wf;
    uint8_t *held = NULL; /* experts=None: every expert */
    if (q3_parse_config(cfg_obj, &cfg) < 0 || layer_dtype(weights, dtype_obj, format_obj, device, &dt, &wf) < 0 ||
        (experts_obj != Py_None && q3py_held_experts(experts_obj, cfg.experts, &held) < 0))
        return NULL;
    if (wf == Q3_WF_FP8_BLOCK128 && (experts_only ? experts_scale_dtype(weights, cfg.experts, held, &sdt)
                                                  : q3py_layer_scale_dtype(weights, device, &sdt)) < 0) {
        PyMem_Free(held);
        return NULL;
    }
    const int fp8 = wf == Q3_WF_FP8_BLOCK128;

    q3py_layer_object *self = (q3py_layer_object *)type->tp_alloc(type, 0);
    if (!self) {
        PyMem_Free(held);
        return NULL;
    }
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
        PyMem_Free(held);
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    q3_weights w = {.dtype = dt, .device = self->device, .format = wf, .scale_dtype = sdt, .held = held,
                    .experts_only = experts_only};
    for (int i = 0; i < Q3_W_DENSE_COUNT && !experts_only; i++) {
        int64_t dims[2], sdims[2];
        const int rank = q3_dense_weight_shape(&cfg, i, dims);
        const char *name = q3_dense_weight_name(i);
        if (q3_dense_weight_is_matrix(i)) {
            q3_fp8_scale_shape(dims, sdims);
            w.dense[i] = take_matrix(self, weights, name, 2, dims, sdims, &w, &w.dense_scale[i]);
        } else { /* norms (and the router) keep the layer's dtype in either format */
            w.dense[i] = q3py_layer_take_weight(self, weights, name, rank, dims, dt);
            if (w.dense[i] && q3py_layer_record_ptr(self, name, w.dense[i]) < 0) w.dense[i] = NULL;
        }
        if (!w.dense[i]) {
            PyMem_Free(held);
            Py_DECREF(self);
            return NULL;
        }
    }
    if (take_experts(self, weights, &cfg, &w) < 0) {
        PyMem_Free(held);
        Py_DECREF(self);
        return NULL;
    }
    q3_error err;
    const q3_status s = q3_layer_create(&self->layer, &cfg, &w, &err); /* copies the mask */
    PyMem_Free(held);
    if (s != Q3_OK) {
        Py_DECREF(self);
        return q3_raise(NULL, &err);
    }
    return (PyObject *)self;
}

static void layer_dealloc(q3py_layer_object *self) {
    PyTypeObject *tp = Py_TYPE(self);
    q3_layer_destroy(self->layer);
    for (int i = 0; self->views && i < self->n_views; i++) q3_view_release(&self->views[i]);
    for (int i = 0; self->owned && i < self->n_owned; i++) {
        if (self->device < 0) q3_free(self->owned[i]);
        else q3_device_free(self->owned[i]);
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
    {Py_tp_methods, q3py_layer_methods},
    {Py_tp_getset, q3py_layer_getset},
    {Py_tp_doc, "Layer(config, weights, dtype=None, device=-1, weight_format=None, experts=None)\n--\n\nEngine "
                "layer; use "
                 "qwen3layer.DecoderLayer."},
    {0, NULL},
};

PyType_Spec q3py_layer_spec = {
    .name = "qwen3layer._C.Layer",
    .basicsize = sizeof(q3py_layer_object),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = layer_slots,
};
