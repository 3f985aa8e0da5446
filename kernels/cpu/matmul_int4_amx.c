/* The int4 prefill of a bf16 layer on the amx level: the AMX tiles of matmul_amx.c, fed by a
 * row source that dequantizes a GPTQ matrix (kernels/int4.h) into the tiles' bf16 rows.
 *
 * y [T, N] (+)= x [T, K] W^T, T >= Q3_INT4_GEMV_MAX_T, N % 16 == 0, K % 32 == 0, groups of a
 * multiple of 32 inputs (g_idx k / group; -1 is one group of K). Each weight becomes
 * bf16(s (q - z)), the value formed in fp32 and rounded to nearest even: the weight a bf16
 * layer holds (transformers' dequantized bf16 layer, and rows_int4_bf16 of matmul_int4.c, bit
 * for bit); x rounded to bf16 as every bf16 path rounds it; the tiles sum in fp32.
 *
 * The row source turns qweight [K/8, N] (a row of words runs along N) into rows of W [n][k]:
 *  - 16 word rows of 16 adjacent columns (16 loads of 64 bytes) are transposed in registers,
 *    so that one vector holds one column's 16 words: 128 inputs in order;
 *  - a column's group has only 16 values, bf16(s (q - z)) for q = 0 .. 15, which a table in
 *    one register holds (built once per column and group);
 *  - 4 words (32 nibbles) become 32 16-bit indices by a zero extension, a shift and a
 *    vpternlogd, and one vpermw looks them up: 64 bytes of the tiles' row, stored whole.
 * About 5 vector operations for 32 weights, against 8 for 8 weights in rows_int4_bf16.
 * The tiles take the rows in panels (q3_matmul_amx_panels of matmul_amx.c): 128 inputs of
 * all of a thread's columns in turn, so that 16 word rows of qweight are read along N, streams
 * the hardware prefetcher follows. Read as strips of 32 columns down all of K instead (the
 * first version), each word row was 128 bytes 4N bytes from the last, no stream at all, and
 * the experts (weights read once a prefill) waited on memory: the row source alone took 0.07
 * ns a weight with qweight in L2, 0.2 from memory (one thread, [1536 x 4096]). Prefetch (out
 * NULL, q3_matmul_amx_from's stepwise path, where a thread's scratch is too small for panels):
 * the stretch's lines of qweight, scales and qzeros towards L2.
 * Other shapes and groups, fewer tokens, or no scratch: the avx512bf16 level's int4 matmul
 * (matmul_int4.c).
 * Measured on an Intel Xeon with AMX (family 6 model 167 as the VM reports it; 2 threads), the
 * real layer's 512-token prefill (bench_ab.py --int4): 1462 ms on the bf16 dot products this
 * replaces, 522 ms in strips (0.79-0.82x the bf16 layer's), 393-408 ms in panels (0.94-1.0x
 * the bf16 layer's in the same runs). */
#include "matmul_amx.h"
#include "ops.h"
#include "vec.h"

#if Q3_LANES == 16 && defined(__AVX512BW__)
#include <immintrin.h>

#define INT4_AMX __attribute__((target("avx512bf16")))
#define BLOCK_WORDS 16 /* word rows transposed at once: 128 inputs */

typedef struct {
    const q3_int4_matrix *w;
    int64_t N;
} int4_matrix_rows;

