/* qwen3layer._C.Layer: the engine layer behind qwen3layer.DecoderLayer, its construction and
 * attributes (the calls are py_layer_call.c's).
 *
 * Construction takes the tensors of the engine's weight table (q3_weight_table) and borrows
 * each through DLPack (no copy when it is contiguous and of the dtype its storage asks, and on
 * a CUDA device 16-byte aligned; otherwise one conversion, now, recorded in `converted`: the
 * engine decides which, q3_weight_view_use). float8_e4m3fn matrices are taken as they are: an
 * FP8 layer does not quantize. */
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

/* Imports weights[name] into the next view slot (counted once borrowed), shape [rank] dims
 * checked. NULL with an exception. */
static q3_view *acquire_shaped(q3py_layer_object *self, PyObject *weights, const char *name, int rank,
                               const int64_t *dims, int allow, char *arg, size_t arg_size) {
    PyObject *obj = PyDict_GetItemString(weights, name);
    if (!obj) {
        PyErr_Format(PyExc_ValueError, "weights: missing '%s'", name);
        return NULL;
    }
    snprintf(arg, arg_size, "weights['%s']", name);
    q3_view *v = &self->views[self->n_views];
    q3_error err;
    if (q3_view_acquire_on(obj, arg, v, self->device, allow, NULL) < 0) return NULL;
    if (q3py_status(q3_view_check_shape(v, arg, rank, dims, &err), &err) == 0) return v;
    q3_view_release(v);
    return NULL;
}

/* Imports weights[name] of table entry e, stored as `dtype`, and returns the pointer the engine
 * will read: the producer's memory, or a copy made once, now, as q3_weight_view_use decides (a
 * CUDA layer's weights start at multiples of Q3_CUDA_WEIGHT_ALIGN bytes: csrc/cuda/q3_cuda.h
 * says why); a copy is the layer's and is named in `converted`. */
