// y [T, N] (+)= x [T, K] W^T on tensor cores (WMMA, bf16 inputs, fp32 accumulation), for
// prefill: many tokens. Twin: kernels/cpu/matmul_tc.c (the CPU matmul on bf16-valued
// activations, as the AMX path). x is rounded to bf16 as transformers computes in bf16: as it
// is staged, for the WMMA kernel; into xb first, for cuBLAS. W [N, K] row-major is read in place as the
// column-major B = W^T operand. A block of 4 warps computes a 64 x 64 tile of y
// (wmma_tile.cuh), each warp 32 x 32 as 2 x 2 fragments of 16 x 16, from the 64 x 32 slices
// of x and W for each k step staged in shared memory. Each thread moves 4 float4 of x and 2
// uint4 of W a step (wmma_tile.cuh's fetch/stage), double buffered: the next slice is read
// into registers while the tensor cores work on the current one, so the loads of step k + 1
// are in flight during the MMAs of step k, and two shared buffers need one barrier a step.
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

// x_vec, w_vec: x and w are 16-byte aligned (then so is every staged group: K % 32 == 0)
__global__ void __launch_bounds__(WMMA_THREADS)
    matmul_tc_kernel(float *y, const float *x, const uint16_t *w, int64_t T, int64_t N, int64_t K, int accumulate,
                     int x_vec, int w_vec) {
    Q3_SHARED(staged_slice[2], xs);
    Q3_SHARED(staged_slice[2], ws);
    Q3_SHARED(float[4][16][16], out);
    const int warp = threadIdx.x >> 5;
    const int64_t t0 = (int64_t)blockIdx.y * TILE, n0 = (int64_t)blockIdx.x * TILE;
    const int wt = wmma_warp_row(), wn = wmma_warp_col(); // this warp's 32 x 32 within the tile
    const float *src[A_VECS]; // the thread's x rows, NULL past T (staged as zeros)
#pragma unroll
    for (int i = 0; i < A_VECS; i++) {
        const int64_t t = t0 + threadIdx.x / A_PER_ROW + A_STRIDE * i;
        src[i] = t < T ? x + t * K : NULL;
    }
    const int64_t a_col = threadIdx.x % A_PER_ROW * 4;
    wmma_acc acc[2][2];
    wmma_zero(acc);
    float4 av[A_VECS];
    uint4 wv[W_VECS];
    if (K > 0) {
        fetch_a(av, src, a_col, x_vec != 0);
        fetch_w(wv, w, n0, N, K, 0, w_vec != 0);
    }
    // step b: registers -> buffer b & 1, barrier, read step b + 1 into registers, multiply
    // buffer b & 1. That buffer was last read in step b - 2, which every warp finished
    // before the barrier of step b - 1: one barrier a step is enough.
    for (int64_t k0 = 0, b = 0; k0 < K; k0 += KSTEP, b++) {
        stage_a(xs[b & 1], av);
        stage_w(ws[b & 1], wv);
        if (!Q3_MUTANT(10)) __syncthreads();
        if (k0 + KSTEP < K) {
            fetch_a(av, src, k0 + KSTEP + a_col, x_vec != 0);
            fetch_w(wv, w, n0, N, K, k0 + KSTEP, w_vec != 0);
        }
        wmma_slice_mma(acc, xs[b & 1], ws[b & 1], wt, wn);
    }
    // through shared memory (out: not the staging buffers, so no barrier), to honour the
    // edges and `accumulate`
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
extern "C" int q3_blas_enable(int on);

static bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

// cuBLAS (kernels/cuda/blas.cu) on x rounded into xb when may_use_blas and it is open and on,
// else the WMMA kernel above on x itself
static int matmul_tc(float *y, const float *x, const void *w, int64_t T, int64_t N, int64_t K, int accumulate,
                     uint16_t *xb, int may_use_blas, cudaStream_t s) {
    if (N % 16 || K % KSTEP) return (int)cudaErrorInvalidValue;
    if (T == 0 || N == 0) return 0;
    if (may_use_blas && q3_blas_enable(-1)) { // x rounded only for cuBLAS
        const int64_t n = T * K, blocks = (n + 255) / 256;
        Q3_LAUNCH(round_bf16_kernel, (unsigned)(blocks < 65535 ? blocks : 65535), 256, 0, s)((__nv_bfloat16 *)xb, x, n);
        const int blas = q3_blas_gemm_bf16(y, xb, (const uint16_t *)w, T, N, K, accumulate, s);
        if (blas >= 0) return blas ? blas : q3_launch_status();
    }
    const dim3 grid((unsigned)((N + TILE - 1) / TILE), (unsigned)((T + TILE - 1) / TILE));
    Q3_LAUNCH(matmul_tc_kernel, grid, WMMA_THREADS, 0, s)(y, x, (const uint16_t *)w, T, N, K, accumulate, aligned16(x),
                                                   aligned16(w));
    return q3_launch_status();
}

// xb: T * K bf16 of device scratch
extern "C" int q3_matmul_tc_cuda(float *y, const float *x, const void *w, int64_t T, int64_t N, int64_t K,
                                 int accumulate, uint16_t *xb, void *stream) {
    return matmul_tc(y, x, w, T, N, K, accumulate, xb, 1, (cudaStream_t)stream);
}

// the same without cuBLAS, whose calls may allocate or query the device: this one only
// queues one kernel, so it can be captured in a CUDA graph
extern "C" int q3_matmul_wmma_cuda(float *y, const float *x, const void *w, int64_t T, int64_t N, int64_t K,
                                   int accumulate, uint16_t *xb, void *stream) {
    return matmul_tc(y, x, w, T, N, K, accumulate, xb, 0, (cudaStream_t)stream);
}
