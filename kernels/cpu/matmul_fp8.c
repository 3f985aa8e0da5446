/* y [T, N] (+)= x [T, K] W^T with W block-scaled e4m3 (kernels/fp8.h): weights converted to
 * fp32 in registers as they stream, one multiply by the block's scale per 128 columns.
 *
 * Decode (T < Q3_FP8_GEMV_MAX_T): threads split the weight rows; a row's bytes are read once
 * and each converted vector serves up to 4 tokens (groups of 4 re-read the row from L1). One
 * row at a time is one short stream that the hardware prefetcher did not keep ahead of: each
 * 128-byte block prefetches the bytes FP8_PREFETCH ahead (2048; 1024-4096 measured alike),
 * which took a [1536, 4096] GEMV on an Intel Xeon (2 threads) from 9 to 14-15 GB/s.
 * Prefill, avx2 and avx512: the packed matmul (matmul_packed.h) with pack_e4m3 as its panel
 * source, the weights decoded and scaled into each panel in L1 once per token block, as bf16
 * weights are converted: the same cost as bf16 less half the bytes. Portable: chunks of
 * Q3_FP8_CHUNK_ROWS rows dequantized to fp32 into a thread's scratch and the fp32 matmul.
 *
 * In the portable variant only, at the end: the twins of kernels/cuda/matmul_fp8.cu (twins.h). */
#include <math.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "matmul_amx.h"
#include "matmul_fp8_vbmi.h"
#include "matmul_packed.h"
#include "ops.h"
#include "thread_scratch.h"
#include "twins.h"
#include "vec.h"

#if Q3_LANES == 8 && defined(__F16C__)
#include <immintrin.h>
/* AVX2 + F16C: e4m3 S EEEE MMM placed as fp16 S 0EEEE MMM0000000 is the same value times
 * 2^-8 (fp16 bias 15 = 7 + 8), subnormals included, and vcvtph2ps widens it exactly. From
 * the sign-extended byte, << 7 puts S at bit 15 and a copy at bit 14 (masked off). NaN
 * (|byte| = 0x7f -> fp16 0x3f80) gets the exponent all ones. 4 integer ops and one
 * conversion per 8 weights. Measured here (AMD EPYC, AVX2, one thread, a [1536, 4096] GEMV
 * from L3): 690 us against 2970 us for a 256-entry fp32 table read by _mm256_i32gather_ps. */
#define UNIT 256.0f /* the vector values are the weights / UNIT; the block scale takes it back */
static inline q3_vf e4m3_v(const uint8_t *p) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), _mm_set1_epi16((short)0xbf80));
    const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7fff)), _mm_set1_epi16(0x3f80));
    h = _mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x7c00)));
    return (q3_vf)_mm256_cvtph_ps(h);
}
/* NaN codes seen by e4m3_v2: the bytes' magnitudes (low 7 bits) maxed in; a NaN code is one
 * of 0x7f. Two 16-byte ops a load, where a second pass over the row (row_has_nan) had cost the
 * GEMV 12% on an AMD EPYC (Zen 1, one thread: 3.92 -> 4.44 G weights/s without it) */
typedef __m128i nan_acc;
#define NAN_IN_LOOP 1
static inline nan_acc nan_acc_zero(void) { return _mm_setzero_si128(); }
static inline int nan_acc_any(nan_acc m) {
    return _mm_movemask_epi8(_mm_cmpeq_epi8(m, _mm_set1_epi8(0x7f))) != 0;
}
/* the GEMV's pair: 16 weights, NaN codes left as 480 / UNIT (their bytes maxed into *seen):
 * each half widened, shifted and masked in 16-byte ops, 2 conversions. The same over one ymm
 * and an extract ran 4-5% slower on an AMD EPYC (Zen 1, which splits a 256-bit op in two: one
 * thread, [1536, 4096] from memory 4.31-4.39 against 4.41-4.60 G weights/s) */
static inline void e4m3_v2(const uint8_t *p, q3_vf *lo, q3_vf *hi, nan_acc *seen) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), keep = _mm_set1_epi16((short)0xbf80);
    *seen = _mm_max_epu8(*seen, _mm_and_si128(b, _mm_set1_epi8(0x7f)));
    *lo = (q3_vf)_mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), keep));
    *hi = (q3_vf)_mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(_mm_unpackhi_epi64(b, b)), 7), keep));
}
#elif Q3_LANES == 16 && defined(__AVX512BW__)
#include <immintrin.h>
/* AVX-512 (F + BW): the AVX2 construction above at twice the width: 16 e4m3 bytes widened to
 * 16 fp16 words in a ymm, 32 in a zmm (vpmovsxbw), and vcvtph2ps to fp32 (exact). Compiled
 * here; not run on this project's AVX2 machines (tests/fp8/test_fp8_kernels.py runs it wherever
 * the CPU has the avx512 path). */
