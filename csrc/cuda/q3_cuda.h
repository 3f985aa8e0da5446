/* The CUDA backend's public API, beside the engine's (csrc/engine/q3.h): opening the
 * launcher library (libq3cuda.so for a GPU, or libq3simt.so, the same kernels on the CPU's
 * SIMT executor), decode graphs, thread schedules, and a switch for comparisons. A layer or cache on a CUDA
 * device is made with the engine's own calls (q3_layer_create with device >= 0 weights,
 * q3_cache_create_on) once the backend is open. */
#ifndef Q3_CUDA_PUBLIC_H
#define Q3_CUDA_PUBLIC_H

#include "../engine/q3.h"

/* Device weights given to q3_layer_create start at an address that is a multiple of
 * Q3_CUDA_WEIGHT_ALIGN bytes (cudaMalloc and torch's allocator give 256 or more; a view at an
 * offset may not: q3_layer_load copies such a weight once, csrc/engine/weight_load.c). What
 * the kernels' loads need of each weight, w [N, K] row-major (row r at w + r * K elements):
 *   row_dots.cuh (projections of few tokens, the router's, the experts' in decode and in the
 *     per-expert prefill): bf16 or fp16 with K % 8 == 0, 16-byte loads of each row, aligned exactly
 *     when w is; otherwise (fp32, or odd K) one element a lane: 4- resp. 2-byte loads.
 *   matmul_tc.cu (prefill projections, bf16, K % 32 == 0): staged one element at a time, or
 *     cuBLAS; rows of 64-byte multiples, so 16-byte staging would find them aligned as w is.
 *   moe_prefill.cu (grouped prefill experts, bf16, H and I % 32 == 0): 16-byte loads only
 *     where the expert's pointers are aligned (tested per tile at run time), else 2-byte.
 *   rmsnorm.cu, qk_rope_kv.cu (norm weights [n]): one element: 4- resp. 2-byte loads.
 * The experts of a fused gate_up_proj [E, 2I, H] / down_proj [E, H, I] start at whole rows
 * past its base, so each is aligned as the base is whenever a row is a multiple of 16 bytes,
 * which is when the 16-byte paths above are taken. Today's need is thus 16 bytes for bf16 and fp16
 * matrices with K % 8 == 0 and the element's size elsewhere; one rule of 16 for every weight
 * covers it and leaves 16-byte loads open to any kernel (fp32 weights included) at the cost
 * of one copy of a weight at an odd offset. Nothing here checks it: the caller of
 * q3_layer_create holds to it. */
#define Q3_CUDA_WEIGHT_ALIGN 16

/* CUDA backend (backend.c): opens the launcher library at `path` and sets *devices to the
 * CUDA devices it sees (0 without a driver or a GPU). With one or more it becomes the
 * process's backend, once; with none it is not, so that another library (the SIMT executor)
 * may still be opened. q3_cuda_device_count: the open backend's devices (0 before one is). */
q3_status q3_cuda_open(const char *path, int *devices, q3_error *err);
int q3_cuda_device_count(void);

/* The thread schedules the open backend runs a kernel's threads in: 1 on a GPU (the
 * hardware's); 3 on the SIMT executor (libq3simt.so: 0 forward, 1 reverse, 2 a shuffle
 * seeded by `seed`, between synchronisation points), so that a race shows as a difference.
 * q3_cuda_set_schedule applies to the launches that follow. */
int q3_cuda_schedules(void);
q3_status q3_cuda_set_schedule(int schedule, uint64_t seed, q3_error *err);

/* The prefill MoE's paths (experts grouped on the host): one launch per chosen expert and
 * step on the WMMA kernel, the same through cuBLAS (where it is open), grouped: a few
 * tensor-core launches per batch of experts (bf16 weights), or per batch of experts three
 * cuBLAS grouped GEMMs (cublasGemmGroupedBatchedEx, where the found cuBLAS has it); size
 * classes of rows [2^(c-1), 2^c) for class c (0: no rows). */
enum { Q3_MOE_PER_EXPERT_WMMA, Q3_MOE_PER_EXPERT_CUBLAS, Q3_MOE_GROUPED_WMMA, Q3_MOE_GROUPED_CUBLAS, Q3_MOE_PATHS };
#define Q3_MOE_SIZE_CLASSES 40
/* a path's name ("per_expert_wmma", "per_expert_cublas", "grouped_wmma", "grouped_cublas"; -1:
 * "measured"), and a path by that name (Q3_ERR_VALUE "path: expected ..." naming them all) */
