/* The loops every e4m3 decoder variant runs in (e4m3_decoders_*.c), written once: each file
 * defines, before including this,
 *   LOOP_VF      its float vector (__m256 or __m512)
 *   LOOP_TARGET  its __attribute__((target(...)))
 * and its decoders: `fast` (the GEMV's: one chunk of 4 * lanes codes into o[4], in the
 * variant's lane order) and `exact` (the dequantization's: column order, NaN codes NaN), both
 * giving each weight divided by `unit` (a power of two the block scale takes back, as
 * matmul_fp8.c's UNIT). E4M3_VARIANT
 * then makes the variant's entries of q3_e4m3_variant, its decoders inlined into the loops.
 *
 * The GEMV as kernels/cpu/matmul_fp8.c's (one token): the rows split evenly over the threads,
 * each 128-column block's two lines prefetched LOOP_PREFETCH bytes ahead, one chunk a step
 * into four accumulators (four FMA chains), the block's sum times its scale, the columns past
 * the last full chunk by kernels/fp8.h's scalar conversion; a row holding a NaN code gives NaN
 * (found by a second pass over the row, which is in L1, unless the decoder reads NaN codes as
 * NaN). */
#include <math.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "../../kernels/fp8.h"
#include "e4m3_decoders.h"

#define LOOP_LANES ((int)(sizeof(LOOP_VF) / sizeof(float)))
#define LOOP_CHUNK (4 * LOOP_LANES)
#define LOOP_PREFETCH 2048 /* as matmul_fp8.c's FP8_PREFETCH */
#define LOOP_INLINE static inline __attribute__((always_inline)) LOOP_TARGET

typedef void loop_dec_fn(const uint8_t *p, LOOP_VF o[4]);
typedef float loop_vfu __attribute__((vector_size(sizeof(LOOP_VF)), aligned(4))); /* any float alignment */

LOOP_INLINE LOOP_VF loop_load(const float *p) { return *(const loop_vfu *)p; }
LOOP_INLINE void loop_store(float *p, LOOP_VF v) { *(loop_vfu *)p = v; }