#define UNIT 256.0f
static inline q3_vf e4m3_v(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16((short)0xbf80));
    const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7fff)), _mm256_set1_epi16(0x3f80));
    h = _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7c00)));
    return (q3_vf)_mm512_cvtph_ps(h);
}
typedef __m256i nan_acc; /* as in the AVX2 variant, 32 bytes a load */
#define NAN_IN_LOOP 1
static inline nan_acc nan_acc_zero(void) { return _mm256_setzero_si256(); }
static inline int nan_acc_any(nan_acc m) {
    return _mm256_movemask_epi8(_mm256_cmpeq_epi8(m, _mm256_set1_epi8(0x7f))) != 0;
}
static inline void e4m3_v2(const uint8_t *p, q3_vf *lo, q3_vf *hi, nan_acc *seen) {
    const __m256i b = _mm256_loadu_si256((const __m256i *)p);
    *seen = _mm256_max_epu8(*seen, _mm256_and_si256(b, _mm256_set1_epi8(0x7f)));
    const __m512i h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 7),
                                       _mm512_set1_epi16((short)0xbf80));
    *lo = (q3_vf)_mm512_cvtph_ps(_mm512_castsi512_si256(h));
    *hi = (q3_vf)_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}
#elif Q3_LANES == 4 && defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
/* NEON (the neon and sve variants): the AVX2 construction above, fp16 in between. 8 e4m3 bytes
 * sign-extended to 16-bit lanes (sxtl), << 7 and masked to fp16 S 0EEEE MMM0000000 (the value
 * times 2^-8, subnormals included), widened to fp32 exactly (fcvtl, fcvtl2): 4 integer ops
 * and 2 conversions per 8 weights, against the generic path's dozen a 4. */
#define UNIT 256.0f
static inline int16x8_t e4m3_halves(int8x8_t b) {
    return vandq_s16(vshlq_n_s16(vmovl_s8(b), 7), vdupq_n_s16((int16_t)0xbf80));
}
static inline q3_vf e4m3_v(const uint8_t *p) {
    uint32_t four;
    memcpy(&four, p, sizeof four);
    int16x8_t h = e4m3_halves(vreinterpret_s8_u32(vdup_n_u32(four)));
    const uint16x8_t nan = vceqq_s16(vandq_s16(h, vdupq_n_s16(0x7fff)), vdupq_n_s16(0x3f80));
    h = vorrq_s16(h, vandq_s16(vreinterpretq_s16_u16(nan), vdupq_n_s16(0x7c00)));
    return (q3_vf)vcvt_f32_f16(vreinterpret_f16_s16(vget_low_s16(h)));
}
typedef uint8x8_t nan_acc; /* the bytes' magnitudes maxed, as in the AVX2 variant */
#define NAN_IN_LOOP 1
static inline nan_acc nan_acc_zero(void) { return vdup_n_u8(0); }
static inline int nan_acc_any(nan_acc m) { return vmaxv_u8(m) == 0x7f; }
static inline void e4m3_v2(const uint8_t *p, q3_vf *lo, q3_vf *hi, nan_acc *seen) {
    const uint8x8_t b = vld1_u8(p);
    *seen = vmax_u8(*seen, vand_u8(b, vdup_n_u8(0x7f)));
    const int16x8_t h = e4m3_halves(vreinterpret_s8_u8(b));
    *lo = (q3_vf)vcvt_f32_f16(vreinterpret_f16_s16(vget_low_s16(h)));
    *hi = (q3_vf)vcvt_high_f32_f16(vreinterpretq_f16_s16(h));
}
#else
/* Generic vectors (every other variant): the fp32 bits built with integer ops, no
 * subnormal fp32 on the way (they are slow on some CPUs). E > 0: exponent E + 120, mantissa
 * M << 20. E = 0 is read as E = 1 with the implicit 1, giving 2^-6 (1 + M/8), and 2^-6 is
 * subtracted: M 2^-9 exactly. */
