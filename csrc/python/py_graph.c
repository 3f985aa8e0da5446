/* DecodeGraph: a captured decode step (csrc/cuda/decode_graph.c) as a Python object. It keeps its
 * layer and cache alive; its input and output are device tensors exported through DLPack. */
#include "py_cache.h"
#include "py_layer.h"

typedef struct {
    PyObject_HEAD
    q3_decode_graph *graph;
    PyObject *layer;         /* the Layer: the graph reads its weights */
    q3py_cache_object *cache;  /* the graph appends to it */
    int batch;
    int64_t hidden;
    q3_dtype dtype;
    int device;
} q3py_graph_object;

PyObject *q3py_graph_new(q3_module_state *st, PyObject *layer_obj, q3_layer *layer, int device,
                       q3py_cache_object *co, int64_t batch, q3_dtype dtype) {
    if (q3py_cache_check_idle(co) < 0) return NULL;
    q3py_graph_object *self = (q3py_graph_object *)st->graph_type->tp_alloc(st->graph_type, 0); /* zeroed */
    if (!self) return NULL;
    self->layer = Py_NewRef(layer_obj);
    self->cache = (q3py_cache_object *)Py_NewRef((PyObject *)co);
    self->hidden = q3_layer_config(layer)->hidden;
    self->dtype = dtype;
    self->device = device;
    q3_error err;
    q3_status s;
    Py_BEGIN_ALLOW_THREADS
    s = q3_decode_graph_create(&self->graph, layer, co->cache, batch, dtype, &err);
    Py_END_ALLOW_THREADS
    if (s != Q3_OK) {
        Py_DECREF(self);
        return q3_raise(st, &err);
    }
    self->batch = (int)batch; /* checked by the engine */
    return (PyObject *)self;
}

static void graph_dealloc(q3py_graph_object *self) {
    PyTypeObject *tp = Py_TYPE(self);
    q3_decode_graph_destroy(self->graph);
    Py_XDECREF(self->layer);
    Py_XDECREF((PyObject *)self->cache);
    PyObject_Free(self);
    Py_DECREF(tp);
}

/* a [batch, hidden] view of the graph's input or output, keeping the graph alive */
static PyObject *buffer(q3py_graph_object *self, void *data) {
    q3_module_state *st = q3_state_of_type(Py_TYPE(self));
    if (!st) return NULL;
    const int64_t shape[2] = {self->batch, self->hidden}, strides[2] = {self->hidden, 1};
    q3py_tensor_object *t = q3py_tensor_view(st, (PyObject *)self, data, self->dtype, 2, shape, strides);
    if (t) t->device = self->device;
    return (PyObject *)t;
}

/* x into the graph's input, on the stream (x: a [batch, hidden] tensor on the graph's device) */
static int load_input(q3py_graph_object *self, PyObject *x_obj, void *stream) {
    q3_view x;
    if (q3_view_acquire_on(x_obj, "x", &x, self->device, 0, stream) < 0) return -1;
    int rc = -1;
    char got[128];
    q3_format_shape(got, sizeof got, x.ndim, x.shape);
    if (x.ndim != 2 || x.shape[0] != self->batch || x.shape[1] != self->hidden)
        PyErr_Format(PyExc_ValueError, "x: expected shape [batch=%d, hidden=%lld], got %s", self->batch,
                     (long long)self->hidden, got);
    else if (x.dtype != self->dtype)
        PyErr_Format(PyExc_TypeError, "x: expected dtype %s (the graph's), got %s", q3_dtype_name(self->dtype),
                     q3_dtype_name(x.dtype));
    else if (q3py_view_require(&x, "x", Q3_NEED_CONTIGUOUS) == 0) {
        void *input = q3_decode_graph_input(self->graph);
        const size_t bytes = (size_t)self->batch * (size_t)self->hidden * q3_dtype_size(self->dtype);
        q3_error err;
        rc = x.data == input || q3_device_copy_async(input, x.data, bytes, stream, &err) == Q3_OK ? 0 : -1;
        if (rc) PyErr_Format(PyExc_RuntimeError, "x: copy to the graph's input failed: %s", err.msg);
    }
    q3_view_release(&x);
    return rc;
}

static PyObject *graph_replay(q3py_graph_object *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"x", "stream", NULL};
    PyObject *x = Py_None;
    void *stream = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|O$O&:replay", names, &x, q3py_stream, &stream)) return NULL;
    q3_module_state *st = q3_state_of_type(Py_TYPE(self));
    if (!st || q3py_cache_check_idle(self->cache) < 0) return NULL;
    if (x != Py_None && load_input(self, x, stream) < 0) return NULL;
    q3_error err;
    q3_status s;
    self->cache->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    s = q3_decode_graph_replay(self->graph, stream, &err);
    Py_END_ALLOW_THREADS
    self->cache->busy = 0;
    if (s != Q3_OK) return q3_raise(st, &err);
    return buffer(self, q3_decode_graph_output(self->graph));
}

/* input and output, the getter's closure pointing at the engine's accessor */
typedef void *(*buffer_getter)(const q3_decode_graph *g);
static const buffer_getter buffers[] = {q3_decode_graph_input, q3_decode_graph_output};
static PyObject *get_buffer(q3py_graph_object *self, void *closure) {
    return buffer(self, (*(const buffer_getter *)closure)(self->graph));
}
static PyObject *get_batch(q3py_graph_object *self, void *c) { return PyLong_FromLong(self->batch); }
static PyObject *get_dtype(q3py_graph_object *self, void *c) { return PyUnicode_FromString(q3_dtype_name(self->dtype)); }
static PyObject *get_cache(q3py_graph_object *self, void *c) { return Py_NewRef((PyObject *)self->cache); }

static PyMethodDef graph_methods[] = {
    {"replay", (PyCFunction)(void (*)(void))graph_replay, METH_VARARGS | METH_KEYWORDS,
     "replay(x=None, *, stream=None)\n--\n\nOne decode step of the captured sequences: x [batch, hidden] (on the "
     "graph's device and dtype) is first copied into the input, unless it is the input; the graph is launched on "
     "stream (a cudaStream_t as int; None: the default stream). Returns the output, overwritten by the next replay."},
    {NULL},
};

static PyGetSetDef graph_getset[] = {
    {"input", (getter)get_buffer, NULL, "[batch, hidden] device tensor each replay reads", (void *)&buffers[0]},
    {"output", (getter)get_buffer, NULL, "[batch, hidden] device tensor each replay writes", (void *)&buffers[1]},
    {"batch", (getter)get_batch, NULL, "the captured sequences: 0 .. batch - 1 of the cache", NULL},
    {"dtype", (getter)get_dtype, NULL, "dtype of the input and output", NULL},
    {"cache", (getter)get_cache, NULL, "the KVCache the graph appends to", NULL},
    {NULL},
};

static PyType_Slot graph_slots[] = {
    {Py_tp_dealloc, graph_dealloc},
    {Py_tp_methods, graph_methods},
    {Py_tp_getset, graph_getset},
    {Py_tp_doc, "A decode step captured in a CUDA graph; made by Layer.decode_graph."},
    {0, NULL},
};

PyType_Spec q3py_graph_spec = {
    .name = "qwen3layer._C.DecodeGraph",
    .basicsize = sizeof(q3py_graph_object),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = graph_slots,
};
