/* Stable counting sort of routing pairs by expert; serial (T * k pairs, cheap). */
#include "ops.h"

void Q3_CPU_FN(q3_moe_group)(int64_t *offsets, int32_t *rows, float *weights, const int32_t *idx,
                      const float *w, int64_t T, int k, int E) {
    for (int e = 0; e <= E; e++) offsets[e] = 0;
    for (int64_t i = 0; i < T * k; i++) offsets[idx[i] + 1]++;
    for (int e = 0; e < E; e++) offsets[e + 1] += offsets[e];
    int64_t fill[E];
    for (int e = 0; e < E; e++) fill[e] = offsets[e];
    for (int64_t t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            const int64_t s = fill[idx[t * k + j]]++;
            rows[s] = (int32_t)t;
            weights[s] = w[t * k + j];
        }
}