#define UNIT 1.0f
#if Q3_LANES == 4 && defined(__SSE2__)
#include <emmintrin.h>
#endif
typedef uint8_t vbytes __attribute__((vector_size(Q3_LANES)));
typedef uint32_t q3_vu __attribute__((vector_size(Q3_VBYTES)));
/* Q3_LANES bytes zero-extended to 32-bit lanes (GCC scalarizes the SSE2 convertvector) */
static inline q3_vu widen(const uint8_t *p) {
#if Q3_LANES == 4 && defined(__SSE2__)
    int32_t w;
    memcpy(&w, p, sizeof w);
    const __m128i z = _mm_setzero_si128();
    return (q3_vu)_mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(w), z), z);
#else
    vbytes b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, q3_vu);
#endif
}
/* with_nan = 0 (the GEMV, which checks rows for NaN codes instead): NaN codes give 480 */
static inline q3_vf e4m3_conv(const uint8_t *p, const int with_nan) {
    const q3_vu u = widen(p), mag = u & 0x7fu;
    const q3_vu sub = (q3_vu)((mag & 0x78u) == 0);
    const q3_vu bits = ((mag + (sub & 8u)) << 20) + (120u << 23);
    const q3_vf f = (q3_vf)bits - (q3_vf)(sub & 0x3c800000u); /* 0x3c800000 = 2^-6 */
    const q3_vu r = (q3_vu)f | ((u & 0x80u) << 24);
    return (q3_vf)(with_nan ? r | ((q3_vu)(mag == 0x7fu) & 0x7fc00000u) : r);
}
static inline q3_vf e4m3_v(const uint8_t *p) { return e4m3_conv(p, 1); }
typedef int nan_acc; /* unused: the GEMV checks each row once (row_has_nan) */
#define NAN_IN_LOOP 0
static inline nan_acc nan_acc_zero(void) { return 0; }
static inline int nan_acc_any(nan_acc m) { return m; }
static inline void e4m3_v2(const uint8_t *p, q3_vf *lo, q3_vf *hi, nan_acc *seen) {
    (void)seen;
    *lo = e4m3_conv(p, 0);
    *hi = e4m3_conv(p + Q3_LANES, 0);
}
#endif

/* whether a row of K e4m3 bytes holds a NaN code (S 1111 111): 32 bytes a step */
static int row_has_nan(const uint8_t *wr, int64_t K) {
    typedef uint8_t v32 __attribute__((vector_size(32)));
    v32 any = {0};
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        v32 b;
        memcpy(&b, wr + k, sizeof b);
        any |= (v32)((b & 0x7f) == 0x7f);
    }
    int r = 0;
    for (int i = 0; i < 32; i++) r |= any[i];
    for (; k < K; k++) r |= (wr[k] & 0x7f) == 0x7f;
    return r;
}

#ifndef FP8_PREFETCH
#define FP8_PREFETCH 2048 /* bytes ahead in a weight row (the GEMV) */
#endif

static inline float hsum(q3_vf v) {
    float s = 0;
    for (int i = 0; i < Q3_LANES; i++) s += v[i];
    return s;
}

/* y[t, n] for tokens t < NT (<= 4; x, y at the group's first token) of one weight row wr [K];
 * srow: the row's scales [ceil(K/128)]. Two vector accumulators per token (two FMA chains). */
