/* The e4m3 -> fp32 vector decoders measured against each other (issue 23: the cheapest exact
 * sequence for the CPU), inside the check harness only: each variant's decoder run in one
 * GEMV loop and one dequantization loop (e4m3_loops.h), so that the variants differ by their
 * decoding alone. Variants by file: e4m3_decoders_avx2.c (AVX2 + FMA + F16C),
 * e4m3_decoders_avx512.c (AVX-512 F + BW), e4m3_decoders_vbmi.c (AVX-512 VBMI); the registry
 * and the entries of q3_check.h in e4m3_decoders.c.
 *
 * Layouts: w [N, K] e4m3 bytes, row-major; scale [ceil(N/128), ceil(K/128)] fp32 (the block
 * scales of kernels/fp8.h); x [K] and y [N] fp32. */
#ifndef Q3_CHECK_E4M3_DECODERS_H
#define Q3_CHECK_E4M3_DECODERS_H

#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define Q3_E4M3_X86 1
#include <cpuid.h>
/* F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports has no "f16c" */
static inline int q3_e4m3_has_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c >> 29 & 1u);
}
#else
#define Q3_E4M3_X86 0
#endif

/* one call of a variant's GEMV (y = W x) or dequantization (y = W, in rows) */
typedef struct {
    float *y;            /* GEMV: [N]; dequantization: [rows, K] */
    const float *x;      /* [K] */
    const float *xp;     /* [K]: x with each full chunk of `width` columns in the decoder's lane order */
    const uint8_t *w;    /* [N, K] e4m3 */
    const float *scale;  /* [ceil(N/128), ceil(K/128)] */
    int64_t N, K;
    int64_t rows;        /* dequantization: rows = N, or fewer: a ring (row n of a thread's share
                            to its own rows / threads rows, n modulo them), which stays in cache */
    int threads;
} q3_e4m3_job;

typedef struct {
    const char *name;
    const char *isa;     /* the instruction sets it needs, as __builtin_cpu_supports names them */
    const char *what;    /* how it decodes, one line */
    const char *shipped; /* the CPU path whose kernel (kernels/cpu/matmul_fp8.c) it reproduces, or NULL */
    int width;           /* codes a decoder call: 32 (ymm) or 64 (zmm) */
    /* the GEMV decoder's lane order: lane j of its output holds the code at column perm[j] of
       the chunk; NULL: lane j holds column j */
    const uint8_t *perm;
    int (*supported)(void);
    /* dst [n] fp32 <- src [n] codes, every code through the vector decoder (a partial last chunk
       padded): fast = 0 the exact decoder of the dequantization (NaN codes NaN), fast = 1 the
       GEMV's (NaN codes unspecified unless it reads them as NaN), put back in column order */
    void (*decode)(float *dst, const uint8_t *src, int64_t n, int fast);
    void (*gemv)(const q3_e4m3_job *job);
    void (*dequant)(const q3_e4m3_job *job);
} q3_e4m3_variant;

/* each file's variants (none off x86-64): *n of them */
const q3_e4m3_variant *q3_e4m3_variants_avx2(int *n);
const q3_e4m3_variant *q3_e4m3_variants_avx512(int *n);
const q3_e4m3_variant *q3_e4m3_variants_vbmi(int *n);

#endif
