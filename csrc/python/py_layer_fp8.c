/* qwen3layer._C.Layer's intake of FP8 weights (weight_format "fp8_e4m3_block128"): the
 * projection matrices as float8_e4m3fn bytes borrowed without a copy, each with its
 * "<name>_scale_inv" block scales; norms and the router go through q3py_layer_take_weight. */
#include <string.h>

#include "py_layer.h"

/* An FP8 matrix weights[name] of shape dims (float8_e4m3fn, contiguous: never converted, an
 * FP8 layer does not quantize) and its weights[name + "_scale_inv"] of shape sdims (converted
 * once if not of the layer's scale dtype sdt). The scale is returned in *scale. */
const void *q3py_layer_take_fp8(q3py_layer_object *self, PyObject *weights, const char *name, int rank,
                            const int64_t *dims, const int64_t *sdims, q3_dtype sdt, const void **scale) {
    char arg[160], scale_name[128];
    snprintf(scale_name, sizeof scale_name, "%s_scale_inv", name);
    if (!PyDict_GetItemString(weights, scale_name) && PyDict_GetItemString(weights, name)) {
        PyErr_Format(PyExc_ValueError, "weights['%s']: an FP8 weight without its scale: missing '%s'", name,
                     scale_name);
        return NULL;
    }
    q3_view *v = q3py_layer_acquire_shaped(self, weights, name, rank, dims, Q3_VIEW_HOST | Q3_VIEW_E4M3, arg, sizeof arg);
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
    const void *data = v->data;
    if (self->device >= 0 && (v->device < 0 || (uintptr_t)v->data % Q3_CUDA_WEIGHT_ALIGN != 0)) {
        size_t bytes = 1; /* a host matrix, or a device one off the kernels' 16-byte alignment: copied */
        for (int d = 0; d < rank; d++) bytes *= (size_t)dims[d];
        data = q3py_layer_device_copy(self, v, bytes, name, arg);
        q3_view_release(v);
        if (!data) return NULL;
    } else {
        self->n_views++;
    }
    *scale = q3py_layer_take_weight(self, weights, scale_name, rank, sdims, sdt);
    if (!*scale || q3py_layer_record_ptr(self, name, data) < 0 || q3py_layer_record_ptr(self, scale_name, *scale) < 0)
        return NULL;
    return data;
}
