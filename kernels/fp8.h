/* FP8 weights: float8 e4m3fn with one scale per 128 x 128 block (the fine-grained FP8
 * checkpoints: quant_method "fp8", fmt "e4m3", weight_block_size [128, 128]).
 *
 * e4m3fn byte: S EEEE MMM, exponent bias 7, no infinities. E > 0: (-1)^S 2^(E-7) (1 + M/8);
 * E = 0: subnormal (-1)^S 2^-6 (M/8) = (-1)^S M 2^-9; S 1111 111 (0x7f, 0xff) is NaN. Largest
 * finite magnitude 448 (0x7e). Every value is exact in fp32.
 *
 * A weight W [N, K] (stored [out, in]) is w [N, K] bytes and scale_inv [ceil(N/128),
 * ceil(K/128)] (fp32 or bf16); W[i, j] = e4m3(w[i, j]) * scale_inv[i / 128, j / 128]. The
 * last row and column of blocks may be partial (N, K not multiples of 128). */
#ifndef Q3_KERNELS_FP8_H
#define Q3_KERNELS_FP8_H

#include "dtype.h"

#define Q3_FP8_BLOCK 128

static inline int64_t q3_fp8_blocks(int64_t n) { return (n + Q3_FP8_BLOCK - 1) / Q3_FP8_BLOCK; }

/* exact, branch per class; the vector kernels (kernels/cpu/matmul_fp8.c) build the same bits */
static inline float q3_e4m3_to_f32(uint8_t b) {
    const uint32_t sign = (uint32_t)(b & 0x80u) << 24, e = (b >> 3) & 0xfu, m = b & 7u;
    uint32_t u;
    if ((b & 0x7fu) == 0x7fu)
        u = sign | 0x7fc00000u; /* quiet NaN, sign kept */
    else if (e == 0) {
        float f = (float)m * (1.0f / 512.0f); /* M 2^-9, exact */
        memcpy(&u, &f, sizeof u);
        u |= sign;
    } else
        u = sign | ((e + 120u) << 23) | (m << 20); /* fp32 exponent E - 7 + 127 */
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 -> e4m3fn, exact round to nearest even, as torch's .to(torch.float8_e4m3fn) does (2.x
 * on the CPU): saturating, every magnitude from 448 up (inf included) gives +-448 (0x7e), NaN
 * gives NaN (0x7f, sign kept). Integer arithmetic only: independent of the FP environment. */
static inline uint8_t q3_f32_to_e4m3(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return sign | 0x7fu;  /* NaN */
    if (u >= 0x43e00000u) return sign | 0x7eu; /* 448.0f and up */
    if (u >= 0x3c800000u) {                    /* 2^-6 and up: a normal e4m3 */
        /* keep 3 of the 23 mantissa bits; adding 2^19 - 1 plus the kept lsb rounds half to
         * even, a carry moving into the exponent as it should */
        u += 0x7ffffu + ((u >> 20) & 1u);
        return sign | (uint8_t)((u - (120u << 23)) >> 20); /* exponent E - 127 + 7 */
    }
    /* below 2^-6: a multiple q of 2^-9 (q = 8 is 2^-6, byte 0x08: still right) */
    const uint32_t e = u >> 23;
    if (e == 0) return sign; /* fp32 zero or subnormal: far below 2^-10 */
    const uint32_t sig = (u & 0x7fffffu) | 0x800000u, shift = 141u - e; /* f = sig 2^(e-150) */
    if (shift > 25u) return sign;                                        /* f < 2^-11 */
    uint32_t q = sig >> shift;
    const uint32_t rem = sig & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    q += rem > half || (rem == half && (q & 1u));
    return sign | (uint8_t)q;
}

/* scale_inv element idx of dtype dt (fp32 or bf16) as fp32 */
static inline float q3_fp8_scale_at(const void *scale, q3_dtype dt, int64_t idx) {
    return dt == Q3_BF16 ? q3_bf16_to_f32(((const uint16_t *)scale)[idx]) : ((const float *)scale)[idx];
}

/* dst [nr, K] fp32 <- rows [n0, n0 + nr) of the block-scaled weight (w [N, K] bytes, scale
 * [ceil(N/128), ceil(K/128)] of dtype sdt): scalar and exact, the reference the kernels match */
static inline void q3_fp8_dequant_rows(float *dst, const uint8_t *w, const void *scale, q3_dtype sdt,
                                       int64_t n0, int64_t nr, int64_t K) {
    const int64_t kb = q3_fp8_blocks(K);
    for (int64_t i = 0; i < nr; i++) {
        const int64_t n = n0 + i;
        for (int64_t j = 0; j < K; j++)
            dst[i * K + j] = q3_e4m3_to_f32(w[n * K + j]) *
                             q3_fp8_scale_at(scale, sdt, n / Q3_FP8_BLOCK * kb + j / Q3_FP8_BLOCK);
    }
}

/* y [T, N] fp32 (=, or += when accumulate) x [T, K] fp32 * W^T, W block-scaled e4m3 as above.
 * scratch: threads * q3_matmul_fp8_scratch_floats(T, K) floats (none for decode-sized T); at
 * most `threads` threads. xb: NULL, or the bf16 scratch of kernels/matmul.h, given which the
 * amx path rounds x and the dequantized weights to bf16 for its tiles (as the CUDA prefill). */
typedef void q3_matmul_fp8_fn(float *y, const float *x, const uint8_t *w, const void *scale, q3_dtype sdt,
                              int64_t T, int64_t N, int64_t K, int accumulate, float *scratch, int threads,
                              uint16_t *xb);

/* T below this: the GEMV, converting each weight in registers once for all T tokens; from it
 * on: chunks of Q3_FP8_CHUNK_ROWS rows dequantized to fp32 and the fp32 matmul (compute-bound) */
#define Q3_FP8_GEMV_MAX_T 16
#define Q3_FP8_CHUNK_ROWS 128 /* one row of scale blocks; fewer rows re-read x [T, K] more often */

/* one thread's chunk [Q3_FP8_CHUNK_ROWS, K] of fp32 weights and its output [T, Q3_FP8_CHUNK_ROWS] */
static inline int64_t q3_matmul_fp8_scratch_floats(int64_t T, int64_t K) {
    return T < Q3_FP8_GEMV_MAX_T ? 0 : Q3_FP8_CHUNK_ROWS * (K + T);
}

#endif
