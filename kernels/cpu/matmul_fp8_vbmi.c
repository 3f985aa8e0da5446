/* The FP8 decode GEMV of the avx512bf16 level on a CPU with AVX512-VBMI (the avx512 variant
 * only; matmul_fp8.c's q3_matmul_fp8_cpu_avx512bf16 calls it below Q3_FP8_GEMV_MAX_T tokens):
 * y [T, N] (+)= x [T, K] W^T, W block-scaled e4m3 (kernels/fp8.h), x and the sums in fp32.
 *
 * 64 codes a step: their bytes put in the order the unpacks below undo (vpermb), then two
 * byte lookups (vpermi2b over 128-entry tables) give the high and the low byte of each code's
 * magnitude as bf16 (exact: e4m3 has 3 mantissa bits; NaN codes give NaN), the sign ORed into
 * the high byte, and unpacks and shifts place them as 4 x 16 fp32 lanes in column order:
 * 10 vector operations for 64 weights, where matmul_fp8.c's fp16 construction takes 16 and
 * tracks NaN codes beside it. Rows split over threads as there; each row's bytes read once,
 * each decoded vector serving up to 4 tokens. On an AMD Zen 4 (2 threads, 256-bit datapaths)
 * the fp16 construction had bound the FP8 decode at ~27 GB/s of weights from memory, below the
 * ~34 GB/s read probe. */
#include "matmul_fp8_vbmi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#include <pthread.h>
#include <string.h>

#include "../fp8.h"

#define VBMI_TARGET __attribute__((target("avx512vbmi")))

/* bf16 high and low bytes of each magnitude m < 128 (m = 127: NaN 0x7fc0), and the byte order
 * of a step: byte q of the reordered 64 is column step_order[q] */
static uint8_t mag_high[128] __attribute__((aligned(64))), mag_low[128] __attribute__((aligned(64)));
static uint8_t step_order[64] __attribute__((aligned(64)));
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

static void make_tables(void) { /* once, by pthread_once: no two threads write them */
    for (int m = 0; m < 128; m++) {
        const float f = q3_e4m3_to_f32((uint8_t)m);
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        if (m == 127) u = 0x7fc00000u;
        mag_high[m] = (uint8_t)(u >> 24);
        mag_low[m] = (uint8_t)(u >> 16);
    }
    /* unpacklo/hi of bytes then even/odd words leave, in 128-bit lane l of output v, the
     * columns 16 l + 8 (v >> 1) + (v & 1) + {0, 2, 4, 6} of the step's bytes as loaded; so the
     * byte that output v's lane l, element i (column 16 v + 4 l + i) needs sits at that place */
    for (int v = 0; v < 4; v++)
        for (int l = 0; l < 4; l++)
            for (int i = 0; i < 4; i++) {
                const int from = 16 * l + 8 * (v >> 1) + (v & 1) + 2 * i; /* where unpacking reads */
                step_order[from] = (uint8_t)(16 * v + 4 * l + i);
            }
}

typedef struct {
    __m512i hi0, hi1, lo0, lo1, order;
} vbmi_tables;

/* o[v] = the fp32 weights of columns 16 v .. 16 v + 15 of the 64 codes at p */
static inline __attribute__((always_inline)) VBMI_TARGET void decode64(const uint8_t *p, const vbmi_tables *t,
                                                                       __m512 o[4]) {
    const __m512i c = _mm512_permutexvar_epi8(t->order, _mm512_loadu_si512(p));
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t->hi0, c, t->hi1), c,
                                                 _mm512_set1_epi8((char)0x80), 0xf8); /* hi | (c & 0x80) */
    const __m512i lo = _mm512_permutex2var_epi8(t->lo0, c, t->lo1);
    const __m512i wa = _mm512_unpacklo_epi8(lo, hi), wb = _mm512_unpackhi_epi8(lo, hi);
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
    o[0] = _mm512_castsi512_ps(_mm512_slli_epi32(wa, 16));
    o[1] = _mm512_castsi512_ps(_mm512_and_si512(wa, top));
    o[2] = _mm512_castsi512_ps(_mm512_slli_epi32(wb, 16));
    o[3] = _mm512_castsi512_ps(_mm512_and_si512(wb, top));
}

