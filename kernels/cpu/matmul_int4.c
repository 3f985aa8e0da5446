/* y [T, N] (+)= x [T, K] W^T with W a GPTQ 4-bit matrix (kernels/int4.h: qweight [K/8, N]
 * int32, a word holding 8 inputs of one column, lowest nibble first; qzeros, scales per group
 * of inputs and column).
 *
 * Decode (T < Q3_INT4_GEMV_MAX_T): qweight's rows are contiguous along N, so the GEMV runs
 * across columns, a vector of Q3_LANES columns at a time. Threads split the columns in whole
 * vectors (a qzeros word, 8 columns, is never split); each thread streams its columns of the
 * qweight rows two rows at a time, each word read once and its 8 nibbles turned into fp32 in
 * registers (as 1 + q/16: a shift and an and-or, no conversion), which serve all T tokens.
 * With w->group > 0 the scale and zero apply once per group and column:
 *     acc[t, n] = sum_{k in g} x[t, k] (1 + q[k, n]/16)   (a stack tile [T][columns], L1-sized)
 *     y[t, n] += 16 s[g, n] (acc[t, n] - (1 + z[g, n]/16) sum_{k in g} x[t, k]),
 * which is s (q - z) summed. Each cache line of qweight is prefetched PREFETCH_ROWS rows
 * ahead. With group == 0 (desc_act, g_idx arbitrary) each input's weights are dequantized with
 * its own group's scale and zero (slower; correct). Columns past the last whole vector
 * (N % Q3_LANES: 8 on avx512): the scalar reference.
 * Measured on an AMD EPYC Zen 4 (family 25 model 17, 2 cores; qweight + scales + qzeros from
 * memory, [1536, 4096] group 128, one token, avx512): 10-11 GB/s (20 G weights/s) one thread,
 * 16-19 GB/s two; it is bound by the decode and multiply-adds (12.7 GB/s a thread from cache):
 * 16 weights take a shift, a vpternlogd and an FMA a token.
 *
 * Prefill (T >= Q3_INT4_GEMV_MAX_T), avx2 and avx512: the packed matmul (matmul_packed.h) with
 * pack_int4 as its panel source, the nibbles dequantized into each panel in L1 once per token
 * block, as matmul_fp8.c's prefill decodes e4m3. Portable: per thread, chunks of
 * Q3_INT4_CHUNK_ROWS output rows dequantized to fp32 into its scratch ([rows, K], rows of W)
 * and the fp32 matmul, as matmul_fp8.c's portable prefill. */
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "matmul_amx.h"
#include "matmul_packed.h"
#include "ops.h"
#include "thread_scratch.h"
#include "vec.h"

#if (Q3_LANES == 16 && defined(__AVX512F__)) || (Q3_LANES == 8 && defined(__F16C__))
#include <immintrin.h>
#endif

/* the decode GEMV prefetches each cache line of qweight this many rows ahead (a thread's
 * columns of a row are contiguous, rows N words apart) */
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 4
#endif

/* the decode tile's accumulators: T * columns floats on the stack, 16 KB (half an L1) */
#define TILE_FLOATS 4096

typedef uint32_t q3_vu __attribute__((vector_size(Q3_VBYTES)));
typedef uint32_t q3_vuu __attribute__((vector_size(Q3_VBYTES), aligned(4))); /* unaligned loads */

/* Q3_LANES fp16 values -> fp32, exact: F16C where the variant has it, else the scalar
 * conversion (the portable variant: 4 a group and column vector, off the inner loop) */
