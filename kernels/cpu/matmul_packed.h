/* The packed-panel matmul of the avx2 and avx512 variants (kernels/cpu/matmul_packed.c):
 * y [T, N] (+)= x [T, K] W^T for many tokens, W converted panel by panel into fp32 in L1.
 * Not in the portable variant. */
#ifndef Q3_KERNELS_CPU_MATMUL_PACKED_H
#define Q3_KERNELS_CPU_MATMUL_PACKED_H

#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "../dtype.h"

/* A panel source: panel [nr][ldp] fp32 <- the weights of rows [n0, n0 + nr) x columns
 * [k0, k0 + kc) (nr <= 6, kc <= 2048 <= ldp), each row's kc values contiguous, ldp floats
 * apart. src: the source's own description of W (its data, K, scales). Called by several
 * threads at once. */
typedef void q3_panel_fn(float *panel, int64_t ldp, const void *src, int64_t n0, int nr, int64_t k0, int64_t kc);

/* W as a packed matmul reads it: its panel source, and where its stored rows lie, so that the
 * tiles of one panel can fetch the next panel's bytes while they run (row r at bytes +
 * r * row_bytes, column k col_bytes further each; bytes NULL: nothing fetched) */
typedef struct {
    q3_panel_fn *pack;
    const void *src;
    const void *bytes;
    int64_t row_bytes;
    int col_bytes;
} q3_panel_source;

/* the team a packed matmul runs on when its caller names none */
static inline int q3_packed_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

#if defined(__x86_64__)
/* W fp32 (read in place) or bf16: q3_matmul_fn without xb, on the default team */
void q3_matmul_packed_cpu_avx2(float *y, const float *x, const void *w, q3_dtype w_dt, int64_t T, int64_t N,
                               int64_t K, int accumulate);
void q3_matmul_packed_cpu_avx512(float *y, const float *x, const void *w, q3_dtype w_dt, int64_t T, int64_t N,
                                 int64_t K, int accumulate);
/* W from a panel source, on at most `threads` threads */
void q3_matmul_packed_from_cpu_avx2(float *y, const float *x, const q3_panel_source *w, int64_t T, int64_t N,
                                    int64_t K, int accumulate, int threads);
void q3_matmul_packed_from_cpu_avx512(float *y, const float *x, const q3_panel_source *w, int64_t T, int64_t N,
                                      int64_t K, int accumulate, int threads);
/* KC, the k block, set to kc (1 .. Q3_PACKED_KC_MAX) instead of from L1d; 0: from L1d again */
void q3_matmul_packed_set_kc_cpu_avx2(int64_t kc);
void q3_matmul_packed_set_kc_cpu_avx512(int64_t kc);
#endif
#define Q3_PACKED_KC_MAX 2048

#endif