const char *q3_moe_path_name(int path);
q3_status q3_moe_path_parse(const char *name, int *path, q3_error *err);

/* The prefill MoE path of a CUDA layer: `path` one of Q3_MOE_* forces it, -1 makes it the
 * measured one again (the default: the fastest of the paths a pass can take, timed on the
 * layer's first pass of each size class), -2 only reads; *now: the setting after (-1:
 * measured). For comparisons. Q3_ERR_VALUE for a CPU layer or a path out of range. */
q3_status q3_layer_cuda_moe_path(q3_layer *layer, int path, int *now, q3_error *err);
/* Times the layer's measurements take instead of the events' (ms[Q3_MOE_PATHS]; NULL: the
 * events'): for tests on the SIMT executor, where the events' times mean nothing. Both this
 * setting and the path above live in the layer's CUDA state (made for them if the layer has
 * none yet), not in the process. Q3_ERR_STATE "cuda_moe_inject_times: the CUDA backend is not
 * loaded" without a backend. */
q3_status q3_layer_cuda_moe_inject_times(q3_layer *layer, const float *ms, q3_error *err);
/* The path a CUDA layer keeps for size class c (rows in [2^(c-1), 2^c)): 1 + the path and
 * each candidate's time in ms[Q3_MOE_PATHS] (< 0: not a candidate), or 0 while unmeasured */
int q3_layer_cuda_moe_choice(const q3_layer *layer, int c, float *ms);

/* ---- device memory and copies for the glue (buffers.c) -------------------------------- */

/* Each failure is Q3_ERR_STATE with the CUDA runtime's error string as the message (or "the
 * CUDA backend is not loaded"): the caller names the argument and the device around it. */
int q3_cuda_loaded(void); /* whether q3_cuda_open succeeded */
/* A block of `bytes` (0: 4) on `device` for an extension Tensor: a kept block of that size
 * and device if there is one (the newest), else a new one (when that fails the kept blocks
 * are freed and it is tried once more). */
q3_status q3_device_alloc(void **out, size_t bytes, int device, q3_error *err);
/* a dead Tensor's block back to the kept ones for reuse: at most 16 blocks and 512 MiB, the
 * oldest freed to make room; a block past 512 MiB alone is freed */
void q3_device_keep(void *p, size_t bytes, int device);
void q3_device_free(void *p); /* at once (NULL: nothing) */
void q3_device_release_kept(void);
/* the number of kept blocks; block i's (oldest first) device, bytes and address where i is
 * below it */
int q3_device_kept(int i, int *device, size_t *bytes, void **p);
/* A new block of `device` holding `bytes` copied from src (on src_device; -1: host), ready
 * when this returns (a device source is copied on the legacy default stream, which the
 * DLPack export was asked to order its producer's work before, then waited for); freed
 * again on failure. A weight's one-time copy. */
q3_status q3_device_upload(void **out, int device, const void *src, int src_device, size_t bytes, q3_error *err);
/* synchronous: host to device (to_device) or device to host, after the legacy default
 * stream's work */
q3_status q3_device_copy(void *dst, const void *src, size_t bytes, int to_device, q3_error *err);
/* device to device, queued on `stream` (NULL: the default stream) */
q3_status q3_device_copy_async(void *dst, const void *src, size_t bytes, void *stream, q3_error *err);
/* waits for everything queued on the device */
q3_status q3_device_synchronize(int device, q3_error *err);

/* ---- the memory of an extension Tensor (buffers.c) ------------------------------------ */

/* *out <- the block of a new contiguous tensor [ndim dims: shape] of dt on `device` (-1: host
 * memory, q3_alloc; else q3_device_alloc), its C-order strides into strides: Q3_ERR_VALUE
 * "shape: [..] has a negative dimension or a size that overflows int64" before anything is
 * allocated, Q3_ERR_NOMEM when the block cannot be had. */
q3_status q3_tensor_alloc(void **out, q3_dtype dt, int ndim, const int64_t *shape, int64_t *strides, int device,
                          q3_error *err);
/* the bytes of such a tensor (its size fits: it exists); its block released (host memory
 * freed, a device block kept for reuse: q3_device_keep) */
size_t q3_tensor_bytes(q3_dtype dt, int ndim, const int64_t *shape);
void q3_tensor_free(void *p, q3_dtype dt, int ndim, const int64_t *shape, int device);
/* copy_tensor: *out <- a new block on `device` (-1: host) holding the elements of v as
 * q3_tensor_alloc made it (its strides into strides), after q3_view_check_copy's rules: host
 * to host, host to device or device to host, synchronous (Q3_ERR_STATE "copy_tensor: <the CUDA
 * error>", the block freed again) */
