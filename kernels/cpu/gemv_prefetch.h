/* The decode GEMVs' prefetch (matmul_avx512.c's, on widened bf16 or fp32 weights, and
 * matmul_dot.c's, on bf16 dot products): each tile streams R <= 4 contiguous weight rows, and
 * fetches Q3_GEMV_PREFETCH bytes ahead in each. Past the row's end it runs on into row r + 4,
 * the same row of the next tile (wrap: that tile exists), not into row r + 1, which its own
 * stream has read. Rows are contiguous, so a tile's four streams otherwise ended with one of
 * them running into the next tile and three starting cold there: on an AMD Zen 5 (2 threads,
 * [1536, 4096] bf16 from memory, alternated) 29.1-32.6 -> 32.2-40.9 GB/s at one token,
 * 24.3-27.6 -> 29.6-35.6 at four. */
#ifndef Q3_KERNELS_CPU_GEMV_PREFETCH_H
#define Q3_KERNELS_CPU_GEMV_PREFETCH_H

#include <immintrin.h>
#include <stdint.h>

#ifndef Q3_GEMV_PREFETCH
#define Q3_GEMV_PREFETCH 512 /* bytes ahead in each weight row (1536 was slower once) */
#endif

/* the prefetch Q3_GEMV_PREFETCH bytes past byte `at` of a row of row_bytes (the tile's rows 4
 * apart in the next tile) */
static inline __attribute__((always_inline)) void q3_gemv_prefetch(const char *row, int64_t at, int64_t row_bytes,
                                                                   int wrap) {
    at += Q3_GEMV_PREFETCH;
    if (at < row_bytes) _mm_prefetch(row + at, _MM_HINT_T0);
    else if (wrap) _mm_prefetch(row + 4 * row_bytes + (at - row_bytes), _MM_HINT_T0);
}

#endif
