/* Declarations shared by the CPython glue files (the only files that include Python.h).
 * The glue parses arguments, moves tensors in and out through DLPack, turns engine
 * statuses into exceptions, and releases the GIL around engine calls. */
#ifndef Q3_PY_GLUE_H
#define Q3_PY_GLUE_H

#include "py_convert.h"

#include <pythread.h>

#include "../cuda/q3_cuda.h"
#include "../engine/q3.h"

struct q3_module_state {
    PyTypeObject *tensor_type;
    PyTypeObject *cache_type;
    PyTypeObject *layer_type;
    PyTypeObject *graph_type;
    PyTypeObject *passes_type;
    PyObject *cache_full_error;
};

extern PyModuleDef q3_module_def;
q3_module_state *q3_state_of_type(PyTypeObject *type);
static inline q3_module_state *q3py_state(PyObject *module) { return (q3_module_state *)PyModule_GetState(module); }

/* The exception being raised, taken out and put back around code that may run Python (a
 * DLPack producer's deleter, a method call) so that it neither fails on it nor replaces it. */
typedef struct {
    PyObject *type, *value, *tb;
} q3_pending_error;

static inline void q3_error_stash(q3_pending_error *e) {
#if PY_VERSION_HEX >= 0x030C0000
    e->type = e->tb = NULL;
    e->value = PyErr_GetRaisedException();
#else
    PyErr_Fetch(&e->type, &e->value, &e->tb);
    PyErr_NormalizeException(&e->type, &e->value, &e->tb);
    if (e->tb && e->value) PyException_SetTraceback(e->value, e->tb);
#endif
}

/* puts it back; an exception raised in between is dropped */
static inline void q3_error_unstash(q3_pending_error *e) {
    if (PyErr_Occurred()) PyErr_Clear();
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(e->value);
#else
    PyErr_Restore(e->type, e->value, e->tb);
#endif
}

/* ---- DLPack import (py_dlpack.c) ---------------------------------------------- */

/* Imports obj (with __dlpack__, or an unused capsule) into v (q3.h: the engine's checks, q3_view_from_dlpack,
 * with `allow`), expected on `device` (-1: cpu, else cuda:device): valid until q3_view_release.
 * Errors name `arg`: TypeError for a non-tensor or another dtype, ValueError for another device
 * or an unusable layout. A CUDA producer is handed `stream` (the consumer's, NULL: legacy
 * default). Returns 0, or -1 with an exception set (nothing to release then). */
int q3_view_acquire_on(PyObject *obj, const char *arg, q3_view *v, int device, int allow, void *stream);
/* obj.__dlpack_device__(): (device_type, device_id); 0, or -1 with TypeError naming arg */
int q3py_dlpack_device(PyObject *obj, const char *arg, int *type, int *id);
void q3_view_release(q3_view *v);
/* Tensors imported together: each obj (NULL: not given, its view left empty) as arg, under
 * allow, as q3_view_acquire_on does, in order until one fails; q3py_views_release releases them
 * all (the ones not reached are empty). 0, or -1 with the exception. */
typedef struct {
    PyObject *obj;
    const char *arg;
    int allow;
    q3_view view;
} q3py_arg_view;
int q3py_views_acquire(q3py_arg_view *a, int n, int device, void *stream);
void q3py_views_release(q3py_arg_view *a, int n);

/* ---- Tensor (py_tensor.c): extension-owned memory exported through DLPack -------- */

typedef struct {
    PyObject_HEAD
    void *data;       /* first element */
    void *alloc;      /* owned block (q3_tensor_alloc), or NULL for a view */
    PyObject *base;   /* keeps the memory of a view alive (a KVCache), or NULL */
    int ndim;
    int64_t shape[Q3_MAX_DIM];
    int64_t strides[Q3_MAX_DIM]; /* elements */
    q3_dtype dtype;
    int device; /* -1: host memory; else the CUDA device */
    Py_buffer buffer; /* a view of a buffer-protocol object's (a memory-mapped file), else buffer.obj NULL */
} q3py_tensor_object;

extern PyType_Spec q3py_tensor_spec;
/* new contiguous tensor of fresh extension memory (uninitialised) on CUDA device `device` (-1:
 * host; q3py_tensor_new: the host) */
q3py_tensor_object *q3py_tensor_new_on(q3_module_state *st, q3_dtype dt, int ndim, const int64_t *shape, int device);
static inline q3py_tensor_object *q3py_tensor_new(q3_module_state *st, q3_dtype dt, int ndim, const int64_t *shape) {
    return q3py_tensor_new_on(st, dt, ndim, shape, -1);
}
/* view of memory owned by base */
q3py_tensor_object *q3py_tensor_view(q3_module_state *st, PyObject *base, void *data, q3_dtype dt,
                                 int ndim, const int64_t *shape, const int64_t *strides);
/* _C.buffer_view (a view [shape] of dtype at byte `offset` of any buffer-protocol object, kept
 * alive) and _C.copy_tensor */
