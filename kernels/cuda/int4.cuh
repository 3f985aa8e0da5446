// 4-bit GPTQ weights in registers (kernels/int4.h: qweight [K/8, N] int32, word (r, n) holding
// inputs 8r .. 8r + 7 of output n; qzeros [G, N/8]; scales [G, N] fp16; g_idx [K]) for the
// decode kernels that stream them (matmul_int4.cu's GEMV, moe_grouped.cu's int4 experts): the
// fp16 scale and the nibbles as fp32, and a block's tile of dot products.
//
// The tile: a block of INT4_THREADS threads sums INT4_COLS = 32 adjacent outputs n0 .. n0 + 31
// for up to INT4_TOKENS token rows. qweight's rows are contiguous along N, so output n's
// weights run down a column, one word a row: a warp per output (row_dots.cuh's way) would read
// a 128-byte line for every 4 bytes it uses. Here lane l takes the 4 outputs 4 (l % 8) .. + 3
// (one 16-byte load of a word row), so the 8 lanes of a lane quad read a line whole; the 4
// quads of each of the 8 warps take 32 slices of the K/8 word rows (contiguous, as even as they
// divide), and every word of the tile is read once for all the tokens. Each lane adds its sums
// into its own entries of the slices' shared partials (int4_partials), and after one barrier
// each thread sums the 32 slices of one (token, output) in slice order: no atomics, the same
// bits on every schedule.
//
// Per word row of a lane, two halves: the 16 nibbles of 4 inputs x 4 outputs decoded once,
// then each token's 4 activations (one 16-byte load from L1) and 16 multiply-adds.
// With g_idx[k] == k / group (group > 0, a multiple of 8: a word row within one group) the
// scale and zero apply once per group: a nibble q becomes the fp32 1 + q/16 (q put under the
// exponent of 1: a shift and an and-or, exact), and at the group's end
//     part[t, n] += 16 s[g, n] (sum_k x[t, k] (1 + q/16) - (1 + z[g, n]/16) sum_k x[t, k]),
// which is sum_k x s (q - z) (the CPU's gemv_grouped, kernels/cpu/matmul_int4.c, the same); a
// slice that starts or ends inside a group ends its part there. Otherwise (desc_act, group 0)
// each input's weights are dequantized with its own group's scale and zero, s (q - z) exact.
//
// Registers a thread: the group's sums (INT4_TOKENS x 4 outputs) and the tokens' group sums
// of x, 40; 16 decoded nibbles; within 128 for 2 blocks of 256 an SM (sass_check.py). The
// partials, kept in shared memory rather than a second set of 32 registers, are added to once
// a group.
#ifndef Q3_KERNELS_CUDA_INT4_CUH
#define Q3_KERNELS_CUDA_INT4_CUH

#include "../int4.h"
#include "common.cuh"

#define INT4_WARPS 8
#define INT4_THREADS (INT4_WARPS * 32)
#define INT4_COLS 32                     // outputs a tile: 8 lanes x 4
#define INT4_SLICES (INT4_WARPS * 4)     // the K slices: 4 lane quads a warp
#define INT4_TOKENS (INT4_THREADS / INT4_COLS) // token rows a tile: a thread each sum of the tile

// the shared memory of a tile's sums: each slice's [token][output], 32 KiB (a lane adds its
// group sums into its own entries, and the block sums the slices in order at the end)
typedef float int4_partials[INT4_SLICES][INT4_TOKENS][INT4_COLS];

// fp16 bits -> fp32, exact: the bits moved into fp32's places are 2^-112 times the value
// (subnormals included: m 2^-24 lands on the fp32 subnormal m 2^-136), and one multiply by
// 2^112 restores it (the build keeps fp32 subnormals); infinities and NaN set apart
__device__ __forceinline__ float int4_f16(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, rest = (uint32_t)(h & 0x7fffu) << 13;
    if ((h & 0x7c00u) == 0x7c00u) return __uint_as_float(sign | 0x7f800000u | rest);
    return __uint_as_float(sign | rest) * 5.192296858534827628530496329220096e33f; // 2^112
}

// nibble j of word w (input 8r + j of its output) as the fp32 1 + q/16: q moved to bits 19..22,
// the mantissa's top 4 bits under the exponent of 1
__device__ __forceinline__ float int4_nibble16(uint32_t w, int j) {
    const uint32_t b = 4 * j <= 19 ? w << (19 - 4 * j) : w >> (4 * j - 19);
    return __uint_as_float((b & 0x00780000u) | 0x3f800000u);
}

