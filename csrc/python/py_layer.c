/* qwen3layer._C.Layer: the engine layer behind qwen3layer.DecoderLayer, its construction and
 * attributes (the calls are py_layer_call.c's).
 *
 * Construction hands the engine (q3_layer_load, csrc/engine/weight_load.c) the weights dict as
 * a source of tensors by name, each imported through DLPack when the engine asks for it: the
 * engine decides the format, the dtype, which tensors it reads, and which it borrows (no copy
 * when contiguous and of the dtype its storage asks, and on a CUDA device 16-byte aligned) or
 * copies once, now (recorded in `converted`). float8_e4m3fn and GPTQ tensors are taken as they
 * are: a layer never quantizes. */
#include <string.h>

#include "py_layer.h"

/* ---- weights: the engine's source of tensors by name, the weights dict ----------------- */

static int source_has(void *weights, const char *name) { return PyDict_GetItemString(weights, name) != NULL; }

static int source_import(void *weights, const char *name, const char *arg, int device, int allow, q3_view *v) {
    return q3_view_acquire_on(PyDict_GetItemString(weights, name), arg, v, device, allow, NULL);
}

static void *source_unlock(void *weights) { (void)weights; return PyEval_SaveThread(); }
static void source_relock(void *weights, void *token) { (void)weights; PyEval_RestoreThread(token); }

