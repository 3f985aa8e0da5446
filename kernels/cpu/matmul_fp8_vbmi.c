/* The FP8 decode GEMV of the avx512bf16 level on a CPU with AVX512-VBMI (the avx512 variant
 * only; matmul_fp8.c's q3_matmul_fp8_cpu_avx512bf16 calls it below Q3_FP8_GEMV_MAX_T tokens):
 * y [T, N] (+)= x [T, K] W^T, W block-scaled e4m3 (kernels/fp8.h), x and the sums in fp32.
 *
 * 64 codes a step: their bytes put in the order the unpacks below undo (vpermb), then two
 * byte lookups (vpermi2b over 128-entry tables) give the high and the low byte of each code's
 * magnitude as bf16 (exact: e4m3 has 3 mantissa bits; NaN codes give NaN), the sign ORed into
 * the high byte, and unpacks and shifts place them as 4 x 16 fp32 lanes in column order:
 * 10 vector operations for 64 weights, where matmul_fp8.c's fp16 construction takes 16 and
 * tracks NaN codes beside it. Groups of rows split over threads; each row's bytes read once,
 * each decoded vector serving up to 4 tokens, each load of x up to 4 rows (where x's rows pass
 * half of L1d). On an AMD Zen 4 (2 threads, 256-bit datapaths) the fp16 construction had bound
 * the FP8 decode at ~27 GB/s of weights from memory, below the ~34 GB/s read probe. */
#include "matmul_fp8_vbmi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#include <pthread.h>
#include <string.h>

#include "../fp8.h"
#include "cache_sizes.h"

#define VBMI_TARGET __attribute__((target("avx512vbmi")))

/* bf16 high and low bytes of each magnitude m < 128 (m = 127: NaN 0x7fc0), and the byte order
 * of a step: byte q of the reordered 64 is column step_order[q] */
static uint8_t mag_high[128] __attribute__((aligned(64))), mag_low[128] __attribute__((aligned(64)));
static uint8_t step_order[64] __attribute__((aligned(64)));
static long l1d; /* bytes of L1 data cache */
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

static void make_tables(void) { /* once, by pthread_once: no two threads write them */
    long l2;
    q3_cache_sizes(&l1d, &l2);
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

/* y[t * N + r] for tokens t < NT and rows r < R (R NT <= 4) of the rows at wr [R, K], which
 * share a 128-row scale block (their first is a multiple of R; R divides 128): srow, its
 * scales. ahead <= K: the prefetch distance; wrap: a next group of R rows follows. The rows
 * share each load of x: at one token, 4 rows read 64 bytes of x (fp32) per
 * 64 bytes of weights, where one row read 256 and, with o_proj's K = 8192 (x 32 KiB, L1's
 * size on a Zen 4), took them from L2 at half the read rate. Two accumulators a sum within a
 * scale block, added into tot times the block's scale. */
static inline __attribute__((always_inline)) VBMI_TARGET void rows_vbmi(float *y, const float *x, const uint8_t *wr,
                                                                        const void *scale, q3_dtype sdt, int64_t srow,
                                                                        int64_t N, int64_t K, int acc,
                                                                        const vbmi_tables *tb, int64_t ahead,
                                                                        int wrap, const int R, const int NT) {
    __m512 tot[4], a0[4], a1[4];
    float tail[4] = {0};
    for (int i = 0; i < R * NT; i++) tot[i] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += Q3_FP8_BLOCK) {
        const int64_t k1 = k0 + Q3_FP8_BLOCK < K ? k0 + Q3_FP8_BLOCK : K;
        const float s = q3_fp8_scale_at(scale, sdt, srow + k0 / Q3_FP8_BLOCK);
        /* `ahead` bytes on in each row; past its end, on in the same row of the next group
         * (which its own stream reads next), not in row r + 1, which another stream has read */
        for (int r = 0; r < R; r++) {
            const int64_t at = k0 + ahead;
            if (at < K || wrap) {
                const char *p = (const char *)wr + (at < K ? r * K + at : (R + r) * K + (at - K));
                _mm_prefetch(p, _MM_HINT_T0);
                _mm_prefetch(p + 64, _MM_HINT_T0);
            }
        }
        for (int i = 0; i < R * NT; i++) a0[i] = a1[i] = _mm512_setzero_ps();
        int64_t k = k0;
        for (; k + 64 <= k1; k += 64) {
            __m512 xv[4][4]; /* with several rows, x loaded once for all; one row: the FMAs load it */
            if (R > 1)
                for (int t = 0; t < NT; t++)
                    for (int j = 0; j < 4; j++) xv[t][j] = _mm512_loadu_ps(x + t * K + k + 16 * j);
            for (int r = 0; r < R; r++) {
                __m512 o[4];
                decode64(wr + r * K + k, tb, o);
                for (int t = 0; t < NT; t++) {
                    const int i = r * NT + t;
                    const float *xt = x + t * K + k;
                    a0[i] = _mm512_fmadd_ps(R > 1 ? xv[t][0] : _mm512_loadu_ps(xt), o[0], a0[i]);
                    a1[i] = _mm512_fmadd_ps(R > 1 ? xv[t][1] : _mm512_loadu_ps(xt + 16), o[1], a1[i]);
                    a0[i] = _mm512_fmadd_ps(R > 1 ? xv[t][2] : _mm512_loadu_ps(xt + 32), o[2], a0[i]);
                    a1[i] = _mm512_fmadd_ps(R > 1 ? xv[t][3] : _mm512_loadu_ps(xt + 48), o[3], a1[i]);
                }
            }
        }
        for (int i = 0; i < R * NT; i++) tot[i] = _mm512_fmadd_ps(_mm512_add_ps(a0[i], a1[i]), _mm512_set1_ps(s), tot[i]);
        for (; k < k1; k++) /* K % 64 (NaN codes give NaN here too) */
            for (int r = 0; r < R; r++) {
                const float w = q3_e4m3_to_f32(wr[r * K + k]) * s;
                for (int t = 0; t < NT; t++) tail[r * NT + t] += x[t * K + k] * w;
            }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++) {
            const int i = r * NT + t;
            y[t * N + r] = (acc ? y[t * N + r] : 0.0f) + _mm512_reduce_add_ps(tot[i]) + tail[i];
        }
}