/* whether a row of K codes holds a NaN code (S 1111 111) */
static LOOP_TARGET int loop_row_has_nan(const uint8_t *wr, int64_t K) {
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

/* sum_k x[k] W[n, k] of one row wr [K], its scales srow [ceil(K/128)]; xp: x in the decoder's order */
LOOP_INLINE float loop_row_dot(loop_dec_fn *dec, int nan_free, float unit, const float *xp, const float *x,
                               const uint8_t *wr, const float *srow, int64_t K) {
    LOOP_VF tot = {0};
    float tail = 0.0f;
    for (int64_t k0 = 0; k0 < K; k0 += Q3_FP8_BLOCK) {
        const int64_t k1 = k0 + Q3_FP8_BLOCK < K ? k0 + Q3_FP8_BLOCK : K;
        const float s = srow[k0 / Q3_FP8_BLOCK];
        __builtin_prefetch(wr + k0 + LOOP_PREFETCH); /* past the matrix at its end: a prefetch never faults */
        __builtin_prefetch(wr + k0 + LOOP_PREFETCH + 64);
        LOOP_VF a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        int64_t k = k0;
        for (; k + LOOP_CHUNK <= k1; k += LOOP_CHUNK) {
            LOOP_VF o[4];
            dec(wr + k, o);
            a0 += loop_load(xp + k) * o[0];
            a1 += loop_load(xp + k + LOOP_LANES) * o[1];
            a2 += loop_load(xp + k + 2 * LOOP_LANES) * o[2];
            a3 += loop_load(xp + k + 3 * LOOP_LANES) * o[3];
        }
        tot += ((a0 + a1) + (a2 + a3)) * (s * unit);
        for (; k < k1; k++) tail += x[k] * (q3_e4m3_to_f32(wr[k]) * s);
    }
    float r = tail;
    for (int i = 0; i < LOOP_LANES; i++) r += tot[i];
    return !nan_free && loop_row_has_nan(wr, K) ? NAN : r;
}

/* dst [K] <- row wr [K] times its scales srow, by the exact decoder (prefetching as the GEMV) */
LOOP_INLINE void loop_row_dequant(loop_dec_fn *exact, float unit, float *dst, const uint8_t *wr, const float *srow,
                                  int64_t K) {
    for (int64_t k0 = 0; k0 < K; k0 += Q3_FP8_BLOCK) {
        const int64_t k1 = k0 + Q3_FP8_BLOCK < K ? k0 + Q3_FP8_BLOCK : K;
        const float s = srow[k0 / Q3_FP8_BLOCK];
        const LOOP_VF sv = (LOOP_VF){0} + s * unit;
        __builtin_prefetch(wr + k0 + LOOP_PREFETCH); /* as the GEMV: one row is a short stream */
        __builtin_prefetch(wr + k0 + LOOP_PREFETCH + 64);
        int64_t k = k0;
        for (; k + LOOP_CHUNK <= k1; k += LOOP_CHUNK) {
            LOOP_VF o[4];
            exact(wr + k, o);
            for (int i = 0; i < 4; i++) loop_store(dst + k + i * LOOP_LANES, o[i] * sv);
        }
        for (; k < k1; k++) dst[k] = q3_e4m3_to_f32(wr[k]) * s;
    }
}

/* dst [n] <- src [n], chunk by chunk through dec (a partial last chunk padded with zero
 * codes), lane j of a chunk going to column perm[j] (perm NULL: to column j), times unit */
LOOP_INLINE void loop_decode(loop_dec_fn *dec, const uint8_t *perm, float unit, float *dst, const uint8_t *src,
                             int64_t n) {
    for (int64_t i = 0; i < n; i += LOOP_CHUNK) {
        const int64_t m = n - i < LOOP_CHUNK ? n - i : LOOP_CHUNK;
        uint8_t in[LOOP_CHUNK] = {0};
        float out[LOOP_CHUNK], col[LOOP_CHUNK];
        LOOP_VF o[4];
        memcpy(in, src + i, (size_t)m);
        dec(in, o);
        memcpy(out, o, sizeof out);
        for (int j = 0; j < LOOP_CHUNK; j++) col[perm ? perm[j] : j] = out[j] * unit;
        memcpy(dst + i, col, (size_t)m * sizeof(float));
    }
}

#ifdef _OPENMP
#define LOOP_THREAD() omp_get_thread_num()
#define LOOP_THREADS() omp_get_num_threads()
#else
#define LOOP_THREAD() 0
#define LOOP_THREADS() 1
#endif

/* the variant `name`'s decode, gemv and dequant (name##_decode, ...) from its decoders. A
 * thread's share of the rows is a function of its own (name##_gemv_rows, ...): the vector code
 * stays out of the OpenMP region's outlined function, which clang compiles without the
 * caller's target attribute. */
#define E4M3_VARIANT(name, fast, exact, perm, nan_free, unit)                                                        \
    static LOOP_TARGET void name##_decode(float *dst, const uint8_t *src, int64_t n, int use_fast) {                 \
        if (use_fast) loop_decode(fast, perm, unit, dst, src, n);                                                     \
        else loop_decode(exact, NULL, unit, dst, src, n);                                                             \
    }                                                                                                                 \
    static __attribute__((noinline)) LOOP_TARGET void name##_gemv_rows(const q3_e4m3_job *j, int t, int nt) {        \
        const int64_t kb = q3_fp8_blocks(j->K), n1 = j->N * (t + 1) / nt;                                            \
        for (int64_t n = j->N * t / nt; n < n1; n++)                                                                  \
            j->y[n] = loop_row_dot(fast, nan_free, unit, j->xp, j->x, j->w + n * j->K,                                \
                                   j->scale + n / Q3_FP8_BLOCK * kb, j->K);                                           \
    }                                                                                                                 \
    static __attribute__((noinline)) LOOP_TARGET void name##_dequant_rows(const q3_e4m3_job *j, int t, int nt) {     \
        const int64_t kb = q3_fp8_blocks(j->K), n0 = j->N * t / nt, n1 = j->N * (t + 1) / nt, per = j->rows / nt;   \
        for (int64_t n = n0; n < n1; n++) {                                                                           \
            const int64_t row = j->rows >= j->N ? n : t * per + (n - n0) % per;                                       \
            loop_row_dequant(exact, unit, j->y + row * j->K, j->w + n * j->K, j->scale + n / Q3_FP8_BLOCK * kb,       \
                             j->K);                                                                                   \
        }                                                                                                             \
    }                                                                                                                 \
    static void name##_gemv(const q3_e4m3_job *j) {                                                                   \
        _Pragma("omp parallel num_threads(j->threads)") name##_gemv_rows(j, LOOP_THREAD(), LOOP_THREADS());           \
    }                                                                                                                 \
    static void name##_dequant(const q3_e4m3_job *j) {                                                                \
        _Pragma("omp parallel num_threads(j->threads)") name##_dequant_rows(j, LOOP_THREAD(), LOOP_THREADS());        \
    }