static PyObject *layer_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"config", "weights", "dtype", "device", "weight_format", "experts", "experts_only",
                            "gptq_group", "gptq_v2", "gptq_dense_attention", "copy_weights", NULL};
    PyObject *cfg_obj, *weights, *dtype_obj = Py_None, *format_obj = Py_None, *experts_obj = Py_None;
    int device = -1, experts_only = 0, gptq_v2 = 0, dense_attention = 0, copy = 0;
    long long gptq_group = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO!|OiOO$pLppp:Layer", names, &cfg_obj, &PyDict_Type, &weights,
                                     &dtype_obj, &device, &format_obj, &experts_obj, &experts_only, &gptq_group,
                                     &gptq_v2, &dense_attention, &copy))
        return NULL;
    q3_config cfg;
    q3_dtype dt;
    q3_weight_format wf;
    uint8_t *held = NULL; /* experts=None: every expert */
    if (q3_parse_config(cfg_obj, &cfg) < 0 || !q3py_dtype_or_none(dtype_obj, &dt) ||
        !q3py_weight_format(format_obj, &wf) ||
        (experts_obj != Py_None && q3py_held_experts(experts_obj, cfg.experts, &held) < 0))
        return NULL;
    q3py_layer_object *self = (q3py_layer_object *)type->tp_alloc(type, 0);
    if (self && !(self->lock = PyThread_allocate_lock())) PyErr_NoMemory();
    if (!self || !self->lock) {
        Py_XDECREF(self);
        PyMem_Free(held);
        return NULL;
    }
    self->device = device < 0 ? -1 : device;
    const q3_layer_load_args a = {.device = self->device, .dtype = dtype_obj == Py_None ? NULL : &dt,
                                  .format = format_obj == Py_None ? NULL : &wf, .held = held,
                                  .experts_only = experts_only, .gptq_group = gptq_group, .gptq_v2 = gptq_v2,
                                  .gptq_dense_attention = dense_attention, .copy_weights = copy};
    const q3_weight_source src = {weights, source_has, source_import, q3_view_release, source_unlock, source_relock};
    q3_error err;
    const q3_status s = q3_layer_load(&self->layer, &cfg, &a, &src, &err);
    PyMem_Free(held);
    if (s != Q3_OK) {
        q3_raise(NULL, &err);
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void layer_dealloc(q3py_layer_object *self) {
    PyTypeObject *tp = Py_TYPE(self);
    q3_layer_destroy(self->layer); /* releases the weights it borrowed */
    if (self->lock) PyThread_free_lock(self->lock);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* ---- attributes ------------------------------------------------------------------ */

#define GETTER(fn, expr) \
    static PyObject *fn(q3py_layer_object *self, void *c) { return expr; }
GETTER(get_dtype, PyUnicode_FromString(q3_dtype_name(q3_layer_dtype(self->layer))))
GETTER(get_device, PyLong_FromLong(self->device))
GETTER(get_weight_format, PyUnicode_FromString(q3_weight_format_name(q3_layer_weight_format(self->layer))))
GETTER(get_scale_dtype, q3_layer_weight_format(self->layer) == Q3_WF_DENSE
                            ? Py_NewRef(Py_None)
                            : PyUnicode_FromString(q3_dtype_name(q3_layer_scale_dtype(self->layer))))
GETTER(get_weight_bytes, PyLong_FromLongLong(q3_layer_weight_bytes(self->layer)))
GETTER(get_workspace, PyLong_FromSize_t(q3_layer_workspace_bytes(self->layer)))

/* converted: the names of the layer's copies (a tuple); weight_ptrs: {name: address} of all */
static PyObject *weights_read(q3py_layer_object *self, void *ptrs) {
    PyObject *out = ptrs ? PyDict_New() : PyList_New(0);
    for (int64_t i = 0; out && i < q3_layer_weight_count(self->layer); i++) {
        const void *p;
        int converted;
        const char *name = q3_layer_weight(self->layer, i, &p, &converted);
        PyObject *v = ptrs ? PyLong_FromVoidPtr((void *)p) : converted ? PyUnicode_FromString(name) : NULL;
        if (ptrs ? !v || PyDict_SetItemString(out, name, v) < 0 : converted && (!v || PyList_Append(out, v) < 0))
            Py_CLEAR(out);
        Py_XDECREF(v);
    }
    if (ptrs || !out) return out;
    PyObject *names = PyList_AsTuple(out);
    Py_DECREF(out);
    return names;
}

/* the ids of the experts held, ascending */
static PyObject *get_held_experts(q3py_layer_object *self, void *c) {
    const int E = q3_layer_config(self->layer)->experts;
    int64_t *ids = PyMem_Malloc((size_t)E * sizeof *ids);
    if (!ids) return PyErr_NoMemory();
    int n = 0;
    for (int e = 0; e < E; e++)
        if (q3_layer_holds_expert(self->layer, e)) ids[n++] = e;
    PyObject *out = q3py_int64s(ids, n, 0);
    PyMem_Free(ids);
    return out;
}

static PyGetSetDef layer_getset[] = {
    {"held_experts", (getter)get_held_experts, NULL, "the ids of the experts the layer holds, ascending", NULL},
    {"dtype", (getter)get_dtype, NULL, "dtype of the activations, the norms and the router (and of the "
     "projection matrices in the dense format)", NULL},
    {"weight_format", (getter)get_weight_format, NULL, "'dense' or 'fp8_e4m3_block128'", NULL},
    {"scale_dtype", (getter)get_scale_dtype, NULL, "FP8: dtype of the block scales; dense: None", NULL},
    {"weight_bytes", (getter)get_weight_bytes, NULL, "bytes of all the weights as read (FP8: scales included)",
     NULL},
    {"converted", (getter)weights_read, NULL, "names of weights converted at construction", NULL},
    {"weight_ptrs", (getter)weights_read, NULL, "name -> address the engine reads", (void *)1},
    {"workspace_bytes", (getter)get_workspace, NULL, "activation workspace held now", NULL},
    {"device", (getter)get_device, NULL, "-1 for cpu, else the CUDA device", NULL},
    {NULL},
};

static PyType_Slot layer_slots[] = {
    {Py_tp_new, layer_new},
    {Py_tp_dealloc, layer_dealloc},
    {Py_tp_methods, q3py_layer_methods},
    {Py_tp_getset, layer_getset},
    {Py_tp_doc, "Layer(config, weights, dtype=None, device=-1, weight_format=None, experts=None, *, "
                "experts_only=False, gptq_group=0, gptq_v2=False, gptq_dense_attention=False, copy_weights=False)"
                "\n--\n\nEngine layer; use qwen3layer.DecoderLayer."},
    {0, NULL},
};

PyType_Spec q3py_layer_spec = {
    .name = "qwen3layer._C.Layer",
    .basicsize = sizeof(q3py_layer_object),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = layer_slots,
};
