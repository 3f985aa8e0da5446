/* The layer object shared by py_layer.c (construction), py_layer_call.c (calls),
 * py_layer_halves.c (the halves' outputs, the insides) and py_pass_run.c (a call pass by pass). */
#ifndef Q3_PY_LAYER_H
#define Q3_PY_LAYER_H

#include "py_glue.h"

typedef struct {
    PyObject_HEAD
    q3_layer *layer;     /* holds the weights it borrowed (views released at its destroy) and its copies */
    PyThread_type_lock lock;
    int device;          /* -1: cpu; else the CUDA device of weights, caches and outputs */
} q3py_layer_object;

/* The layer's insides on request (py_layer_halves.c), for the calls of py_layer_call.c */
typedef struct {
    int router, attention; /* what the call asks for */
    int64_t limit;         /* attention_limit in bytes */
    /* (router_logits, router_experts, router_weights, attention), None for what was not asked;
     * NULL until made, and when nothing was asked */
    PyObject *made;
} q3_insides;

/* A layer call's arguments as given (None: not given; py_layer_call.c's parse_call) and the
 * insides asked */
typedef struct {
    PyObject *x, *cache, *seq, *chunk, *out, *stream;
    PyObject *tok[3]; /* token_mask, positions, tree */
    int decode;
    q3_insides ins;
} q3py_call_args;

/* A layer call being made: its cache, x's view, the per-token inputs' views, the sequences (no
 * heap allocation for batches up to 64) and the engine's arguments */
typedef struct {
    q3_module_state *st;
    q3py_cache_object *co;
    q3_view x;
    q3_view token[3]; /* token_mask, positions and tree (left empty: not given) */
    int32_t seqs[64];
    q3_forward_args a;
    PyThreadState *saved; /* this thread's state while the GIL is released (the interrupt poll's) */
} q3py_call;

/* Makes the requested insides on the layer's device for opened call c, and points c->a's fields
 * at them. Attention maps over the limit raise ValueError with the shape and the bytes. -1 with
 * an exception (ins->made cleared by the caller). */
int q3py_insides_make(q3_insides *ins, q3py_call *c, const q3py_layer_object *self);
/* y alone when nothing was asked; else (y, router_logits, router_experts, router_weights,
 * attention), None for what was not asked; ins cleared. Steals y; NULL passes through. */
PyObject *q3py_insides_result(q3_insides *ins, PyObject *y);

/* A call's parsing and the engine's checks of it (half: the attention half's), before any output
 * is made: a call that cannot run allocates nothing; -1 with an exception, c released. The
 * engine's forward (half NULL), attention half, or its next pass (cur), without the GIL and
 * under the layer's lock, the cache busy meanwhile; -1 with an exception. The release of c's
 * views and sequences. (py_layer_call.c) */
int q3py_call_open(q3py_call *c, q3py_layer_object *self, const q3py_call_args *p, int half);
int q3py_call_run(q3py_call *c, q3py_layer_object *self, const q3_attention_half_out *half, q3_pass_cursor *cur);
void q3py_call_close(q3py_call *c);

/* `...` run without the GIL under the layer's lock: its settings change only while no call runs */
#define Q3PY_LAYER_LOCKED(self, ...) \
    Q3PY_NOGIL(PyThread_acquire_lock((self)->lock, WAIT_LOCK); __VA_ARGS__; PyThread_release_lock((self)->lock))

/* the attention half's four outputs (q3_attention_half_specs) of opened call c, a pass of
 * `tokens` tokens a sequence, on the layer's device: the tuple (resid, normed, experts,
 * weights), *o pointed at them; NULL with an exception (py_layer_halves.c) */
PyObject *q3py_half_outputs(q3py_call *c, q3py_layer_object *self, int64_t tokens, q3_attention_half_out *o);
/* layer.attention_passes, the attention half a pass at a time (py_pass_run.c); layer.expert_half
 * (py_layer_halves.c) */
PyObject *q3py_layer_attention_passes(q3py_layer_object *self, q3py_call_args *p);
PyObject *q3py_layer_expert_half(q3py_layer_object *self, PyObject *args, PyObject *kw);

extern PyMethodDef q3py_layer_methods[];

#endif