// the zero (stored nibble + zero_offset) of output n in group g
__device__ __forceinline__ int int4_zero(const q3_int4_matrix &w, int64_t N, int64_t g, int64_t n) {
    const uint32_t word = (uint32_t)w.qzeros[g * (N / Q3_INT4_PACK) + n / Q3_INT4_PACK];
    return (int)((word >> (4 * (n % Q3_INT4_PACK))) & 0xfu) + w.zero_offset;
}

// token t's activation row: xr[t] where the rows are gathered, else x + t * K
__device__ __forceinline__ const float *int4_token(const float *x, const float *const *xr, int t, int64_t K) {
    return xr ? xr[t] : x + t * K;
}

// 4 floats at p: one 16-byte load when vec (p 16-byte aligned)
__device__ __forceinline__ float4 int4_load_x4(const float *p, bool vec) {
    return vec ? *(const float4 *)p : make_float4(p[0], p[1], p[2], p[3]);
}

// the 4 words of outputs c .. c + 3 in word row r: one 16-byte load when vec
__device__ __forceinline__ uint4 int4_words(const int32_t *qweight, int64_t N, int64_t r, int64_t c, bool vec) {
    const int32_t *p = qweight + r * N + c;
    return vec ? *(const uint4 *)p : make_uint4((uint32_t)p[0], (uint32_t)p[1], (uint32_t)p[2], (uint32_t)p[3]);
}

// mine[t][o + i] += v[t][i] for t < nt, then v cleared: a lane's sums into its own entries of
// the shared partials (its slice's row of them, outputs o .. o + 3 of the tile)
__device__ __forceinline__ void int4_add_mine(float (*mine)[INT4_COLS], int o, float (*v)[4], int nt) {
#pragma unroll
    for (int t = 0; t < INT4_TOKENS; t++) {
        if (t >= nt) break;
        float4 *p = (float4 *)&mine[t][o];
        const float4 a = *p;
        *p = make_float4(a.x + v[t][0], a.y + v[t][1], a.z + v[t][2], a.w + v[t][3]);
#pragma unroll
        for (int i = 0; i < 4; i++) v[t][i] = 0.0f;
    }
}

// the end of group g's part of a slice: ga[t][i] = 16 s (ga[t][i] - (1 + z/16) gx[t]) for the
// 4 outputs from c, added into mine (int4_add_mine); gx cleared
__device__ __forceinline__ void int4_group_end(float (*mine)[INT4_COLS], int o, float (*ga)[4], float *gx,
                                               const q3_int4_matrix &w, int64_t N, int64_t g, int64_t c, int nt) {
    float s[4], z[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        s[i] = 16.0f * int4_f16(w.scales[g * N + c + i]);
        z[i] = 1.0f + 0.0625f * (float)int4_zero(w, N, g, c + i);
    }
#pragma unroll
    for (int t = 0; t < INT4_TOKENS; t++) {
        if (t >= nt) break;
#pragma unroll
        for (int i = 0; i < 4; i++) ga[t][i] = s[i] * (ga[t][i] - z[i] * gx[t]);
        gx[t] = 0.0f;
    }
    int4_add_mine(mine, o, ga, nt);
}

// group > 0: mine += the slice's word rows [r0, r1) of outputs c .. c + 3, group by group
// (GROUP_ENDS: true always, a parameter only so that matmul_int4.cu can plant a slice's groups
// run together under its first group's scale and zero: planted defect 19)
template <bool GROUP_ENDS>
__device__ __forceinline__ void int4_slice_grouped(float (*mine)[INT4_COLS], int o, const q3_int4_matrix &w,
                                                   int64_t group, const float *x, const float *const *xr, int nt,
                                                   int64_t N, int64_t K, int64_t c, int64_t r0, int64_t r1,
                                                   bool vec_w, bool vec_x) {
    float ga[INT4_TOKENS][4] = {{0}}, gx[INT4_TOKENS] = {0}; // the group's sums of x (1 + q/16), of x
    int64_t g = r0 * Q3_INT4_PACK / group;
    for (int64_t r = r0; r < r1; r++) {
        if (GROUP_ENDS && r * Q3_INT4_PACK / group != g) {
            int4_group_end(mine, o, ga, gx, w, N, g, c, nt);
            g = r * Q3_INT4_PACK / group;
        }
        const uint4 pk = int4_words(w.qweight, N, r, c, vec_w);
        const uint32_t words[4] = {pk.x, pk.y, pk.z, pk.w};
#pragma unroll
        for (int h = 0; h < 2; h++) { // inputs 8r + 4h .. + 3
            float q[4][4];            // [input][output]
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int i = 0; i < 4; i++) q[j][i] = int4_nibble16(words[i], 4 * h + j);
#pragma unroll
            for (int t = 0; t < INT4_TOKENS; t++) {
                if (t >= nt) break;
                const float4 v = int4_load_x4(int4_token(x, xr, t, K) + Q3_INT4_PACK * r + 4 * h, vec_x);
                const float xv[4] = {v.x, v.y, v.z, v.w};
                gx[t] += (xv[0] + xv[1]) + (xv[2] + xv[3]);
#pragma unroll
                for (int j = 0; j < 4; j++)
#pragma unroll
                    for (int i = 0; i < 4; i++) ga[t][i] += xv[j] * q[j][i];
            }
        }
    }
    if (r1 > r0) int4_group_end(mine, o, ga, gx, w, N, g, c, nt);
}

