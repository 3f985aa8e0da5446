// y [T, N] (+)= x [T, K] W^T, W [N, K] fp32, bf16 or fp16, fp32 accumulation (twin: kernels/cpu/matmul.c).
// One warp per weight row (two for wide matrices, N >= GEMV_WIDE_ROWS), the tokens of a block
// column at once (row_dots.cuh: 16-byte loads of 8 bf16 or fp16 a lane and two of 4 activations a
// token; fp32 weights or K % 8 != 0 one element a lane). A block column holds NT = 8 tokens
// (T <= 8) or 16; the column blocks of one group of weight rows are consecutive in the grid
// (block = row group * columns + column), so they run at the same time and a decode batch of
// up to 64 rows reads each weight byte from HBM once: the first column's loads bring it in, the
// others (at most 3) find it in L2. The driver sends decode passes here up to GEMV_MAX_ROWS
// rows (csrc/cuda/passes.c) and prefill-sized products to the tensor cores (matmul_tc.cu).
//
// The traffic, per H200 SM (4.3 TB/s / 132 SMs / 1.98 GHz: ~16 bytes of HBM a cycle, against
// 128 bytes of L1 and 128 fp32 FMAs a cycle): a weight row is 2K bytes (bf16) and carries
// T * K multiply-adds, whose activations come from L1, 32 bytes per token per 16-byte weight
// load, shared by the NW rows a warp holds: 2 * T / NW bytes of L1 per byte of weights. The
// weights stay the bound while that is <= 8 (T <= 4 at one row a warp, 8 at two); at 16 rows
// L1 costs 2-4x the weight time, at 64 rows ~16x. The WMMA GEMM would do better there on
// wide matrices, but its 64-row tiles give a narrow one (k_proj, v_proj: N = 512) 8 blocks
// for 132 SMs, which this kernel's warps a row do not suffer; GEMV_MAX_ROWS is the one
// number to set from a GPU run. The accumulators, NW * NT registers, are at most 32: with 32
// or 64 of them the sm_100 and sm_120 compilers spill at the 128 registers that 2 blocks of
// 256 threads an SM allow (benchmarks/sass_check.py).
#include "row_dots.cuh"

#define GEMV_WARPS 8
#define GEMV_WIDE_ROWS 4096 // from this many weight rows, 2 rows a warp (up to 32 tokens)

// block b * cols + c (cols = ceil(T / NT)): weight rows (b * GEMV_WARPS + warp) * NW .. + NW,
// tokens c * NT .. + NT.
// NW = 2 rows a warp halves the activation traffic from L1 per weight byte (each x load
// serves both rows) at the cost of half the warps, so it is taken only for wide matrices
// (q_proj, o_proj of the real geometry), where half the warps still fill the GPU.
template <int NT, int NW>
__device__ __forceinline__ void gemv(float *y, const float *x, const void *w, q3_dtype w_dt, int64_t T, int64_t N,
                                     int64_t K, int accumulate) {
    const int lane = threadIdx.x & 31;
    const int64_t cols = (T + NT - 1) / NT;
    const int64_t row0 = ((int64_t)blockIdx.x / cols * GEMV_WARPS + (threadIdx.x >> 5)) * NW;
    const int64_t t0 = (int64_t)blockIdx.x % cols * NT;
    if (row0 >= N) return;
    const int nt = T - t0 < NT ? (int)(T - t0) : NT;
    const void *ws[NW]; // the warp's rows; past N, the last row again (its sums are not stored)
#pragma unroll
    for (int j = 0; j < NW; j++)
        ws[j] = (const char *)w + (row0 + j < N ? row0 + j : N - 1) * K * (int64_t)q3_dtype_size(w_dt);
    float acc[NW][NT] = {{0}};
    row_dots<NT, NW>(acc, x + t0 * K, NULL, ws, w_dt, 0, K, nt, lane);
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t >= nt) break;
#pragma unroll
        for (int j = 0; j < NW; j++) {
            const float s = q3_warp_sum(acc[j][t]);
            if (lane == 0 && row0 + j < N) {
                float *dst = y + (t0 + t) * N + row0 + j;
                *dst = accumulate ? *dst + s : s;
            }
        }
    }
}

