/* The attention probabilities a layer call hands out on request (kernels/attention.h): one
 * work item per (sequence, query head, new token), whose row of `context` floats it owns.
 * The row is first the scaled scores of the keys the query sees, then exp(score - max), then
 * divided by their sum: two passes over the keys and one over the row, in fp32 as the
 * attention routine's online softmax. Off the layer's own path (only calls asking for the
 * maps run it), so it is written for clarity: a row of keys at a time, the dot vectorised. */
#include <math.h>
#include <string.h>

#include "ops.h"

/* q . key j of one (sequence, KV head) block [capacity, D] of dtype dt */
static float dot_key(const float *q, const void *k, q3_dtype dt, int64_t j, int D) {
    float acc = 0.0f;
    if (dt == Q3_BF16) {
        const uint16_t *kr = (const uint16_t *)k + j * D;
#pragma omp simd reduction(+ : acc)
        for (int i = 0; i < D; i++) acc += q[i] * q3_bf16_to_f32(kr[i]);
    } else if (dt == Q3_F16) {
        const uint16_t *kr = (const uint16_t *)k + j * D;
#pragma omp simd reduction(+ : acc)
        for (int i = 0; i < D; i++) acc += q[i] * q3_f16_to_f32(kr[i]);
    } else {
        const float *kr = (const float *)k + j * D;
#pragma omp simd reduction(+ : acc)
        for (int i = 0; i < D; i++) acc += q[i] * kr[i];
    }
    return acc;
}

void Q3_CPU_FN(q3_attention_probs)(float *probs, const float *q, const q3_attn_seq *seqs, int n_seqs,
                                   const q3_attn_shape *sh, int64_t t0, int64_t out_tokens, int64_t context,
                                   int threads) {
    const int Hq = sh->heads, D = sh->head_dim, G = Hq / sh->kv_heads;
    const int64_t L = sh->L, items = (int64_t)n_seqs * Hq * L;
    const size_t head_bytes = (size_t)sh->capacity * D * q3_dtype_size(sh->kv_dtype);
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads) if (items > 1)
    for (int64_t it = 0; it < items; it++) {
        const int64_t t = it % L;
        const int h = (int)((it / L) % Hq);
        const int s = (int)(it / (L * Hq));
        const q3_attn_seq *sq = &seqs[s];
        const int64_t i = sq->n_past + t;                         /* the query's cache row */
        const int64_t lo = i >= sq->first_key ? sq->first_key : i; /* else it sees itself alone */
        const uint8_t *hidden = lo < i ? sq->hidden : NULL;
        const uint8_t *tree = sq->tree ? sq->tree + (i - sq->tree_first) * sq->tree_tokens - sq->tree_first : NULL;
        const float *qr = q + ((int64_t)s * L + t) * Hq * D + (int64_t)h * D;
        const void *k = (const char *)sq->k + (size_t)(h / G) * head_bytes;
        float *row = probs + (((int64_t)s * Hq + h) * out_tokens + t0 + t) * context;
        float m = -INFINITY;
        for (int64_t j = lo; j <= i; j++) {
            if ((hidden && hidden[j]) || (tree && j >= sq->tree_first && !tree[j])) {
                row[j] = -INFINITY; /* exp gives 0 below */
                continue;
            }
            row[j] = sh->scale * dot_key(qr, k, sh->kv_dtype, j, D);
            m = row[j] > m ? row[j] : m;
        }
        float sum = 0.0f;
        for (int64_t j = lo; j <= i; j++) sum += row[j] = expf(row[j] - m);
        const float inv = 1.0f / sum;
        for (int64_t j = lo; j <= i; j++) row[j] *= inv;
        memset(row, 0, (size_t)lo * sizeof(float));
        memset(row + i + 1, 0, (size_t)(context - i - 1) * sizeof(float));
    }
}