// group 0 (desc_act: g_idx arbitrary): mine += the slice's word rows [r0, r1), each input's
// weights s (q - z) of its own group g_idx[k]
__device__ __forceinline__ void int4_slice_any_groups(float (*mine)[INT4_COLS], int o, const q3_int4_matrix &w,
                                                      const float *x, const float *const *xr, int nt, int64_t N,
                                                      int64_t K, int64_t c, int64_t r0, int64_t r1, bool vec_w) {
    float acc[INT4_TOKENS][4] = {{0}};
    for (int64_t r = r0; r < r1; r++) {
        const uint4 pk = int4_words(w.qweight, N, r, c, vec_w);
        const uint32_t words[4] = {pk.x, pk.y, pk.z, pk.w};
        for (int j = 0; j < Q3_INT4_PACK; j++) {
            const int64_t k = Q3_INT4_PACK * r + j, g = w.g_idx[k];
            float wk[4];
#pragma unroll
            for (int i = 0; i < 4; i++)
                wk[i] = int4_f16(w.scales[g * N + c + i]) *
                        (float)((int)((words[i] >> (4 * j)) & 0xfu) - int4_zero(w, N, g, c + i));
#pragma unroll
            for (int t = 0; t < INT4_TOKENS; t++) {
                if (t >= nt) break;
                const float xk = int4_token(x, xr, t, K)[k];
#pragma unroll
                for (int i = 0; i < 4; i++) acc[t][i] += xk * wk[i];
            }
        }
    }
    int4_add_mine(mine, o, acc, nt);
}

// The tile's sums, called by every thread of the block (it synchronizes): outputs n0 .. n0 + 31
// of W [N, K] (N a multiple of 8) for the nt <= INT4_TOKENS token rows int4_token(x, xr, t, K)
// (x [*, K] fp32, K a multiple of 8). Returns this thread's: token threadIdx.x / INT4_COLS,
// output n0 + threadIdx.x % INT4_COLS (0 past nt). part is read after the return: the caller
// synchronizes before it is used again.
template <bool GROUP_ENDS = true>
__device__ __forceinline__ float int4_tile_dots(const q3_int4_matrix &w, const float *x, const float *const *xr,
                                                int nt, int64_t N, int64_t K, int64_t n0, int4_partials &part) {
    const int lane = threadIdx.x & 31, slice = (threadIdx.x >> 5) * 4 + (lane >> 3), o = 4 * (lane & 7);
    const int64_t c = n0 + o, R = K / Q3_INT4_PACK;
    // a lane past N (N % 32 != 0 in the last tile; N % 4 == 0) has an empty slice
    const int64_t r0 = R * slice / INT4_SLICES, r1 = c < N ? R * (slice + 1) / INT4_SLICES : r0;
    const int64_t group = w.group > 0 && w.group % Q3_INT4_PACK == 0 ? w.group : 0;
    const bool vec_w = ((uintptr_t)w.qweight & 15u) == 0, vec_x = ((uintptr_t)x & 15u) == 0;
    float (*mine)[INT4_COLS] = part[slice];
#pragma unroll
    for (int t = 0; t < INT4_TOKENS; t++)
        if (t < nt) *(float4 *)&mine[t][o] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (group) int4_slice_grouped<GROUP_ENDS>(mine, o, w, group, x, xr, nt, N, K, c, r0, r1, vec_w, vec_x);
    else int4_slice_any_groups(mine, o, w, x, xr, nt, N, K, c, r0, r1, vec_w);
    __syncthreads();
    const int t = threadIdx.x / INT4_COLS, out = threadIdx.x % INT4_COLS;
    float s = 0.0f;
    if (t < nt)
#pragma unroll 8
        for (int v = 0; v < INT4_SLICES; v++) s += part[v][t][out];
    return s;
}

#endif
