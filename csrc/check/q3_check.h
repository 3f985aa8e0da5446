/* The check harness's public API: the CUDA kernels against their CPU twins, on a GPU or on
 * the SIMT executor (libq3simt.so), and the entries the tests and benchmarks call a single
 * kernel through. It builds into qwen3layer._testing, not into the extension users load:
 * q3.cuda.check_kernels() imports that module when asked. */
#ifndef Q3_CHECK_PUBLIC_H
#define Q3_CHECK_PUBLIC_H

#include "../cuda/q3_cuda.h"

/* Binds the harness to the engine of _C (the table of its capsule, engine_link.c); once,
 * before any other call here. Q3_ERR_STATE for a table of another version. */
q3_status q3_check_link(const q3_engine_api *table, q3_error *err);

/* Each CUDA kernel against its CPU twin on random inputs (kernel_check.c): one result
 * per case; max_err is max |cuda - cpu| / max |cpu| (the worst over the schedules). On the
 * SIMT executor every case runs under each of its thread schedules (q3_cuda_schedules) and
 * `agree` says whether the results were bitwise equal across them (a race shows as not);
 * on a GPU, schedules is 1. The cuBLAS setting is left as it was found. */
typedef struct {
    char name[64];   /* the case: its kernel and shape */
    char kernel[48]; /* the launcher(s) it exercises, as named in kernels/cuda/ops_cuda.h
                        ("attention", "moe_gate_up+moe_down+moe_combine", ...) */
    double max_err;
    double tol;
    int schedules;
    int agree;
} q3_check_result;
/* only: the launchers whose cases run, ','-separated ("attention,matmul_tc"), a case running
 * when one of its launchers is named; NULL runs every case */
q3_status q3_cuda_check(int device, const char *only, q3_check_result *out, int max, int *n, q3_error *err);

/* ---- single kernels, for tests and benchmarks (entries.c) ------------------------------ */

/* ms per call of a device-to-device copy of `bytes` (what "copy") or else of the matmul
 * y [T, N] = x [T, K] W^T with dt weights, CUDA events over `repeats` calls */
q3_status q3_check_time(const char *what, size_t bytes, int64_t T, int64_t N, int64_t K, q3_dtype dt, int repeats,
                        float *ms, q3_error *err);
/* dst [n] fp32 <- e4m3 bytes src [n]; dst [n] e4m3 <- fp32 src [n] (kernels/fp8.h's scalar
 * conversions: round to nearest even, NaN past 464) */
void q3_check_e4m3_to_f32(float *dst, const uint8_t *src, int64_t n);
void q3_check_f32_to_e4m3(uint8_t *dst, const float *src, int64_t n);
/* the block scales of an [N, K] e4m3 matrix: ceil(N/128) * ceil(K/128) */
int64_t q3_check_fp8_scales(int64_t N, int64_t K);
/* y [T, N] (+)= x [T, K] W^T, w [N, K] e4m3 with block scales [ceil(N/128), ceil(K/128)] of
 * sdt, by the active CPU path's matmul_fp8 on every thread (its scratch allocated here) */
q3_status q3_check_matmul_fp8(float *y, const float *x, const uint8_t *w, const void *scale, q3_dtype sdt,
                              int64_t T, int64_t N, int64_t K, int accumulate, q3_error *err);
/* dst [N, K] fp32 = W by the scalar reference dequantization (kernels/fp8.h) */
void q3_check_fp8_dequant(float *dst, const uint8_t *w, const void *scale, q3_dtype sdt, int64_t N, int64_t K);
/* y [T, N] (+= when accumulate) x [T, K] W^T, w [N, K] of wdt (fp32 or bf16), by the active
 * CPU path's matmul with the bf16 scratch the layer gives it (the FP8 kernel's yardstick) */
q3_status q3_check_matmul_dense(float *y, const float *x, const void *w, q3_dtype wdt, int64_t T, int64_t N,
                                int64_t K, int accumulate, q3_error *err);

/* ---- e4m3 decoders measured against each other (e4m3_decoders*.c) -------------------------
 * Variants of the e4m3 -> fp32 vector decoding, each in the same one-token GEMV (y [N] = W x)
 * and dequantization loops; w [N, K] e4m3, scale [ceil(N/128), ceil(K/128)] fp32. A variant
 * is named; a name unknown, or of a variant this CPU cannot run, fails with Q3_ERR_VALUE
 * naming it and those it runs. */
typedef struct {
    const char *name, *isa, *what;
    const char *shipped; /* the CPU path whose GEMV decodes so ("avx2", "avx512"), or NULL */
    int width;           /* codes a decoder call */
    int runs;            /* whether this CPU has its instruction sets */
} q3_e4m3_variant_info;
/* the variants this CPU runs, or with all every one compiled (how many: the return value; the
 * first max into out) */
int q3_check_e4m3_variants(q3_e4m3_variant_info *out, int max, int all);
/* dst [n] fp32 <- src [n] codes, every one through the variant's vector code: its exact decoder
 * (that of its dequantization: NaN codes NaN), or with fast its GEMV's (NaN codes unspecified) */
q3_status q3_check_e4m3_decode(const char *variant, int fast, float *dst, const uint8_t *src, int64_t n,
                               q3_error *err);
/* y [N] = W x [K], `repeats` times, on `threads` threads (a row a thread's step) */
q3_status q3_check_e4m3_gemv(const char *variant, float *y, const float *x, const uint8_t *w, const float *scale,
                             int64_t N, int64_t K, int threads, int repeats, q3_error *err);
/* dst [rows, K] <- W by rows, `repeats` times, on `threads` threads: rows = N the whole of W;
 * threads <= rows < N a ring that stays in cache (each thread's rows into its own rows / threads
 * rows of dst in turn), for timing the decoding */
q3_status q3_check_e4m3_dequant(const char *variant, float *dst, const uint8_t *w, const float *scale, int64_t N,
                                int64_t K, int64_t rows, int threads, int repeats, q3_error *err);

#endif
