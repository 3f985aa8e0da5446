// The routed experts of a decode step with FP8 weights (twins: q3_moe_gate_up_fp8_host and
// q3_moe_down_fp8_host in csrc/check/twins.c): moe_grouped.cu's gate/up and down kernels, the
// same grid (one block column per possible active expert, blocks past active[0] returning at
// once: capturable in a CUDA graph), reading each chosen expert's e4m3 bytes in 16-byte
// vectors and its block scales through fp8.cuh's fp8_row_dots. Expert weights come as device
// arrays of E device pointers to the [rows, K] bytes, and E more to their scale_inv
// [ceil(rows/128), ceil(K/128)] of dtype sdt.
#include "fp8.cuh"
#include "moe_active.cuh"

// act [s, i] = silu(x[rows[s]] . G_e[i]) * (x[rows[s]] . U_e[i]) for the slots s of the block
// column's expert e: one warp per weight row i, the tokens TOKENS_PER_WARP at a time, each
// activation load serving the gate and the up row
__global__ void moe_gate_up_fp8_kernel(float *act, const float *x, const int32_t *rows, const int64_t *offsets,
                                       const int32_t *active, const uint8_t *const *gate, const uint8_t *const *up,
                                       const void *const *gate_scale, const void *const *up_scale, q3_dtype sdt,
                                       int64_t I, int64_t K) {
    int64_t first, n;
    const int e = active_expert(offsets, active, blockIdx.x, &first, &n);
    const int64_t i = (int64_t)blockIdx.y * GROUP_WARPS + (threadIdx.x >> 5);
    if (e < 0 || i >= I) return;
    const int lane = threadIdx.x & 31;
    const uint8_t *ws[2] = {gate[e], up[e]};
    const void *ss[2] = {gate_scale[e], up_scale[e]};
    for (int64_t c0 = 0; c0 < n; c0 += TOKENS_PER_WARP) {
        const int nt = n - c0 < TOKENS_PER_WARP ? (int)(n - c0) : TOKENS_PER_WARP;
        const float *xr[TOKENS_PER_WARP]; // the chunk's token rows of x
#pragma unroll
        for (int t = 0; t < TOKENS_PER_WARP; t++) xr[t] = t < nt ? x + (int64_t)rows[first + c0 + t] * K : x;
        float acc[2][TOKENS_PER_WARP] = {{0}};
        fp8_row_dots<TOKENS_PER_WARP, 2>(acc, x, xr, ws, ss, sdt, i, K, nt, lane);
#pragma unroll
        for (int t = 0; t < TOKENS_PER_WARP; t++) {
            if (t >= nt) break;
            const float gs = q3_warp_sum(acc[0][t]), us = q3_warp_sum(acc[1][t]);
            if (lane == 0) act[(first + c0 + t) * I + i] = gs / (1.0f + expf(-gs)) * us;
        }
    }
}

// y [s, i] = act [s] . D_e[i] for the slots s of the block column's expert e (its act rows
// are contiguous, act + first * K)
__global__ void moe_down_fp8_kernel(float *y, const float *act, const int64_t *offsets, const int32_t *active,
                                    const uint8_t *const *down, const void *const *down_scale, q3_dtype sdt,
                                    int64_t N, int64_t K) {
    int64_t first, n;
    const int e = active_expert(offsets, active, blockIdx.x, &first, &n);
    const int64_t i = (int64_t)blockIdx.y * GROUP_WARPS + (threadIdx.x >> 5);
    if (e < 0 || i >= N) return;
    const int lane = threadIdx.x & 31;
    const uint8_t *ws[1] = {down[e]};
    const void *ss[1] = {down_scale[e]};
    for (int64_t c0 = 0; c0 < n; c0 += TOKENS_PER_WARP) {
        const int nt = n - c0 < TOKENS_PER_WARP ? (int)(n - c0) : TOKENS_PER_WARP;
        float acc[1][TOKENS_PER_WARP] = {{0}};
        fp8_row_dots<TOKENS_PER_WARP, 1>(acc, act + (first + c0) * K, NULL, ws, ss, sdt, i, K, nt, lane);
#pragma unroll
        for (int t = 0; t < TOKENS_PER_WARP; t++) {
            if (t >= nt) break;
            const float s = q3_warp_sum(acc[0][t]);
            if (lane == 0) y[(first + c0 + t) * N + i] = s;
        }
    }
}

// act [T * k, I] by slot <- x [T, K]; max_active >= active[0] (min(E, T * k) always is)
extern "C" int q3_moe_gate_up_fp8_cuda(float *act, const float *x, const int32_t *rows, const int64_t *offsets,
                                       const int32_t *active, const uint8_t *const *gate, const uint8_t *const *up,
                                       const void *const *gate_scale, const void *const *up_scale, q3_dtype sdt,
                                       int max_active, int64_t I, int64_t K, void *stream) {
    if (max_active <= 0 || I == 0) return 0;
    dim3 grid;
    const int bad = expert_grid(&grid, max_active, I);
    if (bad) return bad;
    Q3_LAUNCH(moe_gate_up_fp8_kernel, grid, GROUP_WARPS * 32, 0, (cudaStream_t)stream)(
        act, x, rows, offsets, active, gate, up, gate_scale, up_scale, sdt, I, K);
    return q3_launch_status();
}

// y [T * k, N] by slot <- act [T * k, K]
extern "C" int q3_moe_down_fp8_cuda(float *y, const float *act, const int64_t *offsets, const int32_t *active,
                                    const uint8_t *const *down, const void *const *down_scale, q3_dtype sdt,
                                    int max_active, int64_t N, int64_t K, void *stream) {
    if (max_active <= 0 || N == 0) return 0;
    dim3 grid;
    const int bad = expert_grid(&grid, max_active, N);
    if (bad) return bad;
    Q3_LAUNCH(moe_down_fp8_kernel, grid, GROUP_WARPS * 32, 0, (cudaStream_t)stream)(y, act, offsets, active, down,
                                                                                  down_scale, sdt, N, K);
    return q3_launch_status();
}
