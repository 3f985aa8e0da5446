// y [T, N] (+)= x [T, K] W^T on tensor cores (WMMA, bf16 inputs, fp32 accumulation), for
// prefill: many tokens. Twin: kernels/cpu/matmul.c (on bf16-valued activations, as the AMX
// path). x is rounded to bf16 into xb first (as transformers computes in bf16); W [N, K]
// row-major is read in place as the column-major B = W^T operand. A block of 4 warps
// computes a 64 x 64 tile of y, each warp 32 x 32 as 2 x 2 fragments of 16 x 16, with the
// 64 x 32 slices of x and W for each k step staged in shared memory. Needs N % 16 == 0,
// K % 32 == 0 (every projection of the real geometry); the driver uses the GEMV otherwise.
// q3_matmul_tc_cuda hands the product to cuBLAS when it is on; q3_matmul_wmma_cuda never
// does (for work captured in a CUDA graph).
#include <cuda_bf16.h>
#include <mma.h>

#include "common.cuh"

using namespace nvcuda;

#define TILE 64
#define KSTEP 32

__global__ void round_bf16_kernel(__nv_bfloat16 *dst, const float *src, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(src[i]);
}

__global__ void matmul_tc_kernel(float *y, const __nv_bfloat16 *xb, const __nv_bfloat16 *w, int64_t T, int64_t N,
                                 int64_t K, int accumulate) {
    __shared__ __align__(32) __nv_bfloat16 xs[TILE][KSTEP + 8]; // +8: fewer bank conflicts
    __shared__ __align__(32) __nv_bfloat16 ws[TILE][KSTEP + 8];
    __shared__ __align__(32) float out[4][16][16];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t t0 = (int64_t)blockIdx.y * TILE, n0 = (int64_t)blockIdx.x * TILE;
    const int wt = (warp >> 1) * 32, wn = (warp & 1) * 32; // this warp's 32 x 32 within the tile
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) wmma::fill_fragment(acc[i][j], 0.0f);
    for (int64_t k0 = 0; k0 < K; k0 += KSTEP) {
        // stage x[t0 .. +64, k0 .. +32] and w[n0 .. +64, k0 .. +32], zero past T and N
        for (int e = threadIdx.x; e < TILE * KSTEP; e += blockDim.x) {
            const int r = e / KSTEP, c = e % KSTEP;
            xs[r][c] = t0 + r < T ? xb[(t0 + r) * K + k0 + c] : __float2bfloat16_rn(0.0f);
            ws[r][c] = n0 + r < N ? w[(n0 + r) * K + k0 + c] : __float2bfloat16_rn(0.0f);
        }
        __syncthreads();
        for (int kk = 0; kk < KSTEP; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b[2];
            for (int i = 0; i < 2; i++) wmma::load_matrix_sync(a[i], &xs[wt + 16 * i][kk], KSTEP + 8);
            for (int j = 0; j < 2; j++) wmma::load_matrix_sync(b[j], &ws[wn + 16 * j][kk], KSTEP + 8);
            for (int i = 0; i < 2; i++)
                for (int j = 0; j < 2; j++) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
    // through shared memory, to honour the edges and `accumulate`
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) {
            wmma::store_matrix_sync(&out[warp][0][0], acc[i][j], 16, wmma::mem_row_major);
            __syncwarp();
            for (int e = lane; e < 256; e += 32) {
                const int64_t t = t0 + wt + 16 * i + e / 16, n = n0 + wn + 16 * j + e % 16;
                if (t < T && n < N) {
                    float *dst = y + t * N + n;
                    *dst = accumulate ? *dst + out[warp][e / 16][e % 16] : out[warp][e / 16][e % 16];
                }
            }
            __syncwarp();
        }
}

extern "C" int q3_blas_gemm_bf16(float *y, const uint16_t *xb, const uint16_t *w, int64_t T, int64_t N, int64_t K,
                                 int accumulate, void *stream);

// x rounded into xb, then the product: cuBLAS (kernels/cuda/blas.cu) when may_use_blas and it
// is open and on, else the WMMA kernel above
static int matmul_tc(float *y, const float *x, const void *w, int64_t T, int64_t N, int64_t K, int accumulate,
                     uint16_t *xb, int may_use_blas, cudaStream_t s) {
    if (N % 16 || K % KSTEP) return (int)cudaErrorInvalidValue;
    if (T == 0 || N == 0) return 0;
    const int64_t n = T * K, blocks = (n + 255) / 256;
    round_bf16_kernel<<<(unsigned)(blocks < 65535 ? blocks : 65535), 256, 0, s>>>((__nv_bfloat16 *)xb, x, n);
    if (may_use_blas) {
        const int blas = q3_blas_gemm_bf16(y, xb, (const uint16_t *)w, T, N, K, accumulate, s);
        if (blas >= 0) return blas ? blas : q3_launch_status();
    }
    const dim3 grid((unsigned)((N + TILE - 1) / TILE), (unsigned)((T + TILE - 1) / TILE));
    matmul_tc_kernel<<<grid, 128, 0, s>>>(y, (const __nv_bfloat16 *)xb, (const __nv_bfloat16 *)w, T, N, K, accumulate);
    return q3_launch_status();
}

// xb: T * K bf16 of device scratch
extern "C" int q3_matmul_tc_cuda(float *y, const float *x, const void *w, int64_t T, int64_t N, int64_t K,
                                 int accumulate, uint16_t *xb, void *stream) {
    return matmul_tc(y, x, w, T, N, K, accumulate, xb, 1, (cudaStream_t)stream);
}

// the same without cuBLAS, whose calls may allocate or query the device: this one only
// queues two kernels, so it can be captured in a CUDA graph
extern "C" int q3_matmul_wmma_cuda(float *y, const float *x, const void *w, int64_t T, int64_t N, int64_t K,
                                   int accumulate, uint16_t *xb, void *stream) {
    return matmul_tc(y, x, w, T, N, K, accumulate, xb, 0, (cudaStream_t)stream);
}
