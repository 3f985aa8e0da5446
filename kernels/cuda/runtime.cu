// The library's entry point: the runtime helpers and the table of launchers
// (kernels/cuda/ops_cuda.h). Everything CUDA stays behind this table.
#include "ops_cuda.h"
#include "common.cuh"

extern "C" {
int q3_rmsnorm_cuda(float *, const float *, const void *, q3_dtype, int64_t, int64_t, float, void *);
int q3_add_rmsnorm_cuda(float *, float *, const float *, const void *, q3_dtype, int64_t, int64_t, float, void *);
int q3_matmul_cuda(float *, const float *, const void *, q3_dtype, int64_t, int64_t, int64_t, int, void *);
int q3_gate_up_cuda(float *, const float *, const void *, const void *, q3_dtype, int64_t, int64_t, int64_t, void *);
int q3_matmul_tc_cuda(float *, const float *, const void *, int64_t, int64_t, int64_t, int, uint16_t *, void *);
int q3_matmul_wmma_cuda(float *, const float *, const void *, int64_t, int64_t, int64_t, int, uint16_t *, void *);
int q3_qk_rope_kv_cuda(float *, float *, const float *, const void *, const void *, q3_dtype, const int64_t *,
                       const q3_attn_seq *, int, const q3_attn_shape *, float, const float *, float, void *);
int q3_attention_cuda(float *, const float *, const q3_attn_seq *, int, const q3_attn_shape *, float *, void *);
int q3_attention_probs_cuda(float *, const float *, const q3_attn_seq *, int, const q3_attn_shape *, int64_t, int64_t,
                            int64_t, void *);
int q3_router_topk_cuda(int32_t *, float *, const float *, int64_t, int, int, int, void *);
int q3_decode_prepare_cuda(q3_attn_seq *, int64_t *, int64_t *, int, void *);
int q3_moe_route_cuda(int64_t *, int32_t *, float *, int32_t *, int32_t *, const int32_t *, const float *, int64_t, int,
                      int, void *);
int q3_moe_gate_up_cuda(float *, const float *, const int32_t *, const int64_t *, const int32_t *, const void *const *,
                        const void *const *, q3_dtype, int, int64_t, int64_t, void *);
int q3_moe_down_cuda(float *, const float *, const int64_t *, const int32_t *, const void *const *, q3_dtype, int,
                     int64_t, int64_t, void *);
int q3_moe_combine_cuda(float *, const float *, const float *, const int32_t *, int64_t, int, int64_t, void *);
int q3_moe_gate_up_tc_cuda(float *, const float *, const int32_t *, const q3_moe_tile *, int, const void *const *,
                           const void *const *, int64_t, int64_t, void *);
int q3_moe_down_tc_cuda(float *, const float *, const q3_moe_tile *, int, const void *const *, int64_t, int64_t,
                        void *);
int q3_moe_combine_csr_cuda(float *, const float *, const float *, const int32_t *, const int32_t *, const int32_t *,
                            int, int64_t, void *);
int q3_matmul_fp8_cuda(float *, const float *, const uint8_t *, const void *, q3_dtype, int64_t, int64_t, int64_t, int,
                       void *);
int q3_fp8_dequant_cuda(uint16_t *, const uint8_t *, const void *, q3_dtype, int64_t, int64_t, void *);
int q3_moe_gate_up_fp8_cuda(float *, const float *, const int32_t *, const int64_t *, const int32_t *,
                            const uint8_t *const *, const uint8_t *const *, const void *const *, const void *const *,
                            q3_dtype, int, int64_t, int64_t, void *);
int q3_moe_down_fp8_cuda(float *, const float *, const int64_t *, const int32_t *, const uint8_t *const *,
                         const void *const *, q3_dtype, int, int64_t, int64_t, void *);
int q3_matmul_int4_cuda(float *, const float *, const q3_int4_matrix *, int64_t, int64_t, int64_t, int, void *);
int q3_int4_dequant_cuda(uint16_t *, const q3_int4_matrix *, int64_t, int64_t, void *);
int q3_moe_gate_up_int4_cuda(float *, const float *, const int32_t *, const int64_t *, const int32_t *,
                             const q3_int4_matrix *, const q3_int4_matrix *, int, int64_t, int64_t, void *);
int q3_moe_down_int4_cuda(float *, const float *, const int64_t *, const int32_t *, const q3_int4_matrix *, int,
                          int64_t, int64_t, void *);
int q3_swiglu_cuda(float *, const float *, const float *, int64_t, void *);
int q3_gather_rows_cuda(float *, const float *, const int32_t *, int64_t, int64_t, void *);
int q3_scatter_add_rows_cuda(float *, const float *, const int32_t *, const float *, int64_t, int64_t, void *);
int q3_take_rows_cuda(void *, const void *, q3_dtype, const int32_t *, int64_t, int64_t, void *);
int q3_add_rows_cuda(float *, const void *, q3_dtype, const int32_t *, int64_t, int64_t, void *);
int q3_to_f32_cuda(float *, const void *, q3_dtype, int64_t, void *);
int q3_from_f32_cuda(void *, q3_dtype, const float *, int64_t, void *);
int q3_blas_open(const char *);
int q3_blas_enable(int);
int q3_blas_grouped_available(void);
int q3_blas_gemm_grouped_bf16(float *const *, const uint16_t *const *, const uint16_t *const *, const int *, int,
                              int64_t, int64_t, void *);
}

