/* DecodeGraph: a captured decode step (csrc/cuda/decode_graph.c) as a Python object. It keeps its
 * layer and cache alive; its input and output are device tensors exported through DLPack. */
#include "py_layer.h"

typedef struct {
    PyObject_HEAD
    q3_decode_graph *graph;
    PyObject *layer;          /* the Layer: the graph reads its weights */
    q3py_cache_object *cache; /* the graph appends to it */
} q3py_graph_object;

PyObject *q3py_graph_new(q3_module_state *st, PyObject *layer_obj, q3_layer *layer, q3py_cache_object *co,
                         int64_t batch, q3_dtype dtype) {
    if (q3py_cache_check_idle(co) < 0) return NULL;
    q3py_graph_object *self = (q3py_graph_object *)st->graph_type->tp_alloc(st->graph_type, 0); /* zeroed */
    if (!self) return NULL;
    self->layer = Py_NewRef(layer_obj);
    self->cache = (q3py_cache_object *)Py_NewRef((PyObject *)co);
    q3_error err;
    q3_status s;
    Q3PY_NOGIL(s = q3_decode_graph_create(&self->graph, layer, co->cache, batch, dtype, &err));
    if (s == Q3_OK) return (PyObject *)self;
    Py_DECREF(self);
    return q3_raise(st, &err);
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
    q3_tensor_spec io;
    const int device = q3_decode_graph_io(self->graph, &io);
    const int64_t strides[2] = {io.shape[1], 1};
    q3py_tensor_object *t = st ? q3py_tensor_view(st, (PyObject *)self, data, io.dtype, 2, io.shape, strides) : NULL;
    if (t) t->device = device;
    return (PyObject *)t;
}

static PyObject *graph_replay(q3py_graph_object *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"x", "stream", NULL};
    PyObject *x = Py_None;
    void *stream = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|O$O&:replay", names, &x, q3py_stream, &stream)) return NULL;
    q3_module_state *st = q3_state_of_type(Py_TYPE(self));
    if (!st || q3py_cache_check_idle(self->cache) < 0) return NULL;
    q3_error err;
    q3_status s;
    if (x != Py_None) { /* x into the graph's input, on the stream */
        q3_tensor_spec io;
        q3_view v;
        if (q3_view_acquire_on(x, "x", &v, q3_decode_graph_io(self->graph, &io), 0, stream) < 0) return NULL;
        s = q3_decode_graph_load(self->graph, &v, stream, &err);
        q3_view_release(&v);
        if (q3py_status(s, &err) < 0) return NULL;
    }
    self->cache->busy = 1;
    Q3PY_NOGIL(s = q3_decode_graph_replay(self->graph, stream, &err));
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
/* batch (closure NULL) or dtype of the input and output */
static PyObject *get_io(q3py_graph_object *self, void *dtype) {
    q3_tensor_spec io;
    q3_decode_graph_io(self->graph, &io);
    return dtype ? PyUnicode_FromString(q3_dtype_name(io.dtype)) : PyLong_FromLongLong(io.shape[0]);
}
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
    {"batch", (getter)get_io, NULL, "the captured sequences: 0 .. batch - 1 of the cache", NULL},
    {"dtype", (getter)get_io, NULL, "dtype of the input and output", "dtype"},
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