template <int NT>
__global__ void __launch_bounds__(GEMV_WARPS * 32, 2)
    gemv_kernel(float *y, const float *x, const void *w, q3_dtype w_dt, int64_t T, int64_t N, int64_t K,
                int accumulate) {
    gemv<NT, 1>(y, x, w, w_dt, T, N, K, accumulate);
}

template <int NT>
__global__ void __launch_bounds__(GEMV_WARPS * 32, 2)
    gemv_pairs_kernel(float *y, const float *x, const void *w, q3_dtype w_dt, int64_t T, int64_t N, int64_t K,
                      int accumulate) {
    gemv<NT, 2>(y, x, w, w_dt, T, N, K, accumulate);
}

// act [T, I] = silu(x G^T) * (x U^T): an expert's gate and up rows streamed together, each
// activation load serving both, the activation written once (twin: matmul, matmul, swiglu)
template <int NT>
__global__ void __launch_bounds__(GEMV_WARPS * 32, 2)
    gate_up_kernel(float *act, const float *x, const void *gate, const void *up, q3_dtype w_dt, int64_t T, int64_t I,
                   int64_t K) {
    const int lane = threadIdx.x & 31;
    const int64_t cols = (T + NT - 1) / NT;
    const int64_t row = (int64_t)blockIdx.x / cols * GEMV_WARPS + (threadIdx.x >> 5);
    const int64_t t0 = (int64_t)blockIdx.x % cols * NT;
    if (row >= I) return;
    const int nt = T - t0 < NT ? (int)(T - t0) : NT;
    float acc[2][NT] = {{0}};
    const void *ws[2] = {gate, up};
    row_dots<NT, 2>(acc, x + t0 * K, NULL, ws, w_dt, row, K, nt, lane);
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t >= nt) break;
        const float gs = q3_warp_sum(acc[0][t]), us = q3_warp_sum(acc[1][t]);
        if (lane == 0) act[(t0 + t) * I + row] = gs / (1.0f + expf(-gs)) * us;
    }
}

// the grid: groups of GEMV_WARPS * nw weight rows (nw a warp), each as ceil(T / nt) consecutive
// blocks of nt tokens; 0 where the count passes what a grid takes (the launch then fails)
static unsigned gemv_grid(int64_t rows, int nw, int64_t T, int nt) {
    const int64_t blocks = (rows + GEMV_WARPS * nw - 1) / (GEMV_WARPS * nw) * ((T + nt - 1) / nt);
    return blocks <= INT32_MAX ? (unsigned)blocks : 0u;
}

// the gate and up matrices together: 2 * NT accumulators, so at most 16 tokens a block column
extern "C" int q3_gate_up_cuda(float *act, const float *x, const void *gate, const void *up, q3_dtype w_dt,
                               int64_t T, int64_t I, int64_t K, void *stream) {
    if (T == 0 || I == 0) return 0;
    const cudaStream_t s = (cudaStream_t)stream;
    const int threads = GEMV_WARPS * 32;
    if (T <= 8) Q3_LAUNCH(gate_up_kernel<8>, gemv_grid(I, 1, T, 8), threads, 0, s)(act, x, gate, up, w_dt, T, I, K);
    else Q3_LAUNCH(gate_up_kernel<16>, gemv_grid(I, 1, T, 16), threads, 0, s)(act, x, gate, up, w_dt, T, I, K);
    return q3_launch_status();
}

// NT tokens a block column; gemv_kernel takes 1 weight row a warp, gemv_pairs_kernel 2
#define LAUNCH_GEMV(kernel, NT, NW)                                                                       \
    Q3_LAUNCH(kernel<NT>, gemv_grid(N, NW, T, NT), GEMV_WARPS * 32, 0, (cudaStream_t)stream)(y, x, w, w_dt, T, N, \
                                                                                           K, accumulate)

extern "C" int q3_matmul_cuda(float *y, const float *x, const void *w, q3_dtype w_dt, int64_t T, int64_t N, int64_t K,
                              int accumulate, void *stream) {
    if (T == 0 || N == 0) return 0;
    const bool wide = N >= GEMV_WIDE_ROWS;
    if (T <= 8 && wide) LAUNCH_GEMV(gemv_pairs_kernel, 8, 2);
    else if (T <= 8) LAUNCH_GEMV(gemv_kernel, 8, 1);
    else if (wide) LAUNCH_GEMV(gemv_pairs_kernel, 16, 2);
    else LAUNCH_GEMV(gemv_kernel, 16, 1);
    return q3_launch_status();
}