PyObject *q3py_buffer_view(PyObject *module, PyObject *args);
PyObject *q3py_copy_tensor(PyObject *module, PyObject *args);
/* _C.take_rows and _C.combine_rows (py_split_rows.c) */
PyObject *q3py_take_rows(PyObject *module, PyObject *args, PyObject *kw);
PyObject *q3py_combine_rows(PyObject *module, PyObject *args, PyObject *kw);
/* 'cpu' (device -1) or 'cuda:N': a tensor's or a cache's device attribute */
static inline PyObject *q3py_device_name(int device) {
    return device < 0 ? PyUnicode_FromString("cpu") : PyUnicode_FromFormat("cuda:%d", device);
}

/* ---- KVCache (py_cache.c: the object, its views and attributes; py_cache_ops.c: its
 * operations) ----------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    q3_cache *cache;
    int busy; /* a layer call is running on it with the GIL released */
    int passes_open; /* a layer call run pass by pass (Layer.attention_passes) is open on it */
} q3py_cache_object;

extern PyType_Spec q3py_cache_spec;
q3py_cache_object *q3py_cache_object_new(q3_module_state *st, int batch, int64_t capacity,
                                     int kv_heads, int head_dim, q3_dtype dt, int device);
/* the KVCache of engine cache c, taken over (destroyed now when the object cannot be made) */
q3py_cache_object *q3py_cache_wrap(q3_module_state *st, q3_cache *c);
/* 0, or -1 with RuntimeError while a layer call runs on the cache, or one run pass by pass
 * (py_pass_run.c) is open on it */
int q3py_cache_check_idle(q3py_cache_object *o);
/* Engine call r on o's cache (q3_cache_call; its checks are the engine's): refused while the
 * cache is not idle; else made with the cache busy and the GIL released. 0, or -1 with the
 * engine's error raised. */
int q3py_cache_run(q3py_cache_object *o, q3_cache_call_args *r);
/* keys(seq=0), values(seq=0): one sequence's view; all_keys(tokens=None), all_values(tokens=None):
 * every sequence's (py_cache.c); the methods with their docstrings (py_cache_ops.c) */
PyObject *q3py_cache_view(q3py_cache_object *o, PyObject *args, PyObject *kw, int values, int all);
extern PyMethodDef q3py_cache_methods[];

/* ---- Layer (py_layer.c) ------------------------------------------------------------ */

extern PyType_Spec q3py_layer_spec;

/* ---- config (py_config.c) ------------------------------------------------------------ */

/* a LayerConfig's fields into *out, checked (q3_config_check); -1 with an exception */
int q3_parse_config(PyObject *cfg, q3_config *out);
/* rope_table(config) -> (inv_freq tuple [head_dim / 2], scale): q3_rope_table's */
PyObject *q3py_rope_table(PyObject *m, PyObject *cfg);
/* rope_defaults() -> the RoPE fields at the engine's Q3_ROPE_SCALING_DEFAULT */
PyObject *q3py_rope_defaults(PyObject *m, PyObject *unused);
/* "weight_format": the engine's formats by name -> q3_weight_format *out; None leaves *out as it
 * was (the caller's default). Not in py_convert.c: _testing, which compiles that file too,
 * reaches the engine only through its API table. */
int q3py_weight_format(PyObject *obj, void *out);
/* experts= (a 1-D sequence of distinct expert ids in [0, E): the engine's q3_held_from_ids) as
 * a PyMem_Malloc'd [E] mask of the ids held; -1 with an exception naming the entry */
int q3py_held_experts(PyObject *obj, int E, uint8_t **held);

/* ---- the module's functions by file: py_cuda.c (CUDA), py_random.c (random weights and
 * inputs, the weight table, FP8 and GPTQ dequantization), py_routing.c (tokens per expert),
 * py_held.c (the drop-in's per-call test of the weights it borrowed) ------------------------ */

extern PyMethodDef q3_cuda_methods[], q3_random_methods[], q3_routing_methods[], q3_held_methods[];

/* ---- DecodeGraph (py_graph.c), AttentionPasses (py_pass_run.c) ---------------------------- */

extern PyType_Spec q3py_graph_spec, q3py_passes_spec;
/* captures one decode step of sequences 0 .. batch - 1 of the cache (layer_obj kept alive); the
 * engine checks batch and the layer's device */
PyObject *q3py_graph_new(q3_module_state *st, PyObject *layer_obj, q3_layer *layer, q3py_cache_object *cache,
                         int64_t batch, q3_dtype dtype);

/* ---- engine work without the GIL (the glue's calls of the engine that take long) ---------- */

/* `...`: statements touching no Python object, run with the GIL released */
#define Q3PY_NOGIL(...) do { Py_BEGIN_ALLOW_THREADS __VA_ARGS__; Py_END_ALLOW_THREADS } while (0)

#endif
