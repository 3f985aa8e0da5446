/* The int4 decode GEMV of a bf16 layer on the neon_bf16 level, on ARM's integer dot products
 * (SDOT, FEAT_DotProd, which ARMv8.6 has: 4 signed bytes x 4 signed bytes summed into an int32
 * lane): matmul_int4_vnni.c's design at NEON's width, the same integers exactly.
 *
 * y [T, N] (+)= x [T, K] W^T, T < Q3_INT4_GEMV_MAX_T, W a GPTQ matrix (kernels/int4.h) whose
 * groups lie in or over blocks of 128 inputs; x as two 8-bit digits a block (int4_digits.h:
 * within 1/65024 of the block's largest |x|, below the bf16 rounding a bf16 layer's x carries),
 * in the caller's bf16 scratch xb. A strip is 8 columns (one qzeros word, two int32x4 of words
 * a row: 64 weights); per word row: 4 ands and shifts, then for each token 8 SDOTs into its hi
 * and lo sums (tokens 4 at a time: 16 accumulators). Per unit (the group, or a block of a
 * larger group) and column, exactly in int32 (|sums| < 2^26):
 *     d = 256 sum q hi + sum q lo - z (256 sum hi + sum lo),   y += s sx / 256 d.
 * Threads split the columns in strips; columns past the last strip are summed exactly in fp32.
 * Not measured on ARM hardware: proven under qemu by the CPU op harness (cases_int4.c). */
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "int4_digits.h"
#include "ops.h"

#if defined(__aarch64__) && Q3_ISA_BFDOT && defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>

#define STRIP 8  /* columns a strip: one qzeros word */
#define TOKENS 4 /* tokens a pass over a strip's rows */

/* the digits' dword `i` of word row r of a token (xq at its first row) broadcast to each lane */
static inline int8x16_t digits(const int8_t *xq, int64_t r, int i) {
    int32_t dword;
    memcpy(&dword, xq + r * 16 + 4 * i, sizeof dword);
    return vreinterpretq_s8_s32(vdupq_n_s32(dword));
}

/* y [nt tokens, N] += columns [n, n + 8) over one unit: word rows [r0, r1), group g; xq, sx,
 * zsum (each token's 256 sum hi + sum lo over the unit) at the group's first token (row
 * strides: K / 8 * 16 digit bytes, `blocks` scales) */
static void strip(float *y, const int8_t *xq, const float *sx, const int32_t *zsum, const q3_int4_matrix *w,
                  int64_t N, int64_t K, int64_t blocks, int64_t r0, int64_t r1, int64_t g, int64_t n, int nt) {
    const uint32x4_t nib = vdupq_n_u32(0x0f0f0f0fu);
    int32x4_t hi[TOKENS][2], lo[TOKENS][2];
    for (int t = 0; t < nt; t++) hi[t][0] = hi[t][1] = lo[t][0] = lo[t][1] = vdupq_n_s32(0);
    for (int64_t r = r0; r < r1; r++) {
        const uint32_t *wr = (const uint32_t *)w->qweight + r * N + n;
        const uint32x4_t w0 = vld1q_u32(wr), w1 = vld1q_u32(wr + 4);
        const int8x16_t e0 = vreinterpretq_s8_u32(vandq_u32(w0, nib));
        const int8x16_t o0 = vreinterpretq_s8_u32(vandq_u32(vshrq_n_u32(w0, 4), nib));
        const int8x16_t e1 = vreinterpretq_s8_u32(vandq_u32(w1, nib));
        const int8x16_t o1 = vreinterpretq_s8_u32(vandq_u32(vshrq_n_u32(w1, 4), nib));
        for (int t = 0; t < nt; t++) {
            const int8_t *xt = xq + t * (K / 8) * 16;
            const int8x16_t he = digits(xt, r, 0), ho = digits(xt, r, 1), le = digits(xt, r, 2), lO = digits(xt, r, 3);
            hi[t][0] = vdotq_s32(vdotq_s32(hi[t][0], e0, he), o0, ho);
            hi[t][1] = vdotq_s32(vdotq_s32(hi[t][1], e1, he), o1, ho);
            lo[t][0] = vdotq_s32(vdotq_s32(lo[t][0], e0, le), o0, lO);
            lo[t][1] = vdotq_s32(vdotq_s32(lo[t][1], e1, le), o1, lO);
        }
    }
    /* the strip's zeros: nibbles 0-3 and 4-7 of its qzeros word, plus the format's offset */
    const uint32x4_t word = vdupq_n_u32((uint32_t)w->qzeros[g * (N / 8) + n / 8]);
    const int32x4_t shifts_lo = {0, -4, -8, -12}, shifts_hi = {-16, -20, -24, -28}, off = vdupq_n_s32(w->zero_offset);
    const int32x4_t z[2] = {vaddq_s32(vreinterpretq_s32_u32(vandq_u32(vshlq_u32(word, shifts_lo), vdupq_n_u32(0xf))), off),
                            vaddq_s32(vreinterpretq_s32_u32(vandq_u32(vshlq_u32(word, shifts_hi), vdupq_n_u32(0xf))), off)};
    const float16_t *scales = (const float16_t *)w->scales + g * N + n;
    const float32x4_t s[2] = {vcvt_f32_f16(vld1_f16(scales)), vcvt_f32_f16(vld1_f16(scales + 4))};
    for (int t = 0; t < nt; t++) {
        const float f = sx[t * blocks + r0 * 8 / BLOCK] / 256.0f;
        const int32x4_t zs = vdupq_n_s32(zsum[t]);
        for (int h = 0; h < 2; h++) {
            const int32x4_t d = vsubq_s32(vaddq_s32(vshlq_n_s32(hi[t][h], 8), lo[t][h]), vmulq_s32(z[h], zs));
            float *yt = y + t * N + n + 4 * h;
            vst1q_f32(yt, vfmaq_f32(vld1q_f32(yt), vmulq_n_f32(s[h], f), vcvtq_f32_s32(d)));
        }
    }
}

