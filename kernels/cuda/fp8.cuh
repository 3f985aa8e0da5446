// FP8 weights in registers: block-scaled e4m3 bytes (kernels/fp8.h) turned into fp32 as the
// GEMV-style kernels (matmul_fp8.cu, moe_grouped.cu) stream them, and their inner loop.
//
// The conversion is bit assembly, exact for every code: byte S EEEE MMM becomes the fp32 bits
// S 0000 EEEE MMM 0...0, i.e. 2^-120 times the e4m3 value (E > 0: exponent E - 7 - 120 + 127
// = E; E = 0: the fp32 subnormal M 2^-149 + 20 = M 2^-129 = 2^-120 M 2^-9), and one multiply
// by 2^120 gives the value (exact: a power of two on a value that is then normal; the build
// keeps fp32 subnormals, no -ftz / --use_fast_math). Per byte: two shifts, one
// three-input logic op and the multiply; the FMA with the activation follows. The NaN codes
// S 1111 111 would come out as +-480: they are detected 4 bytes at a time instead (below) and
// make the lane's sums NaN at the end, as the CPU's NaN weight makes its row NaN.
//
// One multiply by the block scale per 16 columns a lane (a 16-byte chunk lies inside one
// 128-column block: 128 % 16 == 0), on the chunk's partial dot.
#ifndef Q3_KERNELS_CUDA_FP8_CUH
#define Q3_KERNELS_CUDA_FP8_CUH

#include "row_dots.cuh"

#define FP8_BLOCK 128
#define FP8_TWO_POW_120 1.329227995784915872903807060280344576e36f

// the byte at bits [8i, 8i + 8) of word u as fp32 (NaN codes excepted: see fp8_nan_bytes)
__device__ __forceinline__ float fp8_byte(uint32_t u, int i) {
    const uint32_t b = (u >> (8 * i)) & 0xffu;
    return __uint_as_float(((b & 0x80u) << 24) | ((b & 0x7fu) << 20)) * FP8_TWO_POW_120;
}

// nonzero when one of the 4 bytes of u is a NaN code (low 7 bits all ones): adding 1 to each
// byte's low 7 bits carries into its bit 7 exactly then, and never into the next byte
__device__ __forceinline__ uint32_t fp8_nan_bytes(uint32_t u) {
    return ((u & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u;
}

// e4m3 byte b as fp32, NaN codes included (the one-element-a-lane path)
__device__ __forceinline__ float fp8_to_f32(uint8_t b) {
    return (b & 0x7fu) == 0x7fu ? __uint_as_float(0x7fc00000u | ((uint32_t)(b & 0x80u) << 24)) : fp8_byte(b, 0);
}

// the 16 e4m3 of a 16-byte group as fp32, in memory order; *nan |= whether one is a NaN code
__device__ __forceinline__ void unpack_fp8x16(float *v, uint4 pk, uint32_t *nan) {
    const uint32_t words[4] = {pk.x, pk.y, pk.z, pk.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        *nan |= fp8_nan_bytes(words[i]);
#pragma unroll
        for (int j = 0; j < 4; j++) v[4 * i + j] = fp8_byte(words[i], j);
    }
}

// scale_inv element i (fp32 or bf16) as fp32
__device__ __forceinline__ float fp8_scale(const void *scale, q3_dtype sdt, int64_t i) { return q3_load(scale, sdt, i); }

// acc[j][t] += (the lane's share of) x_row(t) . W_j[row] for j < NW, t < nt <= NT, W_j the
// block-scaled e4m3 matrix w[j] [*, K] with scale[j] [*, ceil(K/128)]; x_row(t) as in
// row_dots.cuh (xr gathered rows, else x + t * K). With K % 16 == 0 and every w[j] 16-byte
// aligned, lane l takes the 16-byte chunks c = l, l + 32, ... of the row (16 weights each: a
// warp reads 512 contiguous bytes of a row a step, 4 full 128-byte lines), and each token's 16
// activations in four 16-byte loads (when x is 16-byte aligned), which serve all NW rows;
// otherwise one element a lane, its scale looked up per element. The scale row is the
// weight row's block row; its elements come from L1 (ceil(K/128) of them, shared by 128
// rows). CPB, the 16-byte chunks of a scale block, is 128 / 16 = 8 always (a parameter only so
// that matmul_fp8.cu can plant a wrong one: planted defect 11).
template <int NT, int NW, int CPB = FP8_BLOCK / 16>
__device__ __forceinline__ void fp8_row_dots(float (*acc)[NT], const float *x, const float *const *xr,
                                             const uint8_t *const *w, const void *const *scale, q3_dtype sdt,
                                             int64_t row, int64_t K, int nt, int lane) {
    const int64_t kb = (K + FP8_BLOCK - 1) / FP8_BLOCK, srow = row / FP8_BLOCK * kb;
    bool vec_w = K % 16 == 0;
#pragma unroll
    for (int j = 0; j < NW; j++) vec_w = vec_w && ((uintptr_t)w[j] & 15u) == 0;
    uint32_t nan[NW] = {0}; // per row: a NaN code among the lane's bytes
    if (vec_w) {
        const bool vec = ((uintptr_t)x & 15u) == 0;
        const uint4 *wr[NW];
#pragma unroll
        for (int j = 0; j < NW; j++) wr[j] = (const uint4 *)(w[j] + row * K);
        for (int64_t c = lane; c < K / 16; c += 32) {
            float wv[NW][16], sc[NW];
#pragma unroll
            for (int j = 0; j < NW; j++) {
                unpack_fp8x16(wv[j], wr[j][c], &nan[j]);
                sc[j] = fp8_scale(scale[j], sdt, srow + c / CPB); // block c * 16 / 128
            }
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t >= nt) break;
                const float *xp = (xr ? xr[t] : x + t * K) + c * 16;
                float xv[16];
                load_x8(xv, xp, vec);
                load_x8(xv + 8, xp + 8, vec);
#pragma unroll
                for (int j = 0; j < NW; j++) {
                    float s = 0.0f;
#pragma unroll
                    for (int i = 0; i < 16; i++) s += xv[i] * wv[j][i];
                    acc[j][t] += s * sc[j];
                }
            }
        }
    } else {
        for (int64_t k = lane; k < K; k += 32) {
            float wk[NW];
#pragma unroll
            for (int j = 0; j < NW; j++)
                wk[j] = fp8_to_f32(w[j][row * K + k]) * fp8_scale(scale[j], sdt, srow + k / FP8_BLOCK);
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t >= nt) break;
                const float xk = (xr ? xr[t] : x + t * K)[k];
#pragma unroll
                for (int j = 0; j < NW; j++) acc[j][t] += xk * wk[j];
            }
        }
    }
    // a NaN weight in this lane's chunks of row j: the row's sums are NaN, as on the CPU
#pragma unroll
    for (int j = 0; j < NW; j++)
        if (nan[j])
#pragma unroll
            for (int t = 0; t < NT; t++) acc[j][t] = __uint_as_float(0x7fc00000u);
}

#endif
