/* The CPU twin of kernels/cuda/matmul_tc.cu (twins.h): the tensor cores' product as the
 * portable matmul on the activations they read, each rounded to bf16 (the weights are bf16
 * already). Portable variant only. x [T, K], w [N, K] bf16, y [T, N]. */
#include <stdlib.h>

#include "ops.h"
#include "twins.h"

#if Q3_CPU_TWINS

void q3_rows_as_bf16_host(float *dst, const float *src, const int32_t *rows, int64_t n, int64_t K) {
    for (int64_t i = 0; i < n; i++) {
        const float *r = src + (rows ? rows[i] : i) * K;
        for (int64_t c = 0; c < K; c++) dst[i * K + c] = q3_bf16_to_f32(q3_f32_to_bf16(r[c]));
    }
}

int q3_matmul_tc_host(float *y, const float *x, const void *w, int64_t T, int64_t N, int64_t K, int accumulate) {
    float *xr = malloc((size_t)(T * K + 1) * sizeof(float));
    if (!xr) return 1;
    q3_rows_as_bf16_host(xr, x, NULL, T, K);
    q3_matmul_cpu_portable(y, xr, w, Q3_BF16, T, N, K, accumulate, NULL);
    free(xr);
    return 0;
}

#endif