q3_status q3_tensor_copy(void **out, int64_t *strides, const q3_view *v, int device, q3_error *err);
/* cuBLAS for the prefill GEMMs: opens it (path NULL: the usual names), 1 if usable; switches
 * it on (1) or off (0) where opened, on < 0 only reads; whether it is in use now (0 without a
 * backend) */
int q3_cuda_blas_open(const char *path);
int q3_cuda_blas_enable(int on);

/* ---- the engine for a second module (engine_api.h) ----------------------------------- */

/* The table of engine functions that qwen3layer._testing calls instead of linking an engine of
 * its own; _C's glue exports it as a PyCapsule of this name. */
#define Q3_ENGINE_API_CAPSULE "qwen3layer._C._engine_api"
typedef struct q3_engine_api q3_engine_api;
const q3_engine_api *q3_engine_api_get(void);

/* ---- decode graphs (CUDA layers) ------------------------------------------------- */

/* One decode step of a fixed set of sequences, captured once in a CUDA graph and replayed
 * per token: no host synchronisation and no allocation inside, one launch per step. The
 * graph owns its device input and output ([batch, 1, hidden] of io_dtype: write the next
 * tokens into the input, read the step's result from the output) and its own workspace; it
 * borrows the layer and the cache, which must outlive it. Each replay appends one token to
 * each of its sequences, as q3_layer_forward would; calls of the layer on the same cache may
 * be mixed with replays (lengths and padding are re-uploaded when they changed). */
#define Q3_GRAPH_MAX_BATCH 64
typedef struct q3_decode_graph q3_decode_graph;
/* of sequences 0 .. batch - 1 of the cache: batch in [1, min(the cache's batch, Q3_GRAPH_MAX_BATCH)]
 * and the layer on a CUDA device, else Q3_ERR_VALUE naming them */
q3_status q3_decode_graph_create(q3_decode_graph **out, q3_layer *layer, q3_cache *cache, int64_t batch,
                                 q3_dtype io_dtype, q3_error *err);
void *q3_decode_graph_input(const q3_decode_graph *g);
void *q3_decode_graph_output(const q3_decode_graph *g);
/* queues one step on `stream` (NULL: the default stream); on failure nothing was queued and
 * the cache lengths are unchanged */
q3_status q3_decode_graph_replay(q3_decode_graph *g, void *stream, q3_error *err);
void q3_decode_graph_destroy(q3_decode_graph *g);

/* ---- the MoE path settings and decode graphs as a binding calls them (moe_prefill.c,
 * decode_graph.c): a binding only converts ------------------------------------------------ */

/* Q3_OK where the backend is open, else Q3_ERR_STATE "<what>: the CUDA backend is not loaded" */
q3_status q3_cuda_require(const char *what, q3_error *err);
/* q3_layer_cuda_moe_path by name: `name` one of q3_moe_path_name's (q3_moe_path_parse's
 * Q3_ERR_VALUE otherwise, checked first), NULL only reads; *now: the setting's name after.
 * Q3_ERR_STATE "cuda_moe_path: the CUDA backend is not loaded" without a backend. */
q3_status q3_layer_cuda_moe_path_named(q3_layer *layer, const char *name, const char **now, q3_error *err);
/* A measured size class of a CUDA layer: passes of lo..hi rows, the path kept and each
 * candidate's time (ms < 0: not a candidate). q3_layer_cuda_moe_classes fills out with the
 * measured ones, smallest first, and returns their count. */
typedef struct {
    int64_t lo, hi;
    int path;
    float ms[Q3_MOE_PATHS];
} q3_moe_class;
int q3_layer_cuda_moe_classes(const q3_layer *layer, q3_moe_class out[Q3_MOE_SIZE_CLASSES]);
/* A graph's input and output as a tensor: [batch, hidden] of the graph's io_dtype, contiguous,
 * on the CUDA device returned. */
int q3_decode_graph_io(const q3_decode_graph *g, q3_tensor_spec *spec);
/* x (a view on the graph's device) into the graph's input, queued on `stream`: x [batch,
 * hidden] (Q3_ERR_VALUE), of the graph's dtype (Q3_ERR_TYPE), contiguous; nothing to copy
 * when x is the input. Q3_ERR_STATE "x: copy to the graph's input failed: ..." */
q3_status q3_decode_graph_load(q3_decode_graph *g, const q3_view *x, void *stream, q3_error *err);

/* ---- end of the binding's block ------------------------------------------------------ */

#endif