static inline __attribute__((always_inline)) void gemv_row(float *y, const float *x, const uint8_t *wr,
                                                            const void *scale, q3_dtype sdt, int64_t srow,
                                                            int64_t N, int64_t K, int acc, const int NT) {
    q3_vf tot[4] = {0}, a0[4], a1[4];
    float tail[4] = {0};
    nan_acc seen = nan_acc_zero();
    for (int64_t k0 = 0; k0 < K; k0 += Q3_FP8_BLOCK) {
        const int64_t k1 = k0 + Q3_FP8_BLOCK < K ? k0 + Q3_FP8_BLOCK : K;
        const float s = q3_fp8_scale_at(scale, sdt, srow + k0 / Q3_FP8_BLOCK);
        /* the block's two cache lines FP8_PREFETCH bytes ahead (into the next rows at a row's end,
         * past the matrix at its end: a prefetch never faults) */
        __builtin_prefetch(wr + k0 + FP8_PREFETCH);
        __builtin_prefetch(wr + k0 + FP8_PREFETCH + 64);
        for (int t = 0; t < NT; t++) a0[t] = a1[t] = q3_vsplat(0);
        int64_t k = k0;
        for (; k + 2 * Q3_LANES <= k1; k += 2 * Q3_LANES) {
            q3_vf w0, w1;
            e4m3_v2(wr + k, &w0, &w1, &seen);
            for (int t = 0; t < NT; t++) {
                a0[t] += q3_vload(x + t * K + k) * w0;
                a1[t] += q3_vload(x + t * K + k + Q3_LANES) * w1;
            }
        }
        for (; k + Q3_LANES <= k1; k += Q3_LANES) {
            const q3_vf w0 = e4m3_v(wr + k);
            for (int t = 0; t < NT; t++) a0[t] += q3_vload(x + t * K + k) * w0;
        }
        for (int t = 0; t < NT; t++) tot[t] += (a0[t] + a1[t]) * (s * UNIT);
        for (; k < k1; k++) {
            const float w = q3_e4m3_to_f32(wr[k]) * s;
            for (int t = 0; t < NT; t++) tail[t] += x[t * K + k] * w;
        }
    }
    /* a NaN weight: NaN out (e4m3_v and the scalar tail give NaN themselves) */
    const float nan = (NAN_IN_LOOP ? nan_acc_any(seen) : row_has_nan(wr, K)) ? NAN : 0.0f;
    for (int t = 0; t < NT; t++) y[t * N] = (acc ? y[t * N] : 0.0f) + hsum(tot[t]) + tail[t] + nan;
}

static void gemv(float *y, const float *x, const uint8_t *w, const void *scale, q3_dtype sdt, int64_t T,
                 int64_t N, int64_t K, int acc, int threads) {
    const int64_t kb = q3_fp8_blocks(K);
#pragma omp parallel for schedule(static) num_threads(threads) if (T * N * K > (1 << 18))
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wr = w + n * K;
        const int64_t srow = n / Q3_FP8_BLOCK * kb;
        for (int64_t t = 0; t < T; t += 4) {
            float *yt = y + t * N + n;
            const float *xt = x + t * K;
            switch (T - t < 4 ? T - t : 4) { /* constant NT: the accumulators stay in registers */
            case 1: gemv_row(yt, xt, wr, scale, sdt, srow, N, K, acc, 1); break;
            case 2: gemv_row(yt, xt, wr, scale, sdt, srow, N, K, acc, 2); break;
            case 3: gemv_row(yt, xt, wr, scale, sdt, srow, N, K, acc, 3); break;
            default: gemv_row(yt, xt, wr, scale, sdt, srow, N, K, acc, 4); break;
            }
        }
    }
}

