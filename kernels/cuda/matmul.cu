// y [T, N] (+)= x [T, K] W^T, W [N, K] fp32 or bf16, fp32 accumulation (twin: kernels/cpu/matmul.c).
// One warp per (weight row, group of up to 8 tokens): the row is streamed once per group
// (row_dots.cuh: 16-byte loads of 8 bf16 a lane; fp32 weights one element a lane); the
// tokens' x rows come from L1/L2. For decode (T <= 8) every weight byte is read once;
// prefill goes to tensor cores (matmul_tc.cu).
#include "row_dots.cuh"

__global__ void gemv_kernel(float *y, const float *x, const void *w, q3_dtype w_dt, int64_t T, int64_t N,
                            int64_t K, int accumulate) {
    const int lane = threadIdx.x & 31;
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int64_t t0 = (int64_t)blockIdx.y * TOKENS_PER_WARP;
    if (row >= N) return;
    const int nt = T - t0 < TOKENS_PER_WARP ? (int)(T - t0) : TOKENS_PER_WARP;
    float acc[TOKENS_PER_WARP] = {0};
    row_dots(acc, x, NULL, w, w_dt, row, K, t0, nt, lane);
#pragma unroll
    for (int t = 0; t < TOKENS_PER_WARP; t++) {
        if (t >= nt) break;
        const float s = q3_warp_sum(acc[t]);
        if (lane == 0) {
            float *dst = y + (t0 + t) * N + row;
            *dst = accumulate ? *dst + s : s;
        }
    }
}

// act [T, I] = silu(x G^T) * (x U^T): an expert's gate and up rows streamed together, the
// activation written once (twin: matmul, matmul, swiglu)
__global__ void gate_up_kernel(float *act, const float *x, const void *gate, const void *up, q3_dtype w_dt,
                               int64_t T, int64_t I, int64_t K) {
    const int lane = threadIdx.x & 31;
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int64_t t0 = (int64_t)blockIdx.y * TOKENS_PER_WARP;
    if (row >= I) return;
    const int nt = T - t0 < TOKENS_PER_WARP ? (int)(T - t0) : TOKENS_PER_WARP;
    float g[TOKENS_PER_WARP] = {0}, u[TOKENS_PER_WARP] = {0};
    row_dots(g, x, NULL, gate, w_dt, row, K, t0, nt, lane);
    row_dots(u, x, NULL, up, w_dt, row, K, t0, nt, lane);
#pragma unroll
    for (int t = 0; t < TOKENS_PER_WARP; t++) {
        if (t >= nt) break;
        const float gs = q3_warp_sum(g[t]), us = q3_warp_sum(u[t]);
        if (lane == 0) act[(t0 + t) * I + row] = gs / (1.0f + expf(-gs)) * us;
    }
}

extern "C" int q3_gate_up_cuda(float *act, const float *x, const void *gate, const void *up, q3_dtype w_dt,
                               int64_t T, int64_t I, int64_t K, void *stream) {
    if (T == 0 || I == 0) return 0;
    const int warps = 8;
    const dim3 grid((unsigned)((I + warps - 1) / warps), (unsigned)((T + TOKENS_PER_WARP - 1) / TOKENS_PER_WARP));
    Q3_LAUNCH(gate_up_kernel, grid, warps * 32, 0, (cudaStream_t)stream)(act, x, gate, up, w_dt, T, I, K);
    return q3_launch_status();
}

extern "C" int q3_matmul_cuda(float *y, const float *x, const void *w, q3_dtype w_dt, int64_t T, int64_t N, int64_t K,
                              int accumulate, void *stream) {
    if (T == 0 || N == 0) return 0;
    const int warps = 8;
    const dim3 grid((unsigned)((N + warps - 1) / warps), (unsigned)((T + TOKENS_PER_WARP - 1) / TOKENS_PER_WARP));
    Q3_LAUNCH(gemv_kernel, grid, warps * 32, 0, (cudaStream_t)stream)(y, x, w, w_dt, T, N, K, accumulate);
    return q3_launch_status();
}