static int device_count(int *n) { return (int)cudaGetDeviceCount(n); }
static int set_device(int d) { return (int)cudaSetDevice(d); }
// a failure is returned, and taken off the last error: the launch after it (which reads the
// last error) must not report it (the prefill MoE timing goes on without its buffer)
static int malloc_device(void **p, size_t bytes) {
    const cudaError_t e = cudaMalloc(p, bytes);
    if (e != cudaSuccess) (void)cudaGetLastError();
    return (int)e;
}
static int free_device(void *p) { return (int)cudaFree(p); }
static int copy(void *dst, const void *src, size_t bytes, int to_device) {
    return (int)cudaMemcpy(dst, src, bytes, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost);
}
static int copy_async(void *dst, const void *src, size_t bytes, int to_device, void *stream) {
    return (int)cudaMemcpyAsync(dst, src, bytes, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost,
                                (cudaStream_t)stream);
}
static int memset_async(void *p, int value, size_t bytes, void *stream) {
    return (int)cudaMemsetAsync(p, value, bytes, (cudaStream_t)stream);
}
static int copy_device_async(void *dst, const void *src, size_t bytes, void *stream) {
    return (int)cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, (cudaStream_t)stream);
}
// cudaMemcpy2DAsync refuses a pitch above the device's memPitch, 2^31 - 1 bytes on every GPU
// so far (cudaDevAttrMaxPitch): a KV cache with more bytes than that per head (2^23 bf16
// tokens of 128) goes one row at a time, as does a single row (no pitch to check). A failure
// is returned and taken off the last error, as malloc_device's.
#define MAX_COPY_PITCH ((size_t)2147483647)
static int copy_2d_device_async(void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t width,
                                size_t rows, void *stream) {
    cudaError_t e = cudaSuccess;
    if (dst_pitch < width || src_pitch < width) return (int)cudaErrorInvalidPitchValue;
    if (rows == 1 || dst_pitch > MAX_COPY_PITCH || src_pitch > MAX_COPY_PITCH) {
        for (size_t r = 0; r < rows && e == cudaSuccess; r++)
            e = cudaMemcpyAsync((char *)dst + r * dst_pitch, (const char *)src + r * src_pitch, width,
                                cudaMemcpyDeviceToDevice, (cudaStream_t)stream);
    } else {
        e = cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, cudaMemcpyDeviceToDevice,
                              (cudaStream_t)stream);
    }
    if (e != cudaSuccess) (void)cudaGetLastError();
    return (int)e;
}
static int stream_synchronize(void *stream) { return (int)cudaStreamSynchronize((cudaStream_t)stream); }
static int synchronize(void) { return (int)cudaDeviceSynchronize(); }
static int event_create(void **e) { return (int)cudaEventCreate((cudaEvent_t *)e); }
static int event_destroy(void *e) { return (int)cudaEventDestroy((cudaEvent_t)e); }
static int event_record(void *e, void *stream) { return (int)cudaEventRecord((cudaEvent_t)e, (cudaStream_t)stream); }
static int event_elapsed_ms(float *ms, void *a, void *b) {
    return (int)cudaEventElapsedTime(ms, (cudaEvent_t)a, (cudaEvent_t)b);
}
static const char *error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