/* r[i] lane j <-> r[j] lane i, for 32-bit lanes: unpacks of 32 and 64 bits make 4 x 4
 * blocks in each 128-bit lane, then two rounds of 128-bit shuffles put the blocks in place */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* u[4b + c], 128-bit lane L: column 4L + c of rows 4b .. 4b + 3 */
    for (int b = 0; b < 16; b += 4) {
        u[b] = _mm512_unpacklo_epi64(t[b], t[b + 2]);
        u[b + 1] = _mm512_unpackhi_epi64(t[b], t[b + 2]);
        u[b + 2] = _mm512_unpacklo_epi64(t[b + 1], t[b + 3]);
        u[b + 3] = _mm512_unpackhi_epi64(t[b + 1], t[b + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
        r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
        r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
    }
}

static inline __attribute__((always_inline)) __m128i lane128(__m512i v, int i) {
    switch (i) {
    case 0: return _mm512_castsi512_si128(v);
    case 1: return _mm512_extracti32x4_epi32(v, 1);
    case 2: return _mm512_extracti32x4_epi32(v, 2);
    default: return _mm512_extracti32x4_epi32(v, 3);
    }
}

/* the 16 values of one column and group: lane q (< 16) = bf16(s (q - z)) */
static inline __attribute__((always_inline)) INT4_AMX __m512i value_table(float s, int z) {
    const __m512 q = _mm512_cvtepi32_ps(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    const __m512 v = _mm512_mul_ps(_mm512_sub_ps(q, _mm512_set1_ps((float)z)), _mm512_set1_ps(s));
    return _mm512_zextsi256_si512((__m256i)_mm512_cvtneps_pbh(v));
}

/* out [16][ld] (its first of the block's 8 nw inputs) <- the 16 columns from n of word rows
 * [r0, r0 + nw), nw a multiple of 4 up to 16, lying in groups of a multiple of 32 inputs */
static INT4_AMX void block_rows(uint16_t *out, int64_t ld, const q3_int4_matrix *w, int64_t N, int64_t n, int64_t r0,
                                int nw) {
    __m512i col[16];
    for (int i = 0; i < 16; i++)
        col[i] = i < nw ? _mm512_loadu_si512(w->qweight + (r0 + i) * N + n) : _mm512_setzero_si512();
    transpose16(col);
    const __m512i low = _mm512_set1_epi32(0x000f000f);
    const int64_t group = w->group, k0 = Q3_INT4_PACK * r0;
    for (int64_t c0 = 0; c0 < Q3_INT4_PACK * nw;) { /* a stretch of 32-input chunks in one group */
        const int64_t g = (k0 + c0) / group, c1 = (g + 1) * group - k0 < Q3_INT4_PACK * nw ? (g + 1) * group - k0
                                                                                             : Q3_INT4_PACK * nw;
        float s[16];
        _mm512_storeu_ps(s, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->scales + g * N + n))));
        const uint32_t zw[2] = {(uint32_t)w->qzeros[g * (N / Q3_INT4_PACK) + n / Q3_INT4_PACK],
                                (uint32_t)w->qzeros[g * (N / Q3_INT4_PACK) + n / Q3_INT4_PACK + 1]};
        for (int i = 0; i < 16; i++) {
            const __m512i table = value_table(s[i], (int)(zw[i / 8] >> (4 * (i % 8)) & 0xfu) + w->zero_offset);
            for (int64_t c = c0; c < c1; c += 32) {
                /* 4 words, 32 nibbles in order: byte b -> a 32-bit lane b | b << 12, masked to
                 * nibble 2b in the low 16 bits and 2b + 1 in the high (a 128-bit lane of the
                 * register, not a reload from memory: a 64-byte store does not forward to
                 * loads of its parts) */
                const __m512i d = _mm512_cvtepu8_epi32(lane128(col[i], (int)(c / 32)));
                const __m512i q = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), low, 0xa8);
                _mm512_storeu_si512(out + i * ld + c, _mm512_permutexvar_epi16(q, table));
            }
        }
        c0 = c1;
    }
}

/* the row source (matmul_amx.h) */
static INT4_AMX void rows_int4_amx(uint16_t *out, int64_t ld, const void *src, int64_t n0, int nr, int64_t k0,
                                   int64_t kc) {
    const int4_matrix_rows *m = src;
    const q3_int4_matrix *w = m->w;
    const int64_t N = m->N, r0 = k0 / Q3_INT4_PACK, r1 = (k0 + kc) / Q3_INT4_PACK;
    if (!out) { /* the stretch's qweight lines (nr columns: 64 or 128 bytes a row), scales, zeros */
        for (int64_t r = r0; r < r1; r++)
            for (int i = 0; i < nr; i += 16) _mm_prefetch((const char *)(w->qweight + r * N + n0 + i), _MM_HINT_T1);
        for (int64_t g = k0 / w->group; g <= (k0 + kc - 1) / w->group; g++) {
            _mm_prefetch((const char *)(w->scales + g * N + n0), _MM_HINT_T1);
            _mm_prefetch((const char *)(w->qzeros + g * (N / Q3_INT4_PACK) + n0 / Q3_INT4_PACK), _MM_HINT_T1);
        }
        return;
    }
    for (int i = 0; i < nr; i += 16)
        for (int64_t r = r0; r < r1; r += BLOCK_WORDS)
            block_rows(out + i * ld + Q3_INT4_PACK * (r - r0), ld, w, N, n0 + i, r,
                       r1 - r < BLOCK_WORDS ? (int)(r1 - r) : BLOCK_WORDS);
}

void q3_matmul_int4_cpu_amx(float *y, const float *x, const q3_int4_matrix *w, int64_t T, int64_t N, int64_t K,
                            int accumulate, float *scratch, int threads, uint16_t *xb) {
    if (T < Q3_INT4_GEMV_MAX_T || !xb || !scratch || N % 16 || K % 32 || w->group <= 0 || w->group % 32) {
        q3_matmul_int4_cpu_avx512bf16(y, x, w, T, N, K, accumulate, scratch, threads, xb);
        return;
    }
    if (threads < 1) threads = 1;
    const int4_matrix_rows m = {w, N};
    /* a thread's scratch, 2 * Q3_INT4_CHUNK_ROWS * (K + T) bf16, holds a strip's stretch (up to
     * 4096 bf16) and the C tiles of 4 strips or more (1024 bf16 a strip per 16 tokens) */
    q3_matmul_amx_panels(y, x, rows_int4_amx, &m, T, N, K, accumulate, xb, (uint16_t *)scratch,
                         2 * q3_matmul_int4_scratch_floats(T, K), threads);
}
#endif
