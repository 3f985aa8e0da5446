/* Single kernels for the tests and benchmarks (q3_check.h): the FP8 conversions and matmuls
 * of the active CPU path (kernels/fp8.h, kernels/cpu/matmul_fp8.c) and the dense matmul they
 * are measured against; CUDA timings of a copy and a matmul. Sizes are the caller's, checked
 * against its buffers. */
#include <stdlib.h>
#include <string.h>

#include "../../kernels/fp8.h"
#include "../cuda/backend.h"
#include "../engine/cpu_dispatch.h"
#include "q3_check.h"

q3_status q3_check_time(const char *what, size_t bytes, int64_t T, int64_t N, int64_t K, q3_dtype dt, int repeats,
                        float *ms, q3_error *err) {
    const q3_cuda_ops *g = q3_cuda();
    if (!g) return q3_fail(err, Q3_ERR_STATE, "cuda: the CUDA backend is not loaded");
    const int code = !strcmp(what, "copy") ? g->time_copy(bytes, repeats, ms) : g->time_matmul(T, N, K, dt, repeats, ms);
    return code ? q3_fail(err, Q3_ERR_STATE, "cuda_time(%s): %s", what, g->error_string(code)) : Q3_OK;
}

void q3_check_e4m3_to_f32(float *dst, const uint8_t *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = q3_e4m3_to_f32(src[i]);
}

void q3_check_f32_to_e4m3(uint8_t *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = q3_f32_to_e4m3(src[i]);
}

int64_t q3_check_fp8_scales(int64_t N, int64_t K) { return q3_fp8_blocks(N) * q3_fp8_blocks(K); }

q3_status q3_check_matmul_fp8(float *y, const float *x, const uint8_t *w, const void *scale, q3_dtype sdt,
                              int64_t T, int64_t N, int64_t K, int accumulate, q3_error *err) {
    const int threads = q3_max_threads();
    const int64_t n_scratch = threads * q3_matmul_fp8_scratch_floats(T, K); /* none for decode-sized T */
    float *scratch = NULL;
    if (n_scratch && !(scratch = malloc((size_t)n_scratch * sizeof(float))))
        return q3_fail(err, Q3_ERR_NOMEM, "matmul_fp8: out of memory for %lld scratch floats", (long long)n_scratch);
    uint16_t *xb = malloc((size_t)q3_matmul_scratch_elems(T, K) * sizeof(uint16_t) + 1); /* as a layer has */
    if (!xb) {
        free(scratch);
        return q3_fail(err, Q3_ERR_NOMEM, "matmul_fp8: out of memory for its bf16 scratch");
    }
    q3_cpu_ops_active()->matmul_fp8(y, x, w, scale, sdt, T, N, K, accumulate, scratch, threads, xb);
    free(xb);
    free(scratch);
    return Q3_OK;
}

void q3_check_fp8_dequant(float *dst, const uint8_t *w, const void *scale, q3_dtype sdt, int64_t N, int64_t K) {
    q3_fp8_dequant_rows(dst, w, scale, sdt, 0, N, K);
}

q3_status q3_check_matmul_dense(float *y, const float *x, const void *w, q3_dtype wdt, int64_t T, int64_t N,
                                int64_t K, int accumulate, q3_error *err) {
    uint16_t *xb = malloc((size_t)q3_matmul_scratch_elems(T, K) * sizeof(uint16_t) + 1);
    if (!xb) return q3_fail(err, Q3_ERR_NOMEM, "matmul: out of memory for its bf16 scratch");
    q3_cpu_ops_active()->matmul(y, x, w, wdt, T, N, K, accumulate, xb);
    free(xb);
    return Q3_OK;
}
