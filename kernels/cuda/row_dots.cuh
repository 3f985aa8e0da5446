// The inner loop of the GEMV-style kernels (matmul.cu, moe_grouped.cu): one warp streams
// one weight row once and dots it with up to TOKENS_PER_WARP activation rows at a time.
// bf16 weights with K % 8 == 0 go through 16-byte loads of 8 bf16 a lane; anything else
// (fp32 weights, odd K) one element a lane. The activation rows come from L1/L2.
#ifndef Q3_KERNELS_CUDA_ROW_DOTS_CUH
#define Q3_KERNELS_CUDA_ROW_DOTS_CUH

#include "common.cuh"

#define TOKENS_PER_WARP 8

// acc[t] += (the lane's share of) x_row(t0 + t) . w[row] for t < nt <= TOKENS_PER_WARP, where
// x_row(i) = x + rows[i] * K when rows is given (tokens gathered by index, as an expert's
// group), else x + i * K. The loops run to TOKENS_PER_WARP with a guard, so that acc and the
// row pointers stay in registers.
__device__ __forceinline__ void row_dots(float *acc, const float *x, const int32_t *rows, const void *w,
                                         q3_dtype w_dt, int64_t row, int64_t K, int64_t t0, int nt, int lane) {
    const float *xr[TOKENS_PER_WARP];
#pragma unroll
    for (int t = 0; t < TOKENS_PER_WARP; t++)
        xr[t] = t < nt ? x + (rows ? (int64_t)rows[t0 + t] : t0 + t) * K : x;
    if ((K % 8 == 0) && w_dt == Q3_BF16) {
        const uint4 *wr = (const uint4 *)((const uint16_t *)w + row * K);
        for (int64_t c = lane; c < K / 8; c += 32) {
            const uint4 pk = wr[c];
            const uint32_t words[4] = {pk.x, pk.y, pk.z, pk.w};
            float wv[8];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                wv[2 * i] = __uint_as_float(words[i] << 16);
                wv[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
            }
#pragma unroll
            for (int t = 0; t < TOKENS_PER_WARP; t++) {
                if (t >= nt) break;
                const float *xc = xr[t] + c * 8;
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; i++) s += xc[i] * wv[i];
                acc[t] += s;
            }
        }
    } else {
        for (int64_t k = lane; k < K; k += 32) {
            const float wk = q3_load(w, w_dt, row * K + k);
#pragma unroll
            for (int t = 0; t < TOKENS_PER_WARP; t++) {
                if (t >= nt) break;
                acc[t] += xr[t][k] * wk;
            }
        }
    }
}

#endif
