// y [T, N] (+)= x [T, K] W^T on tensor cores (WMMA, bf16 inputs, fp32 accumulation), for
// prefill: many tokens. Twin: kernels/cpu/matmul.c (on bf16-valued activations, as the AMX
// path). x is rounded to bf16 into xb first (as transformers computes in bf16); W [N, K]
// row-major is read in place as the column-major B = W^T operand. A block of 4 warps
// computes a 64 x 64 tile of y (wmma_tile.cuh), each warp 32 x 32 as 2 x 2 fragments of
// 16 x 16, with the 64 x 32 slices of x and W for each k step staged in shared memory.
// Needs N % 16 == 0, K % 32 == 0 (every projection of the real geometry); the driver uses
// the GEMV otherwise. q3_matmul_tc_cuda hands the product to cuBLAS when it is on;
// q3_matmul_wmma_cuda never does (for work captured in a CUDA graph).
#include "wmma_tile.cuh"

#define TILE WMMA_TILE
#define KSTEP WMMA_KSTEP

__global__ void round_bf16_kernel(__nv_bfloat16 *dst, const float *src, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(src[i]);
}

__global__ void matmul_tc_kernel(float *y, const __nv_bfloat16 *xb, const __nv_bfloat16 *w, int64_t T, int64_t N,
                                 int64_t K, int accumulate) {
    Q3_SHARED(__nv_bfloat16[TILE][WMMA_LD], xs);
    Q3_SHARED(__nv_bfloat16[TILE][WMMA_LD], ws);
    Q3_SHARED(float[4][16][16], out);
    const int warp = threadIdx.x >> 5;
    const int64_t t0 = (int64_t)blockIdx.y * TILE, n0 = (int64_t)blockIdx.x * TILE;
    const int wt = wmma_warp_row(), wn = wmma_warp_col(); // this warp's 32 x 32 within the tile
    wmma_acc acc[2][2];
    wmma_zero(acc);
    for (int64_t k0 = 0; k0 < K; k0 += KSTEP) {
        // stage x[t0 .. +64, k0 .. +32] and w[n0 .. +64, k0 .. +32], zero past T and N
        for (int e = threadIdx.x; e < TILE * KSTEP; e += blockDim.x) {
            const int r = e / KSTEP, c = e % KSTEP;
            xs[r][c] = t0 + r < T ? xb[(t0 + r) * K + k0 + c] : __float2bfloat16_rn(0.0f);
            ws[r][c] = n0 + r < N ? w[(n0 + r) * K + k0 + c] : __float2bfloat16_rn(0.0f);
        }
        __syncthreads();
        wmma_slice_mma(acc, xs, ws, wt, wn);
        if (!Q3_MUTANT(10)) __syncthreads();
    }
    // through shared memory, to honour the edges and `accumulate`
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int64_t t = t0 + wt + 16 * i, n = n0 + wn + 16 * j;
            wmma_store(y + t * N + n, N, T - t, N - n, acc[i][j], out[warp + Q3_MUTANT(4)], accumulate);
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
    Q3_LAUNCH(round_bf16_kernel, (unsigned)(blocks < 65535 ? blocks : 65535), 256, 0, s)((__nv_bfloat16 *)xb, x, n);
    if (may_use_blas) {
        const int blas = q3_blas_gemm_bf16(y, xb, (const uint16_t *)w, T, N, K, accumulate, s);
        if (blas >= 0) return blas ? blas : q3_launch_status();
    }
    const dim3 grid((unsigned)((N + TILE - 1) / TILE), (unsigned)((T + TILE - 1) / TILE));
    Q3_LAUNCH(matmul_tc_kernel, grid, WMMA_THREADS, 0, s)(y, (const __nv_bfloat16 *)xb, (const __nv_bfloat16 *)w, T, N, K,
                                                   accumulate);
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