/* 1 done, 0 not taken (no xb, a group the digit blocks do not nest with, too many tokens or
 * inputs, fewer than 8 columns, K not whole words): the caller's fp32 GEMV then runs */
static int gemv_sdot(float *y, const float *x, const q3_int4_matrix *w, int64_t T, int64_t N, int64_t K,
                     int accumulate, int threads, uint16_t *xb) {
    const int64_t unit = unit_of(w->group, K);
    if (!xb || unit == 0 || T < 1 || T >= Q3_INT4_GEMV_MAX_T || N < STRIP || K % 8) return 0;
    int8_t *xq = (int8_t *)xb; /* [T][K/8][16]: 2 T K bytes of the caller's T K bf16 */
    float sx[Q3_INT4_GEMV_MAX_T * 64];
    const int64_t blocks = (K + BLOCK - 1) / BLOCK, units = K / unit;
    if (T * blocks > (int64_t)(sizeof sx / sizeof sx[0])) return 0; /* K above 8192 */
    for (int64_t t = 0; t < T; t++) quantize_token(xq + t * (K / 8) * 16, sx + t * blocks, x + t * K, K);
    const int64_t strips = N / STRIP;
    const int nt = threads < 1 ? 1 : threads < strips ? threads : (int)strips;
#pragma omp parallel num_threads(nt) if (nt > 1 && T * N * K > (1 << 18))
    {
        int64_t c0, cv, c1;
#ifdef _OPENMP
        q3_int4_thread_columns(N, STRIP, omp_get_thread_num(), omp_get_num_threads(), &c0, &cv, &c1);
#else
        q3_int4_thread_columns(N, STRIP, 0, 1, &c0, &cv, &c1);
#endif
        if (!accumulate)
            for (int64_t t = 0; t < T; t++) memset(y + t * N + c0, 0, (size_t)(c1 - c0) * sizeof *y);
        int32_t zs[TOKENS];
        for (int64_t u = 0; u < units; u++) {
            const int64_t r0 = u * unit / 8, r1 = (u + 1) * unit / 8, g = u * unit / w->group;
            for (int64_t t0 = 0; t0 < T; t0 += TOKENS) {
                const int n_tok = (int)(T - t0 < TOKENS ? T - t0 : TOKENS);
                for (int t = 0; t < n_tok; t++) { /* each token's 256 sum hi + sum lo over the unit */
                    int32_t shi, slo;
                    digit_sums(xq + (t0 + t) * (K / 8) * 16, r0, r1, &shi, &slo);
                    zs[t] = 256 * shi + slo;
                }
                for (int64_t n = c0; n < cv; n += STRIP)
                    strip(y + t0 * N, xq + t0 * (K / 8) * 16, sx + t0 * blocks, zs, w, N, K, blocks, r0, r1, g, n,
                          n_tok);
            }
        }
        q3_int4_columns_exact(y, x, w, T, N, K, cv, c1); /* past the last strip: exact in fp32 */
    }
    return 1;
}

void q3_matmul_int4_sdot_cpu_neon_bf16(float *y, const float *x, const q3_int4_matrix *w, int64_t T, int64_t N,
                                       int64_t K, int accumulate, float *scratch, int threads, uint16_t *xb) {
    if (T < Q3_INT4_GEMV_MAX_T && gemv_sdot(y, x, w, T, N, K, accumulate, threads, xb)) return;
    if (T >= Q3_INT4_GEMV_MAX_T && xb && N > 0 && K > 0) {
        q3_int4_prefill_bfmmla(y, x, w, T, N, K, accumulate, scratch, threads < 1 ? 1 : threads, xb);
        return;
    }
    q3_matmul_int4_cpu_neon_bf16(y, x, w, T, N, K, accumulate, scratch, threads, xb);
}
#endif
