/* The engine's door to a device backend. The engine sits below the backends and never calls
 * one by name: a backend installs this table when it opens (the CUDA host side does, in
 * csrc/cuda/backend.c), and the engine reaches device memory for its caches and the forward
 * of layers whose weights live on a device through it. Without one, everything on the host
 * works and a device layer or cache is refused. */
#ifndef Q3_ENGINE_DEVICE_BACKEND_H
#define Q3_ENGINE_DEVICE_BACKEND_H

#include <stddef.h>

#include "q3.h"

typedef struct {
    /* n zeroed bytes on `device`, NULL when they cannot be had; their release */
    void *(*alloc_zeroed)(size_t n, int device);
    void (*free)(void *p);
    /* bytes from src (on src_device, -1: the host) into a new block of `device`, *out, once
     * copied (q3_layer_load's weight copies; freed with free); the alignment the device's
     * kernels need of a weight they borrow (q3_weight_view_use) */
    q3_status (*upload)(void **out, int device, const void *src, int src_device, size_t bytes, q3_error *err);
    int weight_align;
    /* rows x width bytes on `device`, row r from src + r * src_pitch to dst + r * dst_pitch,
     * queued on `stream` (a cudaStream_t; NULL: the legacy default stream); the KV cache's
     * operations move a sequence's [kv_heads] head blocks with one call. Q3_ERR_STATE with the
     * CUDA error's text when the copy cannot be queued. */
    q3_status (*copy_2d)(void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t width,
                         size_t rows, int device, void *stream, q3_error *err);
    /* waits for the work queued on `stream`, or, stream NULL, for everything queued on `device`
     * (every stream); Q3_ERR_STATE with the CUDA error's text if that work failed */
    q3_status (*synchronize)(int device, void *stream, q3_error *err);
    /* bytes from src on `device` into host memory at dst, once everything queued on the device
     * (every stream) has finished; Q3_ERR_STATE with the CUDA error's text alone */
    q3_status (*copy_to_host)(void *dst, const void *src, size_t bytes, int device, q3_error *err);
    /* q3_layer_forward of a layer whose weights live on the device, after the engine checked
     * the call (csrc/engine/layer.c); same contract */
    q3_status (*layer_forward)(q3_layer *layer, q3_cache *cache, const q3_forward_args *a, q3_error *err);
    /* q3_layer_attention_half (cur NULL: the whole call) or q3_layer_attention_pass (the
     * cursor's next pass) and q3_layer_expert_half of such a layer, after the engine's
     * checks (csrc/engine/layer_halves.c; the expert ids are the backend's to check, through
     * q3_layer_check_expert_ids, once it has them on the host); same contracts, the outputs in
     * the device's memory */
    q3_status (*layer_attention_half)(q3_layer *layer, q3_cache *cache, const q3_forward_args *a,
                                      const q3_attention_half_out *out, q3_pass_cursor *cur, q3_error *err);
    q3_status (*layer_expert_half)(q3_layer *layer, const q3_expert_half_args *a, q3_error *err);
    /* q3_take_rows and q3_combine_rows (q3.h) on the device's memory, after the engine checked
     * the sizes and dtypes; same contracts (the rows read back and checked before any work) */
    q3_status (*take_rows)(void *dst, const void *src, q3_dtype dt, int64_t R, int64_t H, const int32_t *rows,
                           int64_t n, int device, void *stream, q3_error *err);
    q3_status (*combine_rows)(float *resid, int64_t R, int64_t H, const void *parts, q3_dtype parts_dtype,
                              const int32_t *rows, int64_t n, void *out, q3_dtype out_dtype, int device, void *stream,
                              q3_error *err);
    /* releases what the backend holds for the layer (nothing if it holds nothing) */
    void (*layer_release)(q3_layer *layer);
    /* the workspace the backend holds for the layer now, in bytes */
    size_t (*layer_workspace_bytes)(const q3_layer *layer);
    /* whether the backend's kernels take a layer of this geometry (checked by
     * q3_layer_create after q3_config_check): Q3_OK, else Q3_ERR_VALUE naming the field, the
     * backend's limit and the value */
    q3_status (*layer_config_check)(const q3_config *cfg, q3_error *err);
} q3_device_backend;

/* Installs `b` (kept by reference) as the process's device backend; the one installed, or NULL. */
void q3_device_backend_install(const q3_device_backend *b);
const q3_device_backend *q3_device(void);

#endif