#if !(defined(__AVX2__) && defined(__FMA__))
/* dst [K] fp32 <- weight row wr [K] times its block scales (srow as in gemv_row) */
static void dequant_row(float *dst, const uint8_t *wr, const void *scale, q3_dtype sdt, int64_t srow, int64_t K) {
    for (int64_t k0 = 0; k0 < K; k0 += Q3_FP8_BLOCK) {
        const int64_t k1 = k0 + Q3_FP8_BLOCK < K ? k0 + Q3_FP8_BLOCK : K;
        const float s = q3_fp8_scale_at(scale, sdt, srow + k0 / Q3_FP8_BLOCK);
        int64_t k = k0;
        for (; k + Q3_LANES <= k1; k += Q3_LANES) q3_vstore(dst + k, e4m3_v(wr + k) * (s * UNIT));
        for (; k < k1; k++) dst[k] = q3_e4m3_to_f32(wr[k]) * s;
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
typedef struct {
    const uint8_t *w; /* [N, K] e4m3 */
    const void *scale;
    q3_dtype sdt;
    int64_t K, kb; /* kb: scale blocks a row of blocks */
} e4m3_rows;

/* the FP8 panel source of the packed matmul (matmul_packed.h): panel [nr][ldp] fp32 <- the
 * weights of rows [n0, n0 + nr) x columns [k0, k0 + kc), each 128-column stretch times its
 * block's scale (the rows of a panel may straddle two row blocks: each row its own) */
static void pack_e4m3(float *panel, int64_t ldp, const void *src, int64_t n0, int nr, int64_t k0, int64_t kc) {
    const e4m3_rows *m = src;
    for (int r = 0; r < nr; r++) {
        const uint8_t *wr = m->w + (n0 + r) * m->K;
        const int64_t srow = (n0 + r) / Q3_FP8_BLOCK * m->kb;
        float *out = panel + r * ldp; /* out[k - k0]: column k */
        /* e4m3_v2 (two vectors a load, NaN codes read as 480) unless this stretch of the row
         * holds a NaN code: a check of its bytes costs less than the NaN-aware conversion */
        const int nan = row_has_nan(wr + k0, kc);
        for (int64_t b0 = k0; b0 < k0 + kc;) {
            const int64_t b1 = (b0 / Q3_FP8_BLOCK + 1) * Q3_FP8_BLOCK < k0 + kc ? (b0 / Q3_FP8_BLOCK + 1) * Q3_FP8_BLOCK
                                                                              : k0 + kc;
            const float s = q3_fp8_scale_at(m->scale, m->sdt, srow + b0 / Q3_FP8_BLOCK);
            const q3_vf sv = q3_vsplat(s * UNIT);
            int64_t k = b0;
            for (; !nan && k + 2 * Q3_LANES <= b1; k += 2 * Q3_LANES) {
                q3_vf lo, hi;
                nan_acc unused = nan_acc_zero(); /* the stretch was checked */
                e4m3_v2(wr + k, &lo, &hi, &unused);
                q3_vstore(out + (k - k0), lo * sv);
                q3_vstore(out + (k - k0) + Q3_LANES, hi * sv);
            }
            for (; k + Q3_LANES <= b1; k += Q3_LANES) q3_vstore(out + (k - k0), e4m3_v(wr + k) * sv);
            for (; k < b1; k++) out[k - k0] = q3_e4m3_to_f32(wr[k]) * s;
            b0 = b1;
        }
    }
}
#endif

void Q3_CPU_FN(q3_matmul_fp8)(float *y, const float *x, const uint8_t *w, const void *scale, q3_dtype sdt,
                              int64_t T, int64_t N, int64_t K, int accumulate, float *scratch, int threads,
                              uint16_t *xb) {
    (void)xb; /* x stays fp32 */
    if (T < Q3_FP8_GEMV_MAX_T) {
        gemv(y, x, w, scale, sdt, T, N, K, accumulate, threads);
        return;
    }
#if defined(__AVX2__) && defined(__FMA__)
    /* avx2, avx512: e4m3 decoded into the packed matmul's panels, once per token block */
    (void)scratch;
    const e4m3_rows m = {w, scale, sdt, K, q3_fp8_blocks(K)};
    const q3_panel_source src = {pack_e4m3, &m, w, K, 1};
    Q3_CPU_FN(q3_matmul_packed_from)(y, x, &src, T, N, K, accumulate, threads);
#else
    /* One parallel region: each thread takes chunks of rows whole (dequantize, multiply, add
     * out) in its own scratch, so there is no barrier per chunk; the fp32 matmul called in it
     * runs on the calling thread (nested regions are inactive). x [T, K] is re-read from
     * cache per chunk: 4 T K bytes against 2 T K CHUNK_ROWS flops. */
    const int64_t kb = q3_fp8_blocks(K), chunks = (N + Q3_FP8_CHUNK_ROWS - 1) / Q3_FP8_CHUNK_ROWS;
    const int64_t per_thread = q3_matmul_fp8_scratch_floats(T, K);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (chunks > 1)
    for (int64_t c = 0; c < chunks; c++) {
        float *tile = q3_thread_scratch(scratch, per_thread);
        float *yt = tile + Q3_FP8_CHUNK_ROWS * K; /* [T, nr] */
        const int64_t n0 = c * Q3_FP8_CHUNK_ROWS;
        const int64_t nr = N - n0 < Q3_FP8_CHUNK_ROWS ? N - n0 : Q3_FP8_CHUNK_ROWS;
        for (int64_t i = 0; i < nr; i++)
            dequant_row(tile + i * K, w + (n0 + i) * K, scale, sdt, (n0 + i) / Q3_FP8_BLOCK * kb, K);
        Q3_CPU_FN(q3_matmul)(yt, x, tile, Q3_F32, T, nr, K, 0, NULL);
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < nr; i++)
                y[t * N + n0 + i] = (accumulate ? y[t * N + n0 + i] : 0.0f) + yt[t * nr + i];
    }
#endif
}

#if Q3_LANES == 16 && defined(__AVX512BW__)
/* The FP8 prefill on AMX (the "amx" level of this variant): the AMX matmul (matmul_amx.h)
 * with rows_e4m3_bf16 as its row source. Each weight times its block scale is rounded to
 * bf16 (to nearest even), as the CUDA prefill's dequantization does, and x to bf16, as the
 * bf16 paths do; sums in fp32. Without xb, or off the tiles' shapes (N % 16, K % 32), and for
 * decode-sized T: this variant's FP8 matmul. */
#define BF16_CVT __attribute__((target("avx512bf16")))
#define CODES8(n) n, n + 1, n + 2, n + 3, n + 4, n + 5, n + 6, n + 7
#define CODES32(n) CODES8(n), CODES8(n + 8), CODES8(n + 16), CODES8(n + 24)
static const uint8_t magnitude_codes[128] = {CODES32(0), CODES32(32), CODES32(64), CODES32(96)};

/* t[q] word i = bf16(e4m3 code 32 q + i times s), rounded to nearest even: the 128 magnitudes
 * (NaN at 0x7f) of one scale block, built with the NaN-aware vector conversion */
static inline BF16_CVT void magnitude_tables(__m512i t[4], float s) {
    const q3_vf sv = q3_vsplat(s * UNIT);
    for (int q = 0; q < 4; q++) {
        const q3_vf lo = e4m3_v(magnitude_codes + 32 * q) * sv, hi = e4m3_v(magnitude_codes + 32 * q + 16) * sv;
        t[q] = (__m512i)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo);
    }
}

