// RMSNorm on the GPU: one block per row (twin: kernels/cpu/rmsnorm.c).
#include "common.cuh"

__global__ void rmsnorm_kernel(float *out, const float *x, const void *w, q3_dtype w_dt, int64_t n, float eps) {
    const float *xr = x + blockIdx.x * n;
    float *o = out + blockIdx.x * n;
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    const float r = rsqrtf(q3_block_sum(ss) / (float)n + eps);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) o[i] = q3_load(w, w_dt, i) * (xr[i] * r);
}

// out [rows, n] <- x [rows, n], w [n]
extern "C" int q3_rmsnorm_cuda(float *out, const float *x, const void *w, q3_dtype w_dt, int64_t rows, int64_t n,
                               float eps, void *stream) {
    if (rows == 0) return 0;
    const int threads = n >= 1024 ? 1024 : (int)((n + 31) / 32 * 32);
    rmsnorm_kernel<<<(unsigned)rows, threads, 0, (cudaStream_t)stream>>>(out, x, w, w_dt, n, eps);
    return q3_launch_status();
}