static const void *take_weight(q3py_layer_object *self, PyObject *weights, const q3_weight_entry *e, q3_dtype dtype) {
    char arg[160];
    const int allow = Q3_VIEW_HOST | (dtype == Q3_E4M3 ? Q3_VIEW_E4M3 : dtype == Q3_I32 ? Q3_VIEW_I32
                                      : dtype == Q3_F16 ? Q3_VIEW_F16 : 0);
    q3_view *v = acquire_shaped(self, weights, e->name, e->rank, e->dims, allow, arg, sizeof arg);
    if (!v) return NULL;
    q3_weight_use use;
    q3_error err;
    if (q3py_status(q3_weight_view_use(v, dtype, self->device, Q3_CUDA_WEIGHT_ALIGN, arg, &use, &err), &err) < 0) {
        q3_view_release(v);
        return NULL;
    }
    if (use == Q3_WEIGHT_BORROW) {
        self->n_views++;
        return v->data;
    }
    const size_t bytes = (size_t)q3_weight_entry_numel(e) * q3_dtype_size(dtype);
    void *copy;
    if (use == Q3_WEIGHT_UPLOAD) { /* to the layer's device as it is */
        copy = upload(self, v->data, v->device, bytes, arg);
        q3_view_release(v);
        return copy ? record_converted(self, e->name, copy) : NULL;
    }
    copy = q3_alloc(bytes);
    if (!copy) {
        q3_view_release(v);
        PyErr_NoMemory();
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    q3_copy_strided(copy, dtype, v->data, v->dtype, e->rank, v->shape, v->strides);
    Py_END_ALLOW_THREADS
    q3_view_release(v);
    if (self->device >= 0) { /* a host weight for a CUDA layer: uploaded once, now */
        void *dev = upload(self, copy, -1, bytes, arg);
        q3_free(copy);
        if (!dev) return NULL;
        copy = dev;
    }
    return record_converted(self, e->name, copy);
}

static int record_ptr(q3py_layer_object *self, const char *name, const void *p) {
    PyObject *addr = PyLong_FromVoidPtr((void *)p);
    const int rc = addr ? PyDict_SetItemString(self->weight_ptrs, name, addr) : -1;
    Py_XDECREF(addr);
    return rc;
}

/* 0 when the fused experts are on a device; else -1 with an exception: a CUDA layer holding
 * a subset uploads only its experts, and the fused host tensors hold every one (a fused
 * tensor already on the device is borrowed whole, nothing allocated) */
static int fused_on_host(PyObject *weights, int experts) {
    for (int f = 0; f < Q3_FUSED_COUNT; f++) {
        const char *name = q3_fused_expert_name(f);
        PyObject *obj = PyDict_GetItemString(weights, name), *dev = NULL;
        int type = 0, id = 0;
        if (!obj) continue; /* missing: take_table names it */
        if (!(dev = PyObject_CallMethod(obj, "__dlpack_device__", NULL))) {
            PyErr_Clear(); /* not a tensor: take_table says so */
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

/* 0 when table entry e (a scale) is given; else -1 with ValueError naming its matrix */
static int scale_given(PyObject *weights, const q3_weight_entry *table, const q3_weight_entry *e) {
    if (PyDict_GetItemString(weights, e->name)) return 0;
    PyErr_Format(PyExc_ValueError, "weights['%s']: an FP8 weight without its scale: missing '%s'",
                 e->of >= 0 ? table[e->of].name : "?", e->name);
    return -1;
}

/* Every tensor of the engine's table (q3_weight_table) into its slot, as its storage says:
 * of the layer's dtype dt or scale dtype sdt (converted once if not), or e4m3 bytes as they
 * are; each address recorded in weight_ptrs. -1 with an exception. */
static int take_table(q3py_layer_object *self, PyObject *weights, const q3_weight_entry *table, int64_t n,
                      q3_dtype dt, q3_dtype sdt) {
    for (int64_t i = 0; i < n; i++) {
        const q3_weight_entry *e = &table[i];
        if (e->storage == Q3_WS_SCALE && scale_given(weights, table, e) < 0) return -1;
        const void *p = take_weight(self, weights, e, q3_weight_storage_dtype(e->storage, dt, sdt));
        if (!p || record_ptr(self, e->name, p) < 0) return -1;
        *e->slot = p;
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

/* The weight format (the argument; None: the format self_attn.q_proj.weight's dtype shows,
 * q3_weight_format_of) and the dtype of the layer (the argument, else the dtype of the
 * format's weight for it, q3_weight_format_dtype_source: q_proj's, or in the FP8 format
 * input_layernorm's, whose dtype the norms and the router keep). */
static int layer_dtype(PyObject *weights, PyObject *dtype_obj, PyObject *format_obj, int device, q3_dtype *dt,
                       q3_weight_format *wf) {
    if (format_obj == Py_None) {
        q3_dtype q_dt;
        if (weight_dtype(weights, q3_dense_weight_name(Q3_W_Q_PROJ), device, Q3_VIEW_HOST | Q3_VIEW_E4M3, &q_dt) < 0)
            return -1;
        *wf = q3_weight_format_of(q_dt);
    } else {
        if (!q3py_weight_format(format_obj, wf)) return -1;
    }
    if (dtype_obj != Py_None) return q3_parse_dtype(dtype_obj, "dtype", dt);
    return weight_dtype(weights, q3_dense_weight_name(q3_weight_format_dtype_source(*wf)), device, Q3_VIEW_HOST, dt);
}

/* The engine's table of the layer's tensors into *table [*n] (PyMem), its slots in *w and
 * self->expert_ptrs; and the scale dtype, that of the table's first scale (self_attn.q_proj's,
 * or an expert-only layer's first held expert's), F32 where the format has none. -1 with an
 * exception. */
static int weight_table(q3py_layer_object *self, PyObject *weights, const q3_config *cfg, q3_weights *w,
                        q3_weight_entry **table, int64_t *n) {
    const int fused = PyDict_GetItemString(weights, q3_fused_expert_name(Q3_FUSED_GATE_UP)) != NULL;
    q3_error err;
    if (q3_weight_table(cfg, w, fused, self->expert_ptrs, NULL, 0, n, &err) != Q3_OK) {
        q3_raise(NULL, &err);
        return -1;
    }
    if (!(*table = PyMem_Calloc((size_t)*n, sizeof **table)) || !(self->views = PyMem_Calloc((size_t)*n, sizeof *self->views)) ||
        !(self->owned = PyMem_Calloc((size_t)*n, sizeof *self->owned))) {
        PyErr_NoMemory();
        return -1;
    }
    if (q3_weight_table(cfg, w, fused, self->expert_ptrs, *table, *n, n, &err) != Q3_OK) {
        q3_raise(NULL, &err);
        return -1;
    }
    w->scale_dtype = Q3_F32;
    for (int64_t i = 0; i < *n; i++)
        if ((*table)[i].storage == Q3_WS_SCALE)
            return scale_given(weights, *table, &(*table)[i]) < 0
                       ? -1
                       : weight_dtype(weights, (*table)[i].name, self->device, Q3_VIEW_HOST, &w->scale_dtype);
    return 0;
}

static PyObject *layer_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"config", "weights", "dtype", "device", "weight_format", "experts", "experts_only",
                            "gptq_group", "gptq_v2", "gptq_dense_attention", NULL};
    PyObject *cfg_obj, *weights, *dtype_obj = Py_None, *format_obj = Py_None, *experts_obj = Py_None;
    int device = -1, experts_only = 0, gptq_v2 = 0, dense_attention = 0;
    long long gptq_group = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO!|OiOO$pLpp:Layer", names, &cfg_obj, &PyDict_Type, &weights,
                                     &dtype_obj, &device, &format_obj, &experts_obj, &experts_only, &gptq_group,
                                     &gptq_v2, &dense_attention))
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
    q3_dtype dt;
    q3_weight_format wf;
    uint8_t *held = NULL; /* experts=None: every expert */
    if (q3_parse_config(cfg_obj, &cfg) < 0 || layer_dtype(weights, dtype_obj, format_obj, device, &dt, &wf) < 0 ||
        (experts_obj != Py_None && q3py_held_experts(experts_obj, cfg.experts, &held) < 0))
        return NULL;
    q3py_layer_object *self = (q3py_layer_object *)type->tp_alloc(type, 0);
    if (!self) {
        PyMem_Free(held);
        return NULL;
    }
    self->device = device < 0 ? -1 : device;
    self->expert_ptrs = PyMem_Calloc((size_t)Q3_EXPERT_PTR_ARRAYS * Q3_X_COUNT * cfg.experts, sizeof *self->expert_ptrs);
    self->converted = PyList_New(0);
    self->weight_ptrs = PyDict_New();
    self->lock = PyThread_allocate_lock();
    q3_weight_entry *table = NULL;
    int64_t n = 0;
    q3_weights w = {.dtype = dt, .device = self->device, .format = wf, .held = held, .experts_only = experts_only,
                    .gptq_group = gptq_group, .gptq_v2 = gptq_v2, .gptq_dense_attention = dense_attention};
    int rc = -1;
    if (!self->expert_ptrs || !self->converted || !self->weight_ptrs || !self->lock) PyErr_NoMemory();
    else if (weight_table(self, weights, &cfg, &w, &table, &n) == 0 &&
             (!held || self->device < 0 || fused_on_host(weights, cfg.experts) == 0))
        rc = take_table(self, weights, table, n, dt, w.scale_dtype);
    PyMem_Free(table);
    self->scale_dtype = w.scale_dtype;
    q3_error err;
    if (rc == 0 && q3_layer_create(&self->layer, &cfg, &w, &err) != Q3_OK) { /* copies the mask */
        q3_raise(NULL, &err);
        rc = -1;
    }
    PyMem_Free(held);
    if (rc < 0) {
        Py_DECREF(self);
        return NULL;
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

/* ---- attributes ------------------------------------------------------------------ */

static PyObject *get_dtype(q3py_layer_object *self, void *c) {
    (void)c;
    return PyUnicode_FromString(q3_dtype_name(q3_layer_dtype(self->layer)));
}
static PyObject *get_converted(q3py_layer_object *self, void *c) { (void)c; return PyList_AsTuple(self->converted); }
static PyObject *get_weight_ptrs(q3py_layer_object *self, void *c) { (void)c; return PyDict_Copy(self->weight_ptrs); }
static PyObject *get_device(q3py_layer_object *self, void *c) {
    (void)c;
    return PyLong_FromLong(self->device);
}
static PyObject *get_weight_format(q3py_layer_object *self, void *c) {
    (void)c;
    return PyUnicode_FromString(q3_weight_format_name(q3_layer_weight_format(self->layer)));
}
static PyObject *get_scale_dtype(q3py_layer_object *self, void *c) {
    (void)c;
    if (q3_layer_weight_format(self->layer) == Q3_WF_DENSE) Py_RETURN_NONE;
    return PyUnicode_FromString(q3_dtype_name(self->scale_dtype));
}
static PyObject *get_weight_bytes(q3py_layer_object *self, void *c) {
    (void)c;
    return PyLong_FromLongLong(q3_layer_weight_bytes(self->layer));
}
static PyObject *get_workspace(q3py_layer_object *self, void *c) {
    (void)c;
    return PyLong_FromSize_t(q3_layer_workspace_bytes(self->layer));
}

static PyObject *get_held_experts(q3py_layer_object *self, void *c) {
    (void)c;
    const int E = q3_layer_config(self->layer)->experts;
    PyObject *ids = PyTuple_New(q3_layer_held_experts(self->layer));
    for (int e = 0, i = 0; ids && e < E; e++) {
        if (!q3_layer_holds_expert(self->layer, e)) continue;
        PyObject *v = PyLong_FromLong(e);
        if (!v) {
            Py_CLEAR(ids);
            break;
        }
        PyTuple_SET_ITEM(ids, i++, v);
    }
    return ids;
}

PyGetSetDef q3py_layer_getset[] = {
    {"held_experts", (getter)get_held_experts, NULL, "the ids of the experts the layer holds, ascending", NULL},
    {"dtype", (getter)get_dtype, NULL, "dtype of the activations, the norms and the router (and of the "
     "projection matrices in the dense format)", NULL},
    {"weight_format", (getter)get_weight_format, NULL, "'dense' or 'fp8_e4m3_block128'", NULL},
    {"scale_dtype", (getter)get_scale_dtype, NULL, "FP8: dtype of the block scales; dense: None", NULL},
    {"weight_bytes", (getter)get_weight_bytes, NULL, "bytes of all the weights as read (FP8: scales included)",
     NULL},
    {"converted", (getter)get_converted, NULL, "names of weights converted at construction", NULL},
    {"weight_ptrs", (getter)get_weight_ptrs, NULL, "name -> address the engine reads", NULL},
    {"workspace_bytes", (getter)get_workspace, NULL, "activation workspace held now", NULL},
    {"device", (getter)get_device, NULL, "-1 for cpu, else the CUDA device", NULL},
    {NULL},
};

static PyType_Slot layer_slots[] = {
    {Py_tp_new, layer_new},
    {Py_tp_dealloc, layer_dealloc},
    {Py_tp_methods, q3py_layer_methods},
    {Py_tp_getset, q3py_layer_getset},
    {Py_tp_doc, "Layer(config, weights, dtype=None, device=-1, weight_format=None, experts=None, *, "
                "experts_only=False, gptq_group=0, gptq_v2=False, gptq_dense_attention=False)\n--\n\nEngine layer; use "
                "qwen3layer.DecoderLayer."},
    {0, NULL},
};

PyType_Spec q3py_layer_spec = {
    .name = "qwen3layer._C.Layer",
    .basicsize = sizeof(q3py_layer_object),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = layer_slots,
};