/* the row source of the AMX matmul (matmul_amx.h): out [nr][kc] bf16 (row stride ld) <- rows
 * [n0, n0 + nr) x columns [k0, k0 + kc) of the weights times their block scales. A 128-code
 * table per scale block (the rows lie in one row of scale blocks: the source's contract) makes each 32
 * weights a table lookup: two word permutes over the four tables' pairs, a blend on code bit 6
 * and the sign bit ORed in; -bf16(v) = bf16(-v), and NaN codes find NaN. */
_Static_assert(Q3_ROWS_ALIGN == Q3_FP8_BLOCK, "a row source's rows share one row of scale blocks");
static BF16_CVT void rows_e4m3_bf16(uint16_t *out, int64_t ld, const void *src, int64_t n0, int nr, int64_t k0,
                                   int64_t kc) {
    const e4m3_rows *m = src;
    const int64_t K = m->K, srow = n0 / Q3_FP8_BLOCK * m->kb;
    if (!out) {
        for (int r = 0; r < nr; r++)
            for (int64_t k = k0; k < k0 + kc; k += 64) _mm_prefetch((const char *)(m->w + (n0 + r) * K + k), _MM_HINT_T1);
        return;
    }
    const __m512i bit6 = _mm512_set1_epi16(0x40), sign = _mm512_set1_epi16((short)0x8000);
    for (int64_t b0 = k0; b0 < k0 + kc;) {
        const int64_t end = (b0 / Q3_FP8_BLOCK + 1) * Q3_FP8_BLOCK, b1 = end < k0 + kc ? end : k0 + kc;
        __m512i t[4];
        magnitude_tables(t, q3_fp8_scale_at(m->scale, m->sdt, srow + b0 / Q3_FP8_BLOCK));
        for (int r = 0; r < nr; r++) {
            const uint8_t *wr = m->w + (n0 + r) * K;
            uint16_t *o = out + r * ld; /* o[k - k0]: column k */
            for (int64_t k = b0; k < b1; k += 32) {
                const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wr + k)));
                const __m512i lo = _mm512_permutex2var_epi16(t[0], c, t[1]); /* codes 0-63 by bits 0-5 */
                const __m512i hi = _mm512_permutex2var_epi16(t[2], c, t[3]); /* codes 64-127 */
                const __m512i v = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(c, bit6), lo, hi);
                /* v | (c << 8 & 0x8000): the code's sign bit */
                _mm512_storeu_si512(o + (k - k0), _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(c, 8), sign, 0xF8));
            }
        }
        b0 = b1;
    }
}

