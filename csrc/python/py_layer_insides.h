/* The layer's insides on request (py_layer_insides.c), for the calls of py_layer_call.c. */
#ifndef Q3_PY_LAYER_INSIDES_H
#define Q3_PY_LAYER_INSIDES_H

#include "py_glue.h"

/* the bytes of attention maps a call may make unless its caller raises the limit: 1 GiB,
 * e.g. 64 heads x 2048 new tokens x 2048 positions */
#define Q3_ATTENTION_LIMIT_DEFAULT ((int64_t)1 << 30)

typedef struct {
    int router, attention; /* what the call asks for */
    int64_t limit;         /* attention_limit in bytes */
    q3py_tensor_object *logits, *experts, *weights, *maps; /* the outputs, NULL until made */
} q3_insides;

/* return_router, return_attention (truth values) and attention_limit (None or bytes >= 0;
 * only with return_attention); -1 with an exception */
int q3py_insides_parse(q3_insides *ins, PyObject *router, PyObject *attention, PyObject *limit);
/* Makes the requested outputs on `device` for the call `a` (already checked by the engine)
 * with x's leading dims, and points a's fields at them. Attention maps over the limit raise
 * ValueError with the shape and the bytes. -1 with an exception (the caller clears). */
int q3py_insides_make(q3_insides *ins, q3_module_state *st, const q3_layer *layer, const q3_cache *c,
                    const q3_view *x, int device, q3_forward_args *a);
/* y alone when nothing was asked; else (y, router_logits, router_experts, router_weights,
 * attention), None for what was not asked. Steals y; NULL passes through. */
PyObject *q3py_insides_result(q3_insides *ins, PyObject *y);
void q3py_insides_clear(q3_insides *ins);

#endif
