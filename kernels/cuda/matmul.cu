// y [T, N] (+)= x [T, K] W^T, W [N, K] fp32 or bf16, fp32 accumulation (twin: kernels/cpu/matmul.c).
// One warp per weight row, all of a block column's tokens at once (row_dots.cuh: 16-byte
// loads of 8 bf16 a lane and of 4 activations; fp32 weights or K % 8 != 0 one element a
// lane): NT, the tokens a block column takes, is the smallest of 8, 16, 32, 64 that holds T,
// so for every decode batch of up to 64 rows each weight byte is read once per call (64+
// tokens: block columns of 64, each re-reading the weights). The driver sends decode passes
// here up to GEMV_MAX_ROWS rows (csrc/cuda/passes.c) and prefill-sized products to the
// tensor cores (matmul_tc.cu).
//
// Why a register-blocked GEMV and not the tensor cores for decode: at T rows a weight row's
// 2K bytes (bf16) carry T * K multiply-adds, and the x rows come from L1 (32 bytes per token
// per 16-byte weight load). Per H200 SM, 4.3 TB/s / 132 is ~16 bytes a cycle of HBM against
// 128 bytes a cycle of L1 and 128 fp32 FMA a cycle: for T <= 16 the weights stay the bound,
// beyond that L1 (T / 4 of the HBM time at one weight row a warp) and the FMA rate take over,
// and 64 rows is about 4x the weight time: about where the WMMA GEMM (matmul_tc.cu, bf16
// activations, 64-row tiles) is as good, and where decode batches end.
#include "row_dots.cuh"

#define GEMV_WARPS 8

// block (b, c): weight rows b * GEMV_WARPS + warp, tokens c * NT .. + NT
template <int NT>
__global__ void __launch_bounds__(GEMV_WARPS * 32, 2)
    gemv_kernel(float *y, const float *x, const void *w, q3_dtype w_dt, int64_t T, int64_t N, int64_t K,
                int accumulate) {
    const int lane = threadIdx.x & 31;
    const int64_t row = (int64_t)blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    const int64_t t0 = (int64_t)blockIdx.y * NT;
    if (row >= N) return;
    const int nt = T - t0 < NT ? (int)(T - t0) : NT;
    float acc[1][NT] = {{0}};
    const void *ws[1] = {w};
    row_dots<NT, 1>(acc, x + t0 * K, NULL, ws, w_dt, row, K, nt, lane);
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t >= nt) break;
        const float s = q3_warp_sum(acc[0][t]);
        if (lane == 0) {
            float *dst = y + (t0 + t) * N + row;
            *dst = accumulate ? *dst + s : s;
        }
    }
}

// act [T, I] = silu(x G^T) * (x U^T): an expert's gate and up rows streamed together, each
// activation load serving both, the activation written once (twin: matmul, matmul, swiglu)
template <int NT>
__global__ void __launch_bounds__(GEMV_WARPS * 32, 2)
    gate_up_kernel(float *act, const float *x, const void *gate, const void *up, q3_dtype w_dt, int64_t T, int64_t I,
                   int64_t K) {
    const int lane = threadIdx.x & 31;
    const int64_t row = (int64_t)blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    const int64_t t0 = (int64_t)blockIdx.y * NT;
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

// the grid: weight rows in blocks of GEMV_WARPS by tokens in columns of nt
static dim3 gemv_grid(int64_t rows, int64_t T, int nt) {
    return dim3((unsigned)((rows + GEMV_WARPS - 1) / GEMV_WARPS), (unsigned)((T + nt - 1) / nt));
}

// the gate and up matrices together: 2 * NT accumulators, so at most 16 tokens a block column
extern "C" int q3_gate_up_cuda(float *act, const float *x, const void *gate, const void *up, q3_dtype w_dt,
                               int64_t T, int64_t I, int64_t K, void *stream) {
    if (T == 0 || I == 0) return 0;
    const cudaStream_t s = (cudaStream_t)stream;
    if (T <= 8) Q3_LAUNCH(gate_up_kernel<8>, gemv_grid(I, T, 8), GEMV_WARPS * 32, 0, s)(act, x, gate, up, w_dt, T, I, K);
    else Q3_LAUNCH(gate_up_kernel<16>, gemv_grid(I, T, 16), GEMV_WARPS * 32, 0, s)(act, x, gate, up, w_dt, T, I, K);
    return q3_launch_status();
}

extern "C" int q3_matmul_cuda(float *y, const float *x, const void *w, q3_dtype w_dt, int64_t T, int64_t N, int64_t K,
                              int accumulate, void *stream) {
    if (T == 0 || N == 0) return 0;
    const cudaStream_t s = (cudaStream_t)stream;
    const int threads = GEMV_WARPS * 32;
    if (T <= 8) Q3_LAUNCH(gemv_kernel<8>, gemv_grid(N, T, 8), threads, 0, s)(y, x, w, w_dt, T, N, K, accumulate);
    else if (T <= 16) Q3_LAUNCH(gemv_kernel<16>, gemv_grid(N, T, 16), threads, 0, s)(y, x, w, w_dt, T, N, K, accumulate);
    else if (T <= 32) Q3_LAUNCH(gemv_kernel<32>, gemv_grid(N, T, 32), threads, 0, s)(y, x, w, w_dt, T, N, K, accumulate);
    else Q3_LAUNCH(gemv_kernel<64>, gemv_grid(N, T, 64), threads, 0, s)(y, x, w, w_dt, T, N, K, accumulate);
    return q3_launch_status();
}