void q3_matmul_fp8_cpu_amx(float *y, const float *x, const uint8_t *w, const void *scale, q3_dtype sdt, int64_t T,
                           int64_t N, int64_t K, int accumulate, float *scratch, int threads, uint16_t *xb) {
    if (T < Q3_FP8_GEMV_MAX_T || !xb || !scratch || N % 16 || K % 32) {
        q3_matmul_fp8_cpu_avx512(y, x, w, scale, sdt, T, N, K, accumulate, scratch, threads, xb);
        return;
    }
    const e4m3_rows m = {w, scale, sdt, K, q3_fp8_blocks(K)};
    /* a thread's scratch, 2 * Q3_FP8_CHUNK_ROWS * (K + T) bf16, holds its Q3_AMX_ROWS * K rows */
    q3_matmul_amx_from(y, x, rows_e4m3_bf16, &m, T, N, K, accumulate, xb, (uint16_t *)scratch,
                       2 * q3_matmul_fp8_scratch_floats(T, K), threads);
}

/* The FP8 matmul on the avx512bf16 level from FP8_DOT_MIN_TOKENS tokens: the same row source
 * and rounding as on AMX, the bf16 dot products of matmul_dot.c; fewer tokens: the GEMV on
 * VBMI byte lookups (matmul_fp8_vbmi.c) where the CPU has VBMI; otherwise, and with no xb or
 * K % 32: this variant's. Each token's x streams past every weight row in the GEMV (in fp32
 * it leaves L1 from 3 tokens of K = 4096), so from 4 tokens the dot products' bf16 panels,
 * converted once for all the tokens, win: on an AMD Zen 4 (2 threads, GB/s of FP8 bytes from
 * memory, expert and o_proj shapes; the GEMV's x in fp32, as before it took bf16 x below 4
 * tokens) GEMV against dot products 13-16 against 9-15 at 3 tokens, 10-16 against 16-23 at 4,
 * 5-6 against 13-16 at 8, 2-4 against 9-12.5 at 12 (bench_fp8_gemv.py). */
#define FP8_DOT_MIN_TOKENS 4
void q3_matmul_fp8_cpu_avx512bf16(float *y, const float *x, const uint8_t *w, const void *scale, q3_dtype sdt,
                                  int64_t T, int64_t N, int64_t K, int accumulate, float *scratch, int threads,
                                  uint16_t *xb) {
    static int vbmi = -1;
    if (__atomic_load_n(&vbmi, __ATOMIC_RELAXED) < 0) __atomic_store_n(&vbmi, q3_cpu_has_vbmi(), __ATOMIC_RELAXED);
    if (T < FP8_DOT_MIN_TOKENS && __atomic_load_n(&vbmi, __ATOMIC_RELAXED)) {
        q3_fp8_gemv_vbmi(y, x, w, scale, sdt, T, N, K, accumulate, threads, xb != NULL); /* xb: may round x */
        return;
    }
    if (T < FP8_DOT_MIN_TOKENS || !xb || K % 32) {
        q3_matmul_fp8_cpu_avx512(y, x, w, scale, sdt, T, N, K, accumulate, scratch, threads, xb);
        return;
    }
    const e4m3_rows m = {w, scale, sdt, K, q3_fp8_blocks(K)};
    q3_matmul_dot_from(y, x, rows_e4m3_bf16, &m, w, K, 1, T, N, K, accumulate, xb, threads);
}
#endif

#if Q3_CPU_TWINS
/* the CUDA GEMV's twin: this matmul with its scratch, one thread */
int q3_matmul_fp8_host(float *y, const float *x, const uint8_t *w, const void *scale, q3_dtype sdt, int64_t T,
                       int64_t N, int64_t K, int accumulate) {
    const int64_t n = q3_matmul_fp8_scratch_floats(T, K);
    float *scratch = n ? malloc((size_t)n * sizeof(float)) : NULL;
    if (n && !scratch) return 1;
    q3_matmul_fp8_cpu_portable(y, x, w, scale, sdt, T, N, K, accumulate, scratch, 1, NULL);
    free(scratch);
    return 0;
}

/* the dequantization kernel's twin: kernels/fp8.h's scalar dequantization, rounded to bf16 */
int q3_fp8_dequant_host(uint16_t *dst, const uint8_t *w, const void *scale, q3_dtype sdt, int64_t N, int64_t K) {
    float *row = malloc((size_t)(K ? K : 1) * sizeof(float));
    if (!row) return 1;
    for (int64_t n = 0; n < N; n++) {
        q3_fp8_dequant_rows(row, w, scale, sdt, n, 1, K);
        for (int64_t j = 0; j < K; j++) dst[n * K + j] = q3_f32_to_bf16(row[j]);
    }
    free(row);
    return 0;
}
#endif
