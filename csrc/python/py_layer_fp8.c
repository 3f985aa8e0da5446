/* qwen3layer._C.Layer's intake of e4m3 tensors (Q3_WS_E4M3 entries of the engine's weight
 * table: the FP8 format's projection matrices): float8_e4m3fn bytes borrowed without a copy
 * (an FP8 layer does not quantize); their scales, norms and the router go through
 * q3py_layer_take_weight. */
#include "py_layer.h"

const void *q3py_layer_take_e4m3(q3py_layer_object *self, PyObject *weights, const q3_weight_entry *e) {
    char arg[160];
    q3_view *v = q3py_layer_acquire_shaped(self, weights, e->name, e->rank, e->dims, Q3_VIEW_HOST | Q3_VIEW_E4M3, arg,
                                           sizeof arg);
    if (!v) return NULL;
    /* a CUDA layer takes the bytes from its device or from the host (uploaded once) */
    const int placed = v->device == self->device || (self->device >= 0 && v->device < 0);
    if (v->dtype != Q3_E4M3 || !v->contiguous || !placed) {
        PyErr_Format(PyExc_ValueError, "%s: an fp8_e4m3_block128 layer expected a contiguous float8_e4m3fn "
                     "tensor on %s, got a%s %s tensor on %s", arg, self->device < 0 ? "cpu" : "cuda",
                     v->contiguous ? "" : " non-contiguous", q3_dtype_name(v->dtype), v->device < 0 ? "cpu" : "cuda");
        q3_view_release(v);
        return NULL;
    }
    if (self->device >= 0 && (v->device < 0 || (uintptr_t)v->data % Q3_CUDA_WEIGHT_ALIGN != 0)) {
        /* a host matrix, or a device one off the kernels' 16-byte alignment: copied */
        const void *data = q3py_layer_device_copy(self, v, (size_t)q3_weight_entry_numel(e), e->name, arg);
        q3_view_release(v);
        return data;
    }
    self->n_views++;
    return v->data;
}
