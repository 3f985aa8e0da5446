// RMSNorm on the GPU: one block per row (twin: kernels/cpu/rmsnorm.c), and the residual add
// fused in front of it (twin: q3_add_rmsnorm_host, kernels/cpu/rmsnorm.c).
#include "common.cuh"

// Threads a row, at most: 512 leaves registers for 2 blocks per SM on every target at up to
// 64 registers a thread (sm_120 holds 1536 threads and 64K registers an SM; 1024-thread blocks
// of 34 registers fit once there). A row of 4096 gives each thread 8 elements a pass.
// benchmarks/sass_check.py's table records this block size (tests/tools/test_sass_check.py reads it).
#define RMSNORM_THREADS 512

// o [n] = w * (x * rsqrt(mean(x^2) + eps)), given this thread's share ss of sum(x^2); the
// threads stride the row as in the pass that produced ss
__device__ __forceinline__ void norm_row(float *o, const float *xr, const void *w, q3_dtype w_dt, int64_t n,
                                         float ss, float eps) {
    const float r = rsqrtf(q3_block_sum(ss) / (float)n + eps);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) o[i] = q3_load(w, w_dt, i) * (xr[i] * r);
}

__global__ void __launch_bounds__(RMSNORM_THREADS)
    rmsnorm_kernel(float *out, const float *x, const void *w, q3_dtype w_dt, int64_t n, float eps) {
    const float *xr = x + blockIdx.x * n;
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    norm_row(out + blockIdx.x * n, xr, w, w_dt, n, ss, eps);
}

// x += r, then out = rmsnorm(x). out may alias r: each thread reads r[i] in the first pass
// and writes out[i] in the second, for the same indices i, and no other thread touches them.
__global__ void __launch_bounds__(RMSNORM_THREADS)
    add_rmsnorm_kernel(float *out, float *x, const float *r, const void *w, q3_dtype w_dt, int64_t n, float eps) {
    float *xr = x + blockIdx.x * n;
    const float *rr = r + blockIdx.x * n;
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = xr[i] + rr[i];
        xr[i] = v;
        ss += v * v;
    }
    norm_row(out + blockIdx.x * n, xr, w, w_dt, n, ss, eps);
}

static int threads_for(int64_t n) { return n >= RMSNORM_THREADS ? RMSNORM_THREADS : (int)((n + 31) / 32 * 32); }

// out [rows, n] <- x [rows, n], w [n]
extern "C" int q3_rmsnorm_cuda(float *out, const float *x, const void *w, q3_dtype w_dt, int64_t rows, int64_t n,
                               float eps, void *stream) {
    if (rows == 0 || n == 0) return 0;
    Q3_LAUNCH(rmsnorm_kernel, (unsigned)rows, threads_for(n), 0, (cudaStream_t)stream)(out, x, w, w_dt, n, eps);
    return q3_launch_status();
}

// x [rows, n] += r [rows, n]; out [rows, n] <- rmsnorm(x) with w [n]
extern "C" int q3_add_rmsnorm_cuda(float *out, float *x, const float *r, const void *w, q3_dtype w_dt, int64_t rows,
                                   int64_t n, float eps, void *stream) {
    if (rows == 0 || n == 0) return 0;
    Q3_LAUNCH(add_rmsnorm_kernel, (unsigned)rows, threads_for(n), 0, (cudaStream_t)stream)(out, x, r, w, w_dt, n, eps);
    return q3_launch_status();
}