// CUDA graphs. Capture needs a stream other than the legacy default one; non-blocking, so it
// does not synchronise with work on the legacy stream either.
static int stream_create(void **stream) {
    return (int)cudaStreamCreateWithFlags((cudaStream_t *)stream, cudaStreamNonBlocking);
}
static int stream_destroy(void *stream) { return (int)cudaStreamDestroy((cudaStream_t)stream); }
// thread-local: other threads' CUDA calls are not affected by (nor break) this capture
static int capture_begin(void *stream) {
    return (int)cudaStreamBeginCapture((cudaStream_t)stream, cudaStreamCaptureModeThreadLocal);
}
// ends the capture and instantiates it: *graph = the executable graph, or NULL on failure
// (the captured graph itself is no longer needed either way)
static int capture_end(void *stream, void **graph) {
    cudaGraph_t captured = NULL;
    cudaGraphExec_t exec = NULL;
    cudaError_t e = cudaStreamEndCapture((cudaStream_t)stream, &captured);
    if (e == cudaSuccess) e = cudaGraphInstantiate(&exec, captured, 0);
    if (captured) cudaGraphDestroy(captured);
    *graph = e == cudaSuccess ? (void *)exec : NULL;
    return (int)e;
}
static int graph_launch(void *graph, void *stream) {
    return (int)cudaGraphLaunch((cudaGraphExec_t)graph, (cudaStream_t)stream);
}
static int graph_destroy(void *graph) { return (int)cudaGraphExecDestroy((cudaGraphExec_t)graph); }

#define CHECK(call)                          \
    do {                                     \
        const cudaError_t e_ = (call);       \
        if (e_ != cudaSuccess) {             \
            status = (int)e_;                \
            goto done;                       \
        }                                    \
    } while (0)

// ms per call of `call(ctx)`, queued `repeats` times between two events after one warm-up
static int time_calls(int (*call)(void *), void *ctx, int repeats, float *ms) {
    int status = 0;
    cudaEvent_t t0 = NULL, t1 = NULL;
    CHECK(cudaEventCreate(&t0));
    CHECK(cudaEventCreate(&t1));
    CHECK((cudaError_t)call(ctx));
    CHECK(cudaEventRecord(t0));
    for (int r = 0; r < repeats; r++) CHECK((cudaError_t)call(ctx));
    CHECK(cudaEventRecord(t1));
    CHECK(cudaEventSynchronize(t1));
    CHECK(cudaEventElapsedTime(ms, t0, t1));
    *ms /= (float)repeats;
done:
    if (t0) cudaEventDestroy(t0);
    if (t1) cudaEventDestroy(t1);
    return status;
}

typedef struct {
    void *dst;
    const void *src;
    size_t bytes;
} copy_args;

static int copy_call(void *p) {
    const copy_args *a = (const copy_args *)p;
    return (int)cudaMemcpyAsync(a->dst, a->src, a->bytes, cudaMemcpyDeviceToDevice);
}

static int time_copy(size_t bytes, int repeats, float *ms) {
    int status = 0;
    copy_args a = {NULL, NULL, bytes};
    void *src = NULL;
    CHECK(cudaMalloc(&a.dst, bytes));
    CHECK(cudaMalloc(&src, bytes));
    CHECK(cudaMemset(src, 1, bytes));
    a.src = src;
    status = time_calls(copy_call, &a, repeats, ms);
done:
    cudaFree(a.dst);
    cudaFree(src);
    return status;
}

typedef struct {
    float *y, *x;
    void *w;
    q3_dtype w_dt;
    int64_t T, N, K;
} matmul_args;

static int matmul_call(void *p) {
    const matmul_args *a = (const matmul_args *)p;
    return q3_matmul_cuda(a->y, a->x, a->w, a->w_dt, a->T, a->N, a->K, 0, NULL);
}

static int time_matmul(int64_t T, int64_t N, int64_t K, q3_dtype w_dt, int repeats, float *ms) {
    int status = 0;
    matmul_args a = {NULL, NULL, NULL, w_dt, T, N, K};
    const size_t wbytes = (size_t)(N * K) * q3_dtype_size(w_dt);
    CHECK(cudaMalloc(&a.w, wbytes));
    CHECK(cudaMalloc((void **)&a.x, (size_t)(T * K) * 4));
    CHECK(cudaMalloc((void **)&a.y, (size_t)(T * N) * 4));
    CHECK(cudaMemset(a.w, 0, wbytes));
    CHECK(cudaMemset(a.x, 0, (size_t)(T * K) * 4));
    status = time_calls(matmul_call, &a, repeats, ms);
done:
    cudaFree(a.w);
    cudaFree(a.x);
    cudaFree(a.y);
    return status;
}