VBMI_TARGET void q3_fp8_gemv_vbmi(float *y, const float *x, const uint8_t *w, const void *scale, q3_dtype sdt,
                                  int64_t T, int64_t N, int64_t K, int acc, int threads) {
    pthread_once(&tables_once, make_tables);
    const vbmi_tables tb = {_mm512_load_si512(mag_high), _mm512_load_si512(mag_high + 64),
                            _mm512_load_si512(mag_low), _mm512_load_si512(mag_low + 64),
                            _mm512_load_si512(step_order)};
    const int64_t kb = q3_fp8_blocks(K);
    /* tokens a pass, and rows a group: one row (one sequential stream a thread) while a pass's
     * x rows fit in half of L1d, else rows sharing each load of x, 4 x 1 or 2 x 2 (R NT <= 4
     * sums). Zen 4 (32 KiB L1d), 2 threads, one token, alternated, weights from memory:
     * o_proj's [4096, 8192] 18-21 -> 26-28 GB/s with 4 rows; [4096, 1536] 28-34 -> 25-26,
     * so it keeps one row. */
    const int NT = T < 4 ? (int)T : 4;
    const int R = 4 * NT * K <= l1d / 2 ? 1 : T == 1 ? 4 : T == 2 ? 2 : 1;
    const int64_t groups = (N + R - 1) / R;
    /* bytes; with several rows at most a row, so one wrap at most */
    const int64_t ahead = R == 1 || K >= 2048 ? 2048 : K;
#pragma omp parallel for schedule(static) num_threads(threads) if (T * N * K > (1 << 18))
    for (int64_t g = 0; g < groups; g++) {
        const int64_t n = g * R;
        const int rows = N - n < R ? (int)(N - n) : R;
        const int wrap = n + 2 * R <= N;
        const uint8_t *wr = w + n * K;
        const int64_t srow = n / Q3_FP8_BLOCK * kb;
        for (int64_t t = 0; t < T; t += NT) {
            float *yt = y + t * N + n;
            const float *xt = x + t * K;
            const int nt = T - t < NT ? (int)(T - t) : NT;
            switch (rows * 8 + nt) { /* constant R and NT: the sums stay in registers */
            case 8 + 1: rows_vbmi(yt, xt, wr, scale, sdt, srow, N, K, acc, &tb, ahead, wrap, 1, 1); break;
            case 16 + 1: rows_vbmi(yt, xt, wr, scale, sdt, srow, N, K, acc, &tb, ahead, wrap, 2, 1); break;
            case 24 + 1: rows_vbmi(yt, xt, wr, scale, sdt, srow, N, K, acc, &tb, ahead, wrap, 3, 1); break;
            case 32 + 1: rows_vbmi(yt, xt, wr, scale, sdt, srow, N, K, acc, &tb, ahead, wrap, 4, 1); break;
            case 8 + 2: rows_vbmi(yt, xt, wr, scale, sdt, srow, N, K, acc, &tb, ahead, wrap, 1, 2); break;
            case 16 + 2: rows_vbmi(yt, xt, wr, scale, sdt, srow, N, K, acc, &tb, ahead, wrap, 2, 2); break;
            case 8 + 3: rows_vbmi(yt, xt, wr, scale, sdt, srow, N, K, acc, &tb, ahead, wrap, 1, 3); break;
            default: rows_vbmi(yt, xt, wr, scale, sdt, srow, N, K, acc, &tb, ahead, wrap, 1, 4); break;
            }
        }
    }
}

int q3_cpu_has_vbmi(void) { return __builtin_cpu_supports("avx512vbmi"); }

#endif
