/* The layer object shared by py_layer.c (construction) and py_layer_call.c (calls). */
#ifndef Q3_PY_LAYER_H
#define Q3_PY_LAYER_H

#include "py_glue.h"
#include "py_layer_insides.h"

typedef struct {
    PyObject_HEAD
    q3_layer *layer;     /* holds the weights it borrowed (views released at its destroy) and its copies */
    PyThread_type_lock lock;
    int device;          /* -1: cpu; else the CUDA device of weights, caches and outputs */
} q3py_layer_object;

/* The engine's interrupt poll between passes: takes the GIL briefly and runs the signal
 * handlers (Ctrl-C); an exception they raise stays set for the caller. */
typedef struct {
    PyThreadState *saved; /* this thread's state while the GIL is released */
} q3py_interrupt_poll;

/* A layer call being made: its cache, x's view, the sequences (no heap allocation for batches
 * up to 64) and the engine's arguments */
typedef struct {
    q3_module_state *st;
    q3py_cache_object *co;
    q3_view x;
    q3_view token[3]; /* token_mask, positions and tree (data NULL: not given) */
    int32_t seqs[64];
    q3_forward_args a;
    q3py_interrupt_poll poll;
} q3py_call;

/* A call's parsing (cache, chunk_size, stream, x against the cache, seq) into c and the
 * engine's checks of it (half: the attention half's), before any output is made: a call that
 * cannot run allocates nothing; -1 with an exception, c released. The engine's forward (half
 * NULL) or attention half of it, without the GIL and under the layer's lock, the cache busy
 * meanwhile; -1 with an exception. The release of c's view and sequences. (py_layer_call.c) */
/* The per-token inputs of a call, as keyword arguments (None: not given) */
typedef struct {
    PyObject *token_mask, *positions, *tree;
} q3py_token_args;
#define Q3PY_NO_TOKEN_ARGS ((q3py_token_args){Py_None, Py_None, Py_None})
int q3py_call_open(q3py_call *c, q3py_layer_object *self, PyObject *x_obj, PyObject *cache_obj, int decode,
                   PyObject *seq_obj, PyObject *chunk_obj, PyObject *stream_obj, int half, q3py_token_args tok);
int q3py_call_run(q3py_call *c, q3py_layer_object *self, const q3_attention_half_out *half);
void q3py_call_close(q3py_call *c);

/* layer.attention_half and layer.expert_half (py_layer_halves.c); layer.attention_passes, the
 * attention half a pass at a time (py_pass_run.c) */
/* the attention half's four outputs for x of `shape` [..., H] and `dtype` on `device` (-1: the
 * host): resid fp32 and normed of x's dtype of that shape, experts int32 and weights fp32
 * [..., top_k]; pointed at by *o. -1 with an exception (each made one is in t[] for the caller
 * to release) */
int q3py_half_outputs(q3_module_state *st, const q3_config *cfg, int ndim, const int64_t *shape, q3_dtype dtype,
                      int device, q3py_tensor_object *t[4], q3_attention_half_out *o);
PyObject *q3py_layer_attention_half(q3py_layer_object *self, PyObject *x_obj, PyObject *cache_obj, int decode,
                                    PyObject *seq_obj, PyObject *chunk_obj, PyObject *stream_obj, q3_insides *ins,
                                    q3py_token_args tok);
PyObject *q3py_layer_attention_passes(q3py_layer_object *self, PyObject *x_obj, PyObject *cache_obj, int decode,
                                      PyObject *seq_obj, PyObject *chunk_obj, PyObject *stream_obj, q3_insides *ins,
                                      q3py_token_args tok);
PyObject *q3py_layer_expert_half(q3py_layer_object *self, PyObject *args, PyObject *kw);

extern PyMethodDef q3py_layer_methods[];
extern PyGetSetDef q3py_layer_getset[];

#endif
