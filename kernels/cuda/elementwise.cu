// Elementwise and row-movement kernels (twins: kernels/cpu/swiglu.c, rows.c, convert.c).
#include "common.cuh"

__global__ void swiglu_kernel(float *act, const float *gate, const float *up, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const float g = gate[i];
        act[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

extern "C" int q3_swiglu_cuda(float *act, const float *gate, const float *up, int64_t n, void *stream) {
    if (n == 0) return 0;
    const int64_t blocks = (n + 255) / 256;
    Q3_LAUNCH(swiglu_kernel, (unsigned)(blocks < 65535 ? blocks : 65535), 256, 0, (cudaStream_t)stream)(act, gate, up, n);
    return q3_launch_status();
}

// dst [n, H] <- src rows; one block per row
__global__ void gather_kernel(float *dst, const float *src, const int32_t *rows, int64_t H) {
    const float *s = src + (int64_t)rows[blockIdx.x] * H;
    float *d = dst + (int64_t)blockIdx.x * H;
    for (int64_t j = threadIdx.x; j < H; j += blockDim.x) d[j] = s[j];
}

extern "C" int q3_gather_rows_cuda(float *dst, const float *src, const int32_t *rows, int64_t n, int64_t H,
                                   void *stream) {
    if (n == 0) return 0;
    Q3_LAUNCH(gather_kernel, (unsigned)n, 256, 0, (cudaStream_t)stream)(dst, src, rows, H);
    return q3_launch_status();
}

// dst[rows[i]] += scale[i] * src[i]; rows distinct within a call, so no atomics
__global__ void scatter_add_kernel(float *dst, const float *src, const int32_t *rows, const float *scale, int64_t H) {
    float *d = dst + (int64_t)rows[blockIdx.x] * H;
    const float *s = src + (int64_t)blockIdx.x * H;
    const float a = scale[blockIdx.x];
    for (int64_t j = threadIdx.x; j < H; j += blockDim.x) d[j] += a * s[j];
}

extern "C" int q3_scatter_add_rows_cuda(float *dst, const float *src, const int32_t *rows, const float *scale,
                                        int64_t n, int64_t H, void *stream) {
    if (n == 0) return 0;
    Q3_LAUNCH(scatter_add_kernel, (unsigned)n, 256, 0, (cudaStream_t)stream)(dst, src, rows, scale, H);
    return q3_launch_status();
}

// dst [n, H] <- src rows of 2 or 4 bytes an element, moved as 16-bit units; one block per row
__global__ void take_rows_kernel(uint16_t *dst, const uint16_t *src, const int32_t *rows, int64_t units) {
    const uint16_t *s = src + (int64_t)rows[blockIdx.x] * units;
    uint16_t *d = dst + (int64_t)blockIdx.x * units;
    for (int64_t j = threadIdx.x; j < units; j += blockDim.x) d[j] = s[j];
}

extern "C" int q3_take_rows_cuda(void *dst, const void *src, q3_dtype dt, const int32_t *rows, int64_t n, int64_t H,
                                 void *stream) {
    if (n == 0) return 0;
    const int64_t units = Q3_MUTANT(13) ? H : H * (int64_t)q3_dtype_size(dt) / 2;
    Q3_LAUNCH(take_rows_kernel, (unsigned)n, 256, 0, (cudaStream_t)stream)((uint16_t *)dst, (const uint16_t *)src,
                                                                           rows, units);
    return q3_launch_status();
}

// dst[rows[i]] += src[i] (fp32, bf16 or fp16); rows distinct within a call (checked by the host
// side), so a block per part and no atomics
__global__ void add_rows_kernel(float *dst, const void *src, q3_dtype dt, const int32_t *rows, int64_t H) {
    float *d = dst + (int64_t)rows[blockIdx.x] * H;
    const int64_t first = (int64_t)blockIdx.x * H;
    for (int64_t j = threadIdx.x; j < H; j += blockDim.x) d[j] += q3_load(src, dt, first + j);
}

extern "C" int q3_add_rows_cuda(float *dst, const void *src, q3_dtype dt, const int32_t *rows, int64_t n, int64_t H,
                                void *stream) {
    if (n == 0) return 0;
    Q3_LAUNCH(add_rows_kernel, (unsigned)n, 256, 0, (cudaStream_t)stream)(dst, src, dt, rows, H);
    return q3_launch_status();
}

__global__ void to_f32_kernel(float *dst, const void *src, q3_dtype dt, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = q3_load(src, dt, i);
}

__global__ void from_f32_kernel(void *dst, q3_dtype dt, const float *src, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        q3_store(dst, dt, i, src[i]);
}

static unsigned grid_for(int64_t n) {
    const int64_t blocks = (n + 255) / 256;
    return (unsigned)(blocks < 65535 ? blocks : 65535);
}

// dst [n] fp32 <- src [n] of dtype dt
extern "C" int q3_to_f32_cuda(float *dst, const void *src, q3_dtype dt, int64_t n, void *stream) {
    if (n == 0) return 0;
    Q3_LAUNCH(to_f32_kernel, grid_for(n), 256, 0, (cudaStream_t)stream)(dst, src, dt, n);
    return q3_launch_status();
}

// dst [n] of dtype dt <- src [n] fp32 (bf16, fp16: round to nearest even)
extern "C" int q3_from_f32_cuda(void *dst, q3_dtype dt, const float *src, int64_t n, void *stream) {
    if (n == 0) return 0;
    Q3_LAUNCH(from_f32_kernel, grid_for(n), 256, 0, (cudaStream_t)stream)(dst, dt, src, n);
    return q3_launch_status();
}