extern "C" int q3_cuda_ops_get(q3_cuda_ops *ops) {
    ops->time_copy = time_copy;
    ops->time_matmul = time_matmul;
    ops->device_count = device_count;
    ops->set_device = set_device;
    ops->malloc_device = malloc_device;
    ops->free_device = free_device;
    ops->copy = copy;
    ops->copy_async = copy_async;
    ops->memset_async = memset_async;
    ops->copy_device_async = copy_device_async;
    ops->copy_2d_device_async = copy_2d_device_async;
    ops->stream_synchronize = stream_synchronize;
    ops->synchronize = synchronize;
    ops->event_create = event_create;
    ops->event_destroy = event_destroy;
    ops->event_record = event_record;
    ops->event_elapsed_ms = event_elapsed_ms;
    ops->blas_open = q3_blas_open;
    ops->blas_enable = q3_blas_enable;
    ops->blas_grouped_available = q3_blas_grouped_available;
    ops->blas_gemm_grouped = q3_blas_gemm_grouped_bf16;
    ops->error_string = error_string;
    ops->stream_create = stream_create;
    ops->stream_destroy = stream_destroy;
    ops->capture_begin = capture_begin;
    ops->capture_end = capture_end;
    ops->graph_launch = graph_launch;
    ops->graph_destroy = graph_destroy;
    ops->rmsnorm = q3_rmsnorm_cuda;
    ops->add_rmsnorm = q3_add_rmsnorm_cuda;
    ops->matmul = q3_matmul_cuda;
    ops->matmul_tc = q3_matmul_tc_cuda;
    ops->matmul_wmma = q3_matmul_wmma_cuda;
    ops->gate_up = q3_gate_up_cuda;
    ops->qk_rope_kv = q3_qk_rope_kv_cuda;
    ops->attention = q3_attention_cuda;
    ops->attention_probs = q3_attention_probs_cuda;
    ops->router_topk = q3_router_topk_cuda;
    ops->decode_prepare = q3_decode_prepare_cuda;
    ops->moe_route = q3_moe_route_cuda;
    ops->moe_gate_up = q3_moe_gate_up_cuda;
    ops->moe_down = q3_moe_down_cuda;
    ops->moe_combine = q3_moe_combine_cuda;
    ops->moe_gate_up_tc = q3_moe_gate_up_tc_cuda;
    ops->moe_down_tc = q3_moe_down_tc_cuda;
    ops->moe_combine_csr = q3_moe_combine_csr_cuda;
    ops->matmul_fp8 = q3_matmul_fp8_cuda;
    ops->fp8_dequant = q3_fp8_dequant_cuda;
    ops->moe_gate_up_fp8 = q3_moe_gate_up_fp8_cuda;
    ops->moe_down_fp8 = q3_moe_down_fp8_cuda;
    ops->matmul_int4 = q3_matmul_int4_cuda;
    ops->int4_dequant = q3_int4_dequant_cuda;
    ops->moe_gate_up_int4 = q3_moe_gate_up_int4_cuda;
    ops->moe_down_int4 = q3_moe_down_int4_cuda;
    ops->swiglu = q3_swiglu_cuda;
    ops->gather_rows = q3_gather_rows_cuda;
    ops->scatter_add_rows = q3_scatter_add_rows_cuda;
    ops->take_rows = q3_take_rows_cuda;
    ops->add_rows = q3_add_rows_cuda;
    ops->to_f32 = q3_to_f32_cuda;
    ops->from_f32 = q3_from_f32_cuda;
    return 0;
}

// The GPU targets this library holds code for, comma-separated as cuobjdump names them
// ("sm_80,...,sm_120,compute_120": SASS, then the PTX a later GPU compiles at load time).
// setup.py passes the list it builds the -gencode flags from; the SIMT executor's build of
// this file passes none. Read without initialising CUDA (q3.build_info()["cuda_targets"]).
#ifndef Q3_CUDA_TARGETS
#define Q3_CUDA_TARGETS ""
#endif
extern "C" const char *q3_cuda_targets(void) { return Q3_CUDA_TARGETS; }
