/* x held as two signed 8-bit digits a block of BLOCK inputs, for the int4 decode GEMVs on
 * integer dot products (matmul_int4_vnni.c: AVX512-VNNI; matmul_int4_sdot.c: ARM's SDOT):
 *     x[k] ~ sx (hi[k] + lo[k] / 256),   sx = max |x over the block| / 127,
 *     hi = round(x / sx) in [-127, 127],  lo = round(256 (x / sx - hi)) in [-128, 127],
 * an error of at most sx / 512 = max / 65024 an input. A qweight word holds inputs 8r .. 8r + 7
 * of one column; its bytes masked (w & 0x0f0f0f0f) are inputs 8r, +2, +4, +6 and shifted
 * ((w >> 4) & 0x0f0f0f0f) inputs 8r + 1, +3, +5, +7, so the digits of word row r are stored in
 * that order, 16 bytes: hi of the even inputs, hi of the odd, lo of the even, lo of the odd. */
#ifndef Q3_KERNELS_CPU_INT4_DIGITS_H
#define Q3_KERNELS_CPU_INT4_DIGITS_H

#include <math.h>
#include <stdint.h>

#define BLOCK 128 /* inputs a digit scale */

/* the unit of a group: where the digit blocks and the weight groups nest (0: they do not) */
static inline int64_t unit_of(int64_t group, int64_t K) {
    if (group <= 0) return 0;
    if (group <= BLOCK && BLOCK % group == 0) return group;
    if (group % BLOCK == 0) return BLOCK;
    return group == K && K < BLOCK ? K : 0;
}

/* token t's digits (xq [K/8][16] bytes) and block scales (sx [K/BLOCK, rounded up]) */
static inline void quantize_token(int8_t *xq, float *sx, const float *x, int64_t K) {
    for (int64_t b0 = 0; b0 < K; b0 += BLOCK) {
        const int64_t b1 = b0 + BLOCK < K ? b0 + BLOCK : K;
        float amax = 0.0f;
        for (int64_t k = b0; k < b1; k++) amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax;
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        sx[b0 / BLOCK] = amax / 127.0f;
        for (int64_t k = b0; k < b1; k++) {
            const float v = x[k] * inv, hi = nearbyintf(v);
            float lo = nearbyintf((v - hi) * 256.0f);
            lo = lo > 127.0f ? 127.0f : lo < -128.0f ? -128.0f : lo;
            int8_t *word = xq + k / 8 * 16;
            const int j = (int)(k % 8), at = (j & 1) * 4 + j / 2; /* even inputs, then odd */
            word[at] = (int8_t)hi;
            word[8 + at] = (int8_t)lo;
        }
    }
}

/* (sum hi, sum lo) of token t's digits over word rows [r0, r1) */
static inline void digit_sums(const int8_t *xq, int64_t r0, int64_t r1, int32_t *hi, int32_t *lo) {
    int32_t h = 0, l = 0;
    for (int64_t r = r0; r < r1; r++)
        for (int i = 0; i < 8; i++) {
            h += xq[r * 16 + i];
            l += xq[r * 16 + 8 + i];
        }
    *hi = h, *lo = l;
}

#endif
