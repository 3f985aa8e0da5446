/* The CPU twins of kernels/cuda/moe_prefill.cu, the routed experts of a prefill on tensor
 * cores (twins.h): per tile (q3_moe_tile, kernels/moe_group.h) of an expert's slots, the
 * projections of matmul_tc.c's twin (inputs rounded to bf16, bf16 weights), and the combine
 * over a token's slots in the order ptr gives them. Portable variant only. act, y by slot. */
#include <stdlib.h>

#include "ops.h"
#include "twins.h"

#if Q3_CPU_TWINS

int q3_moe_gate_up_tc_host(float *act, const float *x, const int32_t *rows, const q3_moe_tile *tiles, int n_tiles,
                           const void *const *gate, const void *const *up, int64_t I, int64_t K) {
    float *xe = malloc((size_t)Q3_MOE_TILE_ROWS * (size_t)(K + I) * sizeof(float)); /* a tile's rows, then up */
    if (!xe) return 1;
    float *upv = xe + Q3_MOE_TILE_ROWS * K;
    for (int i = 0; i < n_tiles; i++) {
        const q3_moe_tile t = tiles[i];
        float *out = act + (int64_t)t.first * I;
        q3_rows_as_bf16_host(xe, x, rows + t.first, t.rows, K);
        q3_matmul_cpu_portable(out, xe, gate[t.expert], Q3_BF16, t.rows, I, K, 0, NULL);
        q3_matmul_cpu_portable(upv, xe, up[t.expert], Q3_BF16, t.rows, I, K, 0, NULL);
        q3_swiglu_cpu_portable(out, out, upv, t.rows * I);
    }
    free(xe);
    return 0;
}

int q3_moe_down_tc_host(float *y, const float *act, const q3_moe_tile *tiles, int n_tiles, const void *const *down,
                        int64_t N, int64_t K) {
    float *ab = malloc((size_t)Q3_MOE_TILE_ROWS * (size_t)K * sizeof(float));
    if (!ab) return 1;
    for (int i = 0; i < n_tiles; i++) {
        const q3_moe_tile t = tiles[i];
        q3_rows_as_bf16_host(ab, act + (int64_t)t.first * K, NULL, t.rows, K);
        q3_matmul_cpu_portable(y + (int64_t)t.first * N, ab, down[t.expert], Q3_BF16, t.rows, N, K, 0, NULL);
    }
    free(ab);
    return 0;
}

void q3_moe_combine_csr_host(float *x, const float *y, const float *weights, const int32_t *tokens,
                             const int32_t *ptr, const int32_t *slot, int n, int64_t H) {
    for (int i = 0; i < n; i++)
        for (int32_t j = ptr[i]; j < ptr[i + 1]; j++)
            for (int64_t c = 0; c < H; c++) x[(int64_t)tokens[i] * H + c] += weights[slot[j]] * y[(int64_t)slot[j] * H + c];
}

#endif
