/* qwen3layer._C.Layer's intake of FP8 weights (weight_format "fp8_e4m3_block128"): the
 * projection matrices as float8_e4m3fn bytes borrowed without a copy, each with its
 * "<name>_scale_inv" block scales; norms and the router go through q3_layer_take_weight. */
#include <string.h>

#include "py_layer.h"

#define FUSED_GATE_UP "mlp.experts.gate_up_proj"
#define FUSED_DOWN "mlp.experts.down_proj"


/* An FP8 matrix weights[name] of shape dims (float8_e4m3fn, contiguous: never converted, an
 * FP8 layer does not quantize) and its weights[name + "_scale_inv"] of shape sdims (converted
 * once if not of the layer's scale dtype sdt). The scale is returned in *scale. */
const void *q3_layer_take_fp8(q3_layer_object *self, PyObject *weights, const char *name, int rank,
                            const int64_t *dims, const int64_t *sdims, q3_dtype sdt, const void **scale) {
    char arg[160], scale_name[128];
    snprintf(scale_name, sizeof scale_name, "%s_scale_inv", name);
    if (!PyDict_GetItemString(weights, scale_name) && PyDict_GetItemString(weights, name)) {
        PyErr_Format(PyExc_ValueError, "weights['%s']: an FP8 weight without its scale: missing '%s'", name,
                     scale_name);
        return NULL;
    }
    q3_view *v = q3_layer_acquire_shaped(self, weights, name, rank, dims, Q3_VIEW_HOST | Q3_VIEW_E4M3, arg, sizeof arg);
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
        data = q3_layer_device_copy(self, v, bytes, name, arg);
        q3_view_release(v);
        if (!data) return NULL;
    } else {
        self->n_views++;
    }
    *scale = q3_layer_take_weight(self, weights, scale_name, rank, sdims, sdt);
    if (!*scale || q3_layer_record_ptr(self, name, data) < 0 || q3_layer_record_ptr(self, scale_name, *scale) < 0)
        return NULL;
    return data;
}

/* experts of an FP8 layer: per expert (mlp.experts.{e}.{gate,up,down}_proj.weight and their
 * scales), or fused as transformers' FP8 experts hold them: gate_up_proj [E, 2I, H] with a
 * scale [E, 2 ceil(I/128), ceil(H/128)] (the gate's blocks, then the up's: a 128-row block
 * never spans both halves), down_proj [E, H, I] with [E, ceil(H/128), ceil(I/128)] */
int q3_layer_take_fp8_experts(q3_layer_object *self, PyObject *weights, const q3_config *c, q3_dtype sdt) {
    const int E = c->experts;
    const int64_t H = c->hidden, I = c->moe_inter, hb = (H + 127) / 128, ib = (I + 127) / 128;
    const void **gate = self->expert_ptrs, **up = gate + E, **down = up + E;
    const void **gate_s = down + E, **up_s = gate_s + E, **down_s = up_s + E;
    if (PyDict_GetItemString(weights, FUSED_GATE_UP)) {
        const int64_t gu[3] = {E, 2 * I, H}, gus[3] = {E, 2 * ib, hb}, dn[3] = {E, H, I}, dns[3] = {E, hb, ib};
        const void *gu_s, *dn_s;
        const uint8_t *g = q3_layer_take_fp8(self, weights, FUSED_GATE_UP, 3, gu, gus, sdt, &gu_s);
        if (!g) return -1;
        const uint8_t *d = q3_layer_take_fp8(self, weights, FUSED_DOWN, 3, dn, dns, sdt, &dn_s);
        if (!d) return -1;
        const size_t ss = q3_dtype_size(sdt);
        for (int e = 0; e < E; e++) {
            gate[e] = g + (size_t)e * 2 * I * H;
            up[e] = g + ((size_t)e * 2 * I + I) * H;
            down[e] = d + (size_t)e * H * I;
            gate_s[e] = (const char *)gu_s + (size_t)e * 2 * ib * hb * ss;
            up_s[e] = (const char *)gu_s + ((size_t)e * 2 * ib + ib) * hb * ss;
            down_s[e] = (const char *)dn_s + (size_t)e * hb * ib * ss;
        }
        return 0;
    }
    const void **slots[Q3_X_COUNT] = {gate, up, down}, **scales[Q3_X_COUNT] = {gate_s, up_s, down_s};
    for (int e = 0; e < E; e++)
        for (int x = 0; x < Q3_X_COUNT; x++) {
            char name[96];
            int64_t dims[2], sdims[2];
            snprintf(name, sizeof name, "mlp.experts.%d.%s.weight", e, q3_expert_weight_name(x));
            q3_expert_weight_shape(c, x, dims);
            q3_fp8_scale_shape(dims, sdims);
            slots[x][e] = q3_layer_take_fp8(self, weights, name, 2, dims, sdims, sdt, &scales[x][e]);
            if (!slots[x][e]) return -1;
        }
    return 0;
}
