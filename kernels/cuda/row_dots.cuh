// The inner loop of the GEMV-style kernels (matmul.cu, moe_grouped.cu): one warp streams
// NW weight rows (1, or 2 for gate and up) once and dots them with up to NT activation rows.
// bf16 and fp16 weights with K % 8 == 0 go through 16-byte loads of 8 halves a lane (widened
// exactly to fp32), and each token's 8 matching activations through two 16-byte loads (one
// load serves all NW weight rows); anything else (fp32 weights, K % 8 != 0) one element a
// lane. The activation rows come from L1/L2: a block's warps read the same rows at the same
// columns at about the same time.
//
// Traffic, per lane and 16-byte weight load (8 bf16 of each of the NW rows): 32 bytes of
// activations per token from L1, and 8 * NW multiply-adds per token. Accumulators: NW * NT
// registers; the caller sizes NT (the whole decode batch, up to 64, for matmul.cu), so that a
// weight row is read from memory once for all its tokens.
#ifndef Q3_KERNELS_CUDA_ROW_DOTS_CUH
#define Q3_KERNELS_CUDA_ROW_DOTS_CUH

#include "common.cuh"

#define TOKENS_PER_WARP 8 // tokens a warp takes at a time where they are gathered by index

// v[0 .. 8) = p[0 .. 8): two 16-byte loads when vec (p 16-byte aligned), else eight 4-byte ones
__device__ __forceinline__ void load_x8(float *v, const float *p, bool vec) {
    if (vec) {
        const float4 a = ((const float4 *)p)[0], b = ((const float4 *)p)[1];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
        v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = p[i];
    }
}

// the 8 bf16 of a 16-byte group as fp32, in memory order
__device__ __forceinline__ void unpack_bf16x8(float *v, uint4 pk) {
    const uint32_t words[4] = {pk.x, pk.y, pk.z, pk.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        v[2 * i] = __uint_as_float(words[i] << 16);
        v[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
}

// the 8 fp16 of a 16-byte group as fp32, in memory order (exact: kernels/dtype.h's widening)
__device__ __forceinline__ void unpack_f16x8(float *v, uint4 pk) {
    const uint32_t words[4] = {pk.x, pk.y, pk.z, pk.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        v[2 * i] = q3_f16_bits_to_f32((uint16_t)(words[i] & 0xffffu));
        v[2 * i + 1] = q3_f16_bits_to_f32((uint16_t)(words[i] >> 16));
    }
}

// row_dots' 16-byte path: K % 8 == 0, the weights bf16 (F16 false) or fp16 (true), a template
// argument so that each kind's loop holds no dtype test
template <int NT, int NW, bool F16>
__device__ __forceinline__ void row_dots_x8(float (*acc)[NT], const float *x, const float *const *xr,
                                            const void *const *w, int64_t row, int64_t K, int nt, int lane) {
    const bool vec = ((uintptr_t)x & 15u) == 0;
    const uint4 *wr[NW];
#pragma unroll
    for (int j = 0; j < NW; j++) wr[j] = (const uint4 *)((const uint16_t *)w[j] + row * K);
    for (int64_t c = lane; c < K / 8; c += 32) {
        float wv[NW][8];
#pragma unroll
        for (int j = 0; j < NW; j++) {
            if (F16) unpack_f16x8(wv[j], wr[j][c]);
            else unpack_bf16x8(wv[j], wr[j][c]);
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t >= nt) break;
            float xv[8];
            load_x8(xv, (xr ? xr[t] : x + t * K) + c * 8, vec);
#pragma unroll
            for (int j = 0; j < NW; j++) {
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; i++) s += xv[i] * wv[j][i];
                acc[j][t] += s;
            }
        }
    }
}

// acc[j][t] += (the lane's share of) x_row(t) . w[j][row] for j < NW, t < nt <= NT, where
// x_row(t) = xr[t] when xr is given (rows gathered by the caller, NT <= TOKENS_PER_WARP, each
// xr[t] = x + some multiple of K) else x + t * K. The token loops run to NT with a guard, so
// that acc stays in registers. The 16-byte activation loads need x 16-byte aligned (then so
// is every row start x + r * K, K % 8 == 0); otherwise they fall back to 4-byte loads.
template <int NT, int NW>
__device__ __forceinline__ void row_dots(float (*acc)[NT], const float *x, const float *const *xr,
                                         const void *const *w, q3_dtype w_dt, int64_t row, int64_t K, int nt,
                                         int lane) {
    if ((K % 8 == 0) && w_dt == Q3_BF16) {
        row_dots_x8<NT, NW, false>(acc, x, xr, w, row, K, nt, lane);
    } else if ((K % 8 == 0) && w_dt == Q3_F16) {
        row_dots_x8<NT, NW, true>(acc, x, xr, w, row, K, nt, lane);
    } else {
        for (int64_t k = lane; k < K; k += 32) {
            float wk[NW];
#pragma unroll
            for (int j = 0; j < NW; j++) wk[j] = q3_load(w[j], w_dt, row * K + k);
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t >= nt) break;
                const float xk = (xr ? xr[t] : x + t * K)[k];
#pragma unroll
                for (int j = 0; j < NW; j++) acc[j][t] += xk * wk[j];
            }
        }
    }
}

#endif
