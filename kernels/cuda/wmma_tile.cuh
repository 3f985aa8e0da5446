// The tensor-core tile shared by the WMMA GEMMs (matmul_tc.cu, moe_prefill.cu): a block of
// 4 warps computes a 64 x 64 tile of an fp32 output [rows, N], each warp 32 x 32 as 2 x 2
// fragments of 16 x 16 (bf16 inputs, fp32 accumulation), from 64 x 32 slices of A (the
// rows) and of W [N, K] staged in shared memory as bf16 [64][WMMA_LD]; W row-major is read
// in place as the column-major B = W^T operand. This header holds the staging of a slice
// (global -> registers in 16-byte loads, then registers -> shared, so that a kernel can
// fetch slice k + 1 while the tensor cores work on slice k), the product of one staged pair
// and the edge-aware store of the results.
#ifndef Q3_KERNELS_CUDA_WMMA_TILE_CUH
#define Q3_KERNELS_CUDA_WMMA_TILE_CUH

#include <cuda_bf16.h>
#include <mma.h>

#include "common.cuh"

#define WMMA_TILE 64
#define WMMA_KSTEP 32
#define WMMA_LD (WMMA_KSTEP + 8) // the staged rows' stride in elements: +8, fewer bank conflicts
#define WMMA_THREADS 128         // 4 warps

typedef nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> wmma_acc;

// this warp's 32 x 32 within the tile: its first row and first column
__device__ __forceinline__ int wmma_warp_row(void) { return (threadIdx.x >> 6) * 32; }
__device__ __forceinline__ int wmma_warp_col(void) { return ((threadIdx.x >> 5) & 1) * 32; }

__device__ __forceinline__ void wmma_zero(wmma_acc acc[2][2]) {
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) nvcuda::wmma::fill_fragment(acc[i][j], 0.0f);
}

// a slice is 64 rows x 32 columns; each thread moves A_VECS float4 of A and W_VECS uint4
// (8 bf16) of each weight, rows threadIdx.x / A_PER_ROW + A_STRIDE * i (resp. W_*)
#define A_PER_ROW (WMMA_KSTEP / 4)
#define A_STRIDE (WMMA_THREADS / A_PER_ROW)
#define A_VECS (WMMA_TILE / A_STRIDE)
#define W_PER_ROW (WMMA_KSTEP / 8)
#define W_STRIDE (WMMA_THREADS / W_PER_ROW)
#define W_VECS (WMMA_TILE / W_STRIDE)
typedef __nv_bfloat16 staged_slice[WMMA_TILE][WMMA_LD];

// the thread's share of an A slice, columns k .. k + 3 of its rows; src[i]: the row's start,
// NULL past the tile's rows (zeros). vec: the rows are 16-byte aligned
__device__ __forceinline__ void fetch_a(float4 *v, const float *const *src, int64_t k, bool vec) {
#pragma unroll
    for (int i = 0; i < A_VECS; i++) {
        const float *p = src[i];
        if (!p) v[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        else if (vec) v[i] = *(const float4 *)(p + k);
        else v[i] = make_float4(p[k], p[k + 1], p[k + 2], p[k + 3]);
    }
}

// ... rounded to bf16 into the staged slice
__device__ __forceinline__ void stage_a(staged_slice s, const float4 *v) {
    const int col = threadIdx.x % A_PER_ROW * 4;
#pragma unroll
    for (int i = 0; i < A_VECS; i++) {
        __nv_bfloat162 *d = (__nv_bfloat162 *)&s[threadIdx.x / A_PER_ROW + A_STRIDE * i][col];
        d[0] = __floats2bfloat162_rn(v[i].x, v[i].y);
        d[1] = __floats2bfloat162_rn(v[i].z, v[i].w);
    }
}

// the thread's share of the slice w [n0 .. +64, k0 .. +32] of bf16 w [N, K], as raw 16-byte
// groups of 8; zeros past N. vec: w is 16-byte aligned (then so is every group: K % 32 == 0)
__device__ __forceinline__ void fetch_w(uint4 *v, const uint16_t *w, int64_t n0, int64_t N, int64_t K, int64_t k0,
                                        bool vec) {
#pragma unroll
    for (int i = 0; i < W_VECS; i++) {
        const int64_t n = n0 + threadIdx.x / W_PER_ROW + W_STRIDE * i;
        if (n >= N) {
            v[i] = make_uint4(0u, 0u, 0u, 0u);
            continue;
        }
        const uint16_t *p = w + n * K + k0 + threadIdx.x % W_PER_ROW * 8;
        if (vec) v[i] = *(const uint4 *)p;
        else
            v[i] = make_uint4(p[0] | (uint32_t)p[1] << 16, p[2] | (uint32_t)p[3] << 16, p[4] | (uint32_t)p[5] << 16,
                              p[6] | (uint32_t)p[7] << 16);
    }
}

__device__ __forceinline__ void stage_w(staged_slice s, const uint4 *v) {
#pragma unroll
    for (int i = 0; i < W_VECS; i++)
        *(uint4 *)&s[threadIdx.x / W_PER_ROW + W_STRIDE * i][threadIdx.x % W_PER_ROW * 8] = v[i];
}

// acc += a[wr .. +32, :KSTEP] b[wc .. +32, :KSTEP]^T, from one staged pair of slices
__device__ __forceinline__ void wmma_slice_mma(wmma_acc acc[2][2], const __nv_bfloat16 (*a)[WMMA_LD],
                                               const __nv_bfloat16 (*b)[WMMA_LD], int wr, int wc) {
    using namespace nvcuda;
#pragma unroll
    for (int kk = 0; kk < WMMA_KSTEP; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb[2];
#pragma unroll
        for (int i = 0; i < 2; i++) wmma::load_matrix_sync(fa[i], &a[wr + 16 * i][kk], WMMA_LD);
#pragma unroll
        for (int j = 0; j < 2; j++) wmma::load_matrix_sync(fb[j], &b[wc + 16 * j][kk], WMMA_LD);
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 2; j++) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
}

// the first `rows` rows and `cols` columns of a 16 x 16 fragment into the row-major fp32
// matrix at dst (row stride ld), added to what is there when `accumulate`; nothing when
// either is <= 0 (warp-uniform). Through the warp's stash [16][16] of shared memory, so the
// edges are honoured and dst needs no alignment.
__device__ __forceinline__ void wmma_store(float *dst, int64_t ld, int64_t rows, int64_t cols, const wmma_acc &frag,
                                           float (*stash)[16], int accumulate) {
    if (rows <= 0 || cols <= 0) return;
    nvcuda::wmma::store_matrix_sync(&stash[0][0], frag, 16, nvcuda::wmma::mem_row_major);
    __syncwarp();
    for (int e = threadIdx.x & 31; e < 256; e += 32) {
        const int r = e / 16, c = e % 16;
        if (r < rows && c < cols) {
            float *d = dst + r * ld + c;
            *d = accumulate ? *d + stash[r][c] : stash[r][c];
        }
    }
    __syncwarp();
}

#endif