/* y[t * N] for tokens t < NT (<= 4) of one row wr [K]; srow: the row's scales. Two
 * accumulators a token within a scale block, added into tot times the block's scale. */
static inline __attribute__((always_inline)) VBMI_TARGET void row_vbmi(float *y, const float *x, const uint8_t *wr,
                                                                       const void *scale, q3_dtype sdt, int64_t srow,
                                                                       int64_t N, int64_t K, int acc,
                                                                       const vbmi_tables *tb, const int NT) {
    __m512 tot[4], a0[4], a1[4];
    float tail[4] = {0};
    for (int t = 0; t < NT; t++) tot[t] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += Q3_FP8_BLOCK) {
        const int64_t k1 = k0 + Q3_FP8_BLOCK < K ? k0 + Q3_FP8_BLOCK : K;
        const float s = q3_fp8_scale_at(scale, sdt, srow + k0 / Q3_FP8_BLOCK);
        /* 2048 bytes ahead, as matmul_fp8.c's GEMV: into the next rows at a row's end */
        _mm_prefetch((const char *)wr + k0 + 2048, _MM_HINT_T0);
        _mm_prefetch((const char *)wr + k0 + 2048 + 64, _MM_HINT_T0);
        for (int t = 0; t < NT; t++) a0[t] = a1[t] = _mm512_setzero_ps();
        int64_t k = k0;
        for (; k + 64 <= k1; k += 64) {
            __m512 o[4];
            decode64(wr + k, tb, o);
            for (int t = 0; t < NT; t++) {
                const float *xt = x + t * K + k;
                a0[t] = _mm512_fmadd_ps(_mm512_loadu_ps(xt), o[0], a0[t]);
                a1[t] = _mm512_fmadd_ps(_mm512_loadu_ps(xt + 16), o[1], a1[t]);
                a0[t] = _mm512_fmadd_ps(_mm512_loadu_ps(xt + 32), o[2], a0[t]);
                a1[t] = _mm512_fmadd_ps(_mm512_loadu_ps(xt + 48), o[3], a1[t]);
            }
        }
        for (int t = 0; t < NT; t++) tot[t] = _mm512_fmadd_ps(_mm512_add_ps(a0[t], a1[t]), _mm512_set1_ps(s), tot[t]);
        for (; k < k1; k++) { /* K % 64 (NaN codes give NaN here too) */
            const float w = q3_e4m3_to_f32(wr[k]) * s;
            for (int t = 0; t < NT; t++) tail[t] += x[t * K + k] * w;
        }
    }
    for (int t = 0; t < NT; t++) y[t * N] = (acc ? y[t * N] : 0.0f) + _mm512_reduce_add_ps(tot[t]) + tail[t];
}

VBMI_TARGET void q3_fp8_gemv_vbmi(float *y, const float *x, const uint8_t *w, const void *scale, q3_dtype sdt,
                                  int64_t T, int64_t N, int64_t K, int acc, int threads) {
    pthread_once(&tables_once, make_tables);
    const vbmi_tables tb = {_mm512_load_si512(mag_high), _mm512_load_si512(mag_high + 64),
                            _mm512_load_si512(mag_low), _mm512_load_si512(mag_low + 64),
                            _mm512_load_si512(step_order)};
    const int64_t kb = q3_fp8_blocks(K);
#pragma omp parallel for schedule(static) num_threads(threads) if (T * N * K > (1 << 18))
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wr = w + n * K;
        const int64_t srow = n / Q3_FP8_BLOCK * kb;
        for (int64_t t = 0; t < T; t += 4) {
            float *yt = y + t * N + n;
            const float *xt = x + t * K;
            switch (T - t < 4 ? T - t : 4) { /* constant NT: the accumulators stay in registers */
            case 1: row_vbmi(yt, xt, wr, scale, sdt, srow, N, K, acc, &tb, 1); break;
            case 2: row_vbmi(yt, xt, wr, scale, sdt, srow, N, K, acc, &tb, 2); break;
            case 3: row_vbmi(yt, xt, wr, scale, sdt, srow, N, K, acc, &tb, 3); break;
            default: row_vbmi(yt, xt, wr, scale, sdt, srow, N, K, acc, &tb, 4); break;
            }
        }
    }
}

int q3_cpu_has_vbmi(void) { return __builtin_cpu_supports("avx512vbmi"); }

#endif