static inline q3_vf f16_v(const uint16_t *p) {
#if Q3_LANES == 16 && defined(__AVX512F__)
    return (q3_vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif Q3_LANES == 8 && defined(__F16C__)
    return (q3_vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    q3_vf v;
    for (int i = 0; i < Q3_LANES; i++) v[i] = q3_f16_to_f32(p[i]);
    return v;
#endif
}

/* the zeros (stored nibble + zero_offset) of columns [n, n + Q3_LANES) in one group's row of
 * qzeros (qz: [N/8] words), as fp32 */
static inline q3_vf zeros_v(const int32_t *qz, int64_t n, int zero_offset) {
    q3_vf z;
    for (int i = 0; i < Q3_LANES; i++)
        z[i] = (float)((int)(((uint32_t)qz[(n + i) / Q3_INT4_PACK] >> (4 * ((n + i) % Q3_INT4_PACK))) & 0xfu) +
                       zero_offset);
    return z;
}

/* nibble j of each lane's word (input 8r + j of that column), as fp32 0 .. 15 */
static inline q3_vf nibble_v(q3_vu words, int j) {
    return __builtin_convertvector((q3_vi)((words >> (4 * j)) & 0xfu), q3_vf);
}

/* nibble j of each lane's word (input 8r + j of that column) q as the fp32 1 + q/16: q put
 * in the top mantissa bits under the exponent of 1 (0x3f800000), a shift and an and-or (one
 * vpternlogd on AVX-512), no conversion; exact, and (1 + q/16) - (1 + z/16) = (q - z)/16 */
static inline q3_vf nibble16_v(q3_vu words, int j) {
    const int up = 19 - 4 * j; /* bit 4j to bit 19 */
    const q3_vu b = up >= 0 ? words << up : words >> -up;
#if Q3_LANES == 16 && defined(__AVX512F__)
    /* (b & mask) | one as b's own vpternlogd (0xea): the compiler's form overwrote a copy of the
     * constant, one register move a nibble */
    return (q3_vf)_mm512_ternarylogic_epi32((__m512i)b, _mm512_set1_epi32(0x00780000), _mm512_set1_epi32(0x3f800000),
                                            0xea);
#else
    return (q3_vf)((b & 0x00780000u) | 0x3f800000u);
#endif
}

/* acc [T][nc] += sum over the R (1 or 2) word rows from r of x[t, k] (1 + q[k, n]/16) for
 * the nc columns from c0 (nc a multiple of Q3_LANES): the rows' words of a column vector read
 * once, decoded to 8 R vectors, and added into each token's accumulators */
static inline __attribute__((always_inline)) void sum_rows(float *acc, const float *x, const uint32_t *wr,
                                                           int64_t T, int64_t N, int64_t K, int64_t nc, int64_t r,
                                                           const int R) {
    if (T == 1) { /* one token: its 8 R inputs splat into registers once for every column vector */
        q3_vf xv[16];
        for (int j = 0; j < 8 * R; j++) xv[j] = q3_vsplat(x[Q3_INT4_PACK * r + j]);
        for (int64_t v = 0; v < nc; v += Q3_LANES) {
            if (v % 16 == 0)
                for (int i = 0; i < R; i++) __builtin_prefetch(wr + (PREFETCH_ROWS + i) * N + v);
            q3_vf even = q3_vsplat(0.0f), odd = q3_vsplat(0.0f);
            for (int i = 0; i < R; i++) {
                const q3_vu words = *(const q3_vuu *)(wr + i * N + v);
                for (int j = 0; j < 8; j += 2) {
                    even += xv[8 * i + j] * nibble16_v(words, j);
                    odd += xv[8 * i + j + 1] * nibble16_v(words, j + 1);
                }
            }
            q3_vstore(acc + v, q3_vload(acc + v) + (even + odd));
        }
        return;
    }
    for (int64_t v = 0; v < nc; v += Q3_LANES) {
        if (v % 16 == 0) /* the R rows' cache lines of these columns PREFETCH_ROWS rows on */
            for (int i = 0; i < R; i++) __builtin_prefetch(wr + (PREFETCH_ROWS + i) * N + v);
        q3_vf q[16];
        for (int i = 0; i < R; i++) {
            const q3_vu words = *(const q3_vuu *)(wr + i * N + v);
            for (int j = 0; j < 8; j++) q[8 * i + j] = nibble16_v(words, j);
        }
        for (int64_t t = 0; t < T; t++) {
            const float *xk = x + t * K + Q3_INT4_PACK * r; /* inputs 8r .. 8(r + R) - 1 */
            float *a = acc + t * nc + v;
            /* two chains of multiply-adds (the tokens' and columns' chains overlap besides) */
            q3_vf even = xk[0] * q[0], odd = xk[1] * q[1];
            for (int j = 2; j < 8 * R; j += 2) {
                even += xk[j] * q[j];
                odd += xk[j + 1] * q[j + 1];
            }
            q3_vstore(a, q3_vload(a) + (even + odd));
        }
    }
}

/* group > 0: y [T, N] += the columns [c0, c0 + nc) (nc a multiple of Q3_LANES, T nc at
 * most TILE_FLOATS), group by group */
static void gemv_grouped(float *y, const float *x, const q3_int4_matrix *w, int64_t T, int64_t N, int64_t K,
                         int64_t c0, int64_t nc) {
    float acc[TILE_FLOATS] __attribute__((aligned(64)));
    const int64_t rows = w->group / Q3_INT4_PACK;
    for (int64_t g = 0; g < K / w->group; g++) {
        float xs[Q3_INT4_GEMV_MAX_T]; /* sum_{k in g} x[t, k] */
        for (int64_t t = 0; t < T; t++) {
            float s = 0.0f;
            for (int64_t k = g * w->group; k < (g + 1) * w->group; k++) s += x[t * K + k];
            xs[t] = s;
        }
        memset(acc, 0, (size_t)(T * nc) * sizeof *acc);
        int64_t r = g * rows;
        for (; r + 2 <= (g + 1) * rows; r += 2) sum_rows(acc, x, (const uint32_t *)w->qweight + r * N + c0, T, N, K, nc, r, 2);
        if (r < (g + 1) * rows) sum_rows(acc, x, (const uint32_t *)w->qweight + r * N + c0, T, N, K, nc, r, 1);
        for (int64_t v = 0; v < nc; v += Q3_LANES) {
            /* s (q - z) = 16 s ((1 + q/16) - (1 + z/16)) */
            const q3_vf s = f16_v(w->scales + g * N + c0 + v) * 16.0f;
            const q3_vf z = zeros_v(w->qzeros + g * (N / Q3_INT4_PACK), c0 + v, w->zero_offset) * 0.0625f + 1.0f;
            for (int64_t t = 0; t < T; t++) {
                float *yt = y + t * N + c0 + v;
                q3_vstore(yt, q3_vload(yt) + s * (q3_vload(acc + t * nc + v) - z * xs[t]));
            }
        }
    }
}

/* group == 0 (g_idx arbitrary): y [T, N] += the columns [c0, c0 + nc), each input's weights
 * dequantized with its group's scale and zero, then added into every token's sums */
static void gemv_any_groups(float *y, const float *x, const q3_int4_matrix *w, int64_t T, int64_t N, int64_t K,
                            int64_t c0, int64_t nc) {
    for (int64_t r = 0; r < K / Q3_INT4_PACK; r++) {
        const uint32_t *wr = (const uint32_t *)w->qweight + r * N + c0;
        for (int j = 0; j < Q3_INT4_PACK; j++) {
            const int64_t k = Q3_INT4_PACK * r + j, g = w->g_idx[k];
            for (int64_t v = 0; v < nc; v += Q3_LANES) {
                const q3_vf s = f16_v(w->scales + g * N + c0 + v);
                const q3_vf z = zeros_v(w->qzeros + g * (N / Q3_INT4_PACK), c0 + v, w->zero_offset);
                const q3_vf wk = s * (nibble_v(*(const q3_vuu *)(wr + v), j) - z);
                for (int64_t t = 0; t < T; t++) {
                    float *yt = y + t * N + c0 + v;
                    q3_vstore(yt, q3_vload(yt) + x[t * K + k] * wk);
                }
            }
        }
    }
}

static void gemv(float *y, const float *x, const q3_int4_matrix *w, int64_t T, int64_t N, int64_t K, int accumulate,
                 int threads) {
    const int64_t vectors = N / Q3_LANES;
    const int nt = vectors < 1 ? 1 : threads < vectors ? threads : (int)vectors;
    (void)nt; /* (read by the OpenMP pragma alone) */
    /* a tile's columns: as many whole vectors as T of them fit TILE_FLOATS */
    const int64_t tile = TILE_FLOATS / T / Q3_LANES * Q3_LANES;
#pragma omp parallel num_threads(nt) if (nt > 1 && T * N * K > (1 << 18))
    {
        int64_t c0, cv, c1;
#ifdef _OPENMP
        q3_int4_thread_columns(N, Q3_LANES, omp_get_thread_num(), omp_get_num_threads(), &c0, &cv, &c1);
#else
        q3_int4_thread_columns(N, Q3_LANES, 0, 1, &c0, &cv, &c1);
#endif
        if (!accumulate)
            for (int64_t t = 0; t < T; t++) memset(y + t * N + c0, 0, (size_t)(c1 - c0) * sizeof *y);
        for (int64_t n = c0; n < cv; n += tile) {
            const int64_t nc = cv - n < tile ? cv - n : tile;
            if (w->group > 0) gemv_grouped(y, x, w, T, N, K, n, nc);
            else gemv_any_groups(y, x, w, T, N, K, n, nc);
        }
        q3_int4_columns_exact(y, x, w, T, N, K, cv, c1);
    }
}

#if !(defined(__AVX2__) && defined(__FMA__)) /* the portable prefill's rows (the others: pack_int4) */
/* dst [nr, K] fp32 <- rows [n0, n0 + nr) of W, equal to q3_int4_dequant_rows bit for bit
 * (s (q - z) is exact in fp32). group > 0: a group's scale and zero once per column, then its
 * words' 8 nibbles (a loop the compiler vectorizes); blocks of a group's word rows (at most 16,
 * 128 inputs) so their words of these columns stay in L1 while each row of dst takes its
 * values. group == 0: the reference, input by input, in the same blocks. */
static void dequant_rows(float *dst, const q3_int4_matrix *w, int64_t N, int64_t K, int64_t n0, int64_t nr) {
    const int64_t R = K / Q3_INT4_PACK, block = w->group > 0 && w->group % 128 ? w->group / Q3_INT4_PACK : 16;
    for (int64_t r0 = 0; r0 < R; r0 += block) {
        const int64_t r1 = r0 + block < R ? r0 + block : R;
        for (int64_t i = 0; i < nr; i++) {
            const int64_t n = n0 + i;
            float *d = dst + i * K;
            if (w->group > 0) { /* rows [r0, r1) lie in one group: a block is a group or divides one */
                const int64_t g = Q3_INT4_PACK * r0 / w->group;
                const float s = q3_f16_to_f32(w->scales[g * N + n]);
                const int z = q3_int4_at(w->qzeros, g * (N / Q3_INT4_PACK) + n / Q3_INT4_PACK,
                                         (int)(n % Q3_INT4_PACK)) + w->zero_offset;
                for (int64_t r = r0; r < r1; r++) {
                    const uint32_t word = (uint32_t)w->qweight[r * N + n];
                    for (int j = 0; j < Q3_INT4_PACK; j++)
                        d[Q3_INT4_PACK * r + j] = s * (float)((int)((word >> (4 * j)) & 0xfu) - z);
                }
            } else
                for (int64_t k = Q3_INT4_PACK * r0; k < Q3_INT4_PACK * r1; k++) d[k] = q3_int4_weight(w, N, n, k);
        }
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* 8 lanes whatever the variant's width: one word's nibbles, each shifted down by its own count
 * (vpsrlvd) */
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef float f32x8 __attribute__((vector_size(32)));
static const u32x8 NIBBLE_SHIFTS = {0, 4, 8, 12, 16, 20, 24, 28};

/* W as the int4 panel source reads it */
typedef struct {
    const q3_int4_matrix *w;
    int64_t N;
} int4_rows;

/* the int4 panel source of the packed matmul (matmul_packed.h): panel [nr][ldp] fp32 <- W's
 * rows [n0, n0 + nr) x inputs [k0, k0 + kc), each value s (q - z) exactly as the reference.
 * The nr columns' words of one qweight row are adjacent (nr <= 6 words of a cache line the
 * next panels read too). group > 0: a stretch of whole words within one group takes its scale
 * and zero once; inputs off a word's start (a k block not a multiple of 8) and desc_act's
 * g_idx: input by input (q3_int4_weight). */
static void pack_int4(float *panel, int64_t ldp, const void *src, int64_t n0, int nr, int64_t k0, int64_t kc) {
    const int4_rows *m = src;
    const q3_int4_matrix *w = m->w;
    const int64_t N = m->N, k1 = k0 + kc;
    for (int i = 0; i < nr; i++) {
        const int64_t n = n0 + i;
        float *out = panel + i * ldp - k0; /* out[k]: input k */
        int64_t k = k0;
        while (k < k1) {
            if (w->group <= 0 || k % Q3_INT4_PACK || k + Q3_INT4_PACK > k1) {
                out[k] = q3_int4_weight(w, N, n, k);
                k++;
                continue;
            }
            const int64_t g = k / w->group, end = (g + 1) * w->group < k1 ? (g + 1) * w->group : k1;
            const float sc = q3_f16_to_f32(w->scales[g * N + n]);
            const float z = (float)(q3_int4_at(w->qzeros, g * (N / Q3_INT4_PACK) + n / Q3_INT4_PACK,
                                               (int)(n % Q3_INT4_PACK)) + w->zero_offset);
            const f32x8 sv = {sc, sc, sc, sc, sc, sc, sc, sc}, zv = {z, z, z, z, z, z, z, z};
            for (; k + Q3_INT4_PACK <= end; k += Q3_INT4_PACK) { /* a word's 8 nibbles in one 8-lane vector */
                const uint32_t word = (uint32_t)w->qweight[k / Q3_INT4_PACK * N + n];
                const u32x8 q = ((u32x8){word, word, word, word, word, word, word, word} >> NIBBLE_SHIFTS) & 0xfu;
                const f32x8 v = (__builtin_convertvector((i32x8)q, f32x8) - zv) * sv; /* s (q - z), exact */
                memcpy(out + k, &v, sizeof v);
            }
        }
    }
}
#endif

void Q3_CPU_FN(q3_matmul_int4)(float *y, const float *x, const q3_int4_matrix *w, int64_t T, int64_t N, int64_t K,
                               int accumulate, float *scratch, int threads, uint16_t *xb) {
    (void)xb; /* this variant's products are fp32 */
    if (T < 1 || N < 1) return;
    if (threads < 1) threads = 1;
    if (T < Q3_INT4_GEMV_MAX_T) {
        gemv(y, x, w, T, N, K, accumulate, threads);
        return;
    }
#if defined(__AVX2__) && defined(__FMA__)
    /* avx2, avx512: the nibbles dequantized into the packed matmul's panels, once per token block */
    (void)scratch;
    const int4_rows m = {w, N};
    const q3_panel_source src = {pack_int4, &m, NULL, 0, 0};
    Q3_CPU_FN(q3_matmul_packed_from)(y, x, &src, T, N, K, accumulate, threads);
#else
    /* One parallel region: each thread takes chunks of rows whole (dequantize, multiply, add
     * out) in its own scratch; the fp32 matmul called in it runs on the calling thread (nested
     * regions are inactive). */
    const int64_t chunks = (N + Q3_INT4_CHUNK_ROWS - 1) / Q3_INT4_CHUNK_ROWS;
    const int64_t per_thread = q3_matmul_int4_scratch_floats(T, K);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (chunks > 1)
    for (int64_t c = 0; c < chunks; c++) {
        float *tile = q3_thread_scratch(scratch, per_thread);
        float *yt = tile + Q3_INT4_CHUNK_ROWS * K; /* [T, nr] */
        const int64_t n0 = c * Q3_INT4_CHUNK_ROWS;
        const int64_t nr = N - n0 < Q3_INT4_CHUNK_ROWS ? N - n0 : Q3_INT4_CHUNK_ROWS;
        dequant_rows(tile, w, N, K, n0, nr);
        Q3_CPU_FN(q3_matmul)(yt, x, tile, Q3_F32, T, nr, K, 0, NULL);
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < nr; i++)
                y[t * N + n0 + i] = (accumulate ? y[t * N + n0 + i] : 0.0f) + yt[t * nr + i];
    }
#endif
}

#if Q3_LANES == 16 && defined(__AVX512BW__)
/* The int4 matmul on the avx512bf16 level (and amx's, off its tiles: matmul_int4_amx.c):
 * fewer than Q3_INT4_GEMV_MAX_T tokens given xb, the VNNI GEMV of matmul_int4_vnni.c where it
 * takes the groups; from Q3_INT4_GEMV_MAX_T tokens given xb, the bf16 dot products on the
 * nibbles in place of matmul_int4_dot.c where it takes the groups, else those of matmul_dot.c
 * with rows_int4_bf16 as their row source, each dequantized weight rounded to bf16 (to nearest
 * even) as a bf16 layer holds it, and x rounded to bf16, as the bf16 paths do; sums in fp32.
 * Fewer tokens, no xb (an fp32 layer) or K % 32: this variant's. */
#define INT4_BF16 __attribute__((target("avx512bf16")))

/* the row source (matmul_amx.h): out [nr][kc] bf16 (row stride ld) <- bf16(W) of rows
 * [n0, n0 + nr) x inputs [k0, k0 + kc) (multiples of 32, so of 8: a stretch of whole words, a
 * group's scale and zero once per stretch; desc_act's g_idx: input by input). out NULL (fetch
 * the next rows' bytes): nothing, a row's words lie N apart. */
static INT4_BF16 void rows_int4_bf16(uint16_t *out, int64_t ld, const void *src, int64_t n0, int nr, int64_t k0,
                                     int64_t kc) {
    if (!out) return;
    const int4_rows *m = src;
    const q3_int4_matrix *w = m->w;
    const int64_t N = m->N, k1 = k0 + kc;
    for (int i = 0; i < nr; i++) {
        const int64_t n = n0 + i;
        uint16_t *o = out + i * ld - k0; /* o[k]: input k */
        if (w->group <= 0) {
            for (int64_t k = k0; k < k1; k++) o[k] = q3_f32_to_bf16(q3_int4_weight(w, N, n, k));
            continue;
        }
        for (int64_t k = k0; k < k1;) {
            const int64_t g = k / w->group, end = (g + 1) * w->group < k1 ? (g + 1) * w->group : k1;
            const float sc = q3_f16_to_f32(w->scales[g * N + n]);
            const float z = (float)(q3_int4_at(w->qzeros, g * (N / Q3_INT4_PACK) + n / Q3_INT4_PACK,
                                               (int)(n % Q3_INT4_PACK)) + w->zero_offset);
            const f32x8 sv = {sc, sc, sc, sc, sc, sc, sc, sc}, zv = {z, z, z, z, z, z, z, z};
            for (; k < end; k += Q3_INT4_PACK) {
                const uint32_t word = (uint32_t)w->qweight[k / Q3_INT4_PACK * N + n];
                const u32x8 q = ((u32x8){word, word, word, word, word, word, word, word} >> NIBBLE_SHIFTS) & 0xfu;
                const f32x8 v = (__builtin_convertvector((i32x8)q, f32x8) - zv) * sv;
                const __m128bh b = _mm256_cvtneps_pbh((__m256)v);
                memcpy(o + k, &b, sizeof b);
            }
        }
    }
}

void q3_matmul_int4_cpu_avx512bf16(float *y, const float *x, const q3_int4_matrix *w, int64_t T, int64_t N, int64_t K,
                                   int accumulate, float *scratch, int threads, uint16_t *xb) {
    if (T < Q3_INT4_GEMV_MAX_T && q3_int4_gemv_vnni(y, x, w, T, N, K, accumulate, threads, xb)) return;
    if (T >= Q3_INT4_GEMV_MAX_T && q3_int4_prefill_dot(y, x, w, T, N, K, accumulate, scratch, threads, xb)) return;
    if (T < Q3_INT4_GEMV_MAX_T || !xb || K % 32) {
        q3_matmul_int4_cpu_avx512(y, x, w, T, N, K, accumulate, scratch, threads, xb);
        return;
    }
    const int4_rows m = {w, N};
    q3_matmul_dot_from(y, x, rows_int4_bf16, &m, NULL, 0, 0, T, N, K, accumulate, xb, threads);
}
#endif

#if Q3_CPU_TWINS
/* the CUDA GEMV's twin: this matmul with its scratch, one thread */
int q3_matmul_int4_host(float *y, const float *x, const q3_int4_matrix *w, int64_t T, int64_t N, int64_t K,
                        int accumulate) {
    const int64_t n = q3_matmul_int4_scratch_floats(T, K);
    float *scratch = n ? malloc((size_t)n * sizeof(float)) : NULL;
    if (n && !scratch) return 1;
    q3_matmul_int4_cpu_portable(y, x, w, T, N, K, accumulate, scratch, 1, NULL);
    free(scratch);
    return 0;
}

/* the dequantization kernel's twin: kernels/int4.h's scalar reference, each value rounded to bf16 */
void q3_int4_dequant_host(uint16_t *dst, const q3_int4_matrix *w, int64_t N, int64_t K) {
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++) dst[n * K + k] = q3_f32_to_bf16(q3_int4_weight(w, N, n, k));
}
#endif
