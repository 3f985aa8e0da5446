/* Causal GQA attention with an online softmax over key tiles of KEY_TILE rows.
 * One work item is (sequence, KV head, query token): the KV rows of that head are read
 * once for its whole group of Hq / Hkv query heads. */
#include <math.h>

#include "../attention.h"

#define KEY_TILE 64

/* row [D] fp32 <- cache row of dtype dt */
static inline const float *load_row(float *tmp, const void *base, q3_dtype dt, int64_t off, int D) {
    if (dt == Q3_F32) return (const float *)base + off;
    const uint16_t *b = (const uint16_t *)base + off;
#pragma omp simd
    for (int i = 0; i < D; i++) tmp[i] = q3_bf16_to_f32(b[i]);
    return tmp;
}

/* out [G, D] for the G query heads q [G, D] of one token over cache rows [0, n_keys) */
static void attend_group(float *out, const float *q, int64_t q_head_stride, int64_t out_head_stride,
                         const void *k, const void *v, int64_t n_keys, int G, int D,
                         q3_dtype dt, float scale) {
    float m[G], l[G], acc[G][D], score[G][KEY_TILE], row[D];
    for (int g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int i = 0; i < D; i++) acc[g][i] = 0.0f;
    }
    for (int64_t j0 = 0; j0 < n_keys; j0 += KEY_TILE) {
        const int nj = (int)(n_keys - j0 < KEY_TILE ? n_keys - j0 : KEY_TILE);
        for (int j = 0; j < nj; j++) {
            const float *kr = load_row(row, k, dt, (j0 + j) * D, D);
            for (int g = 0; g < G; g++) {
                const float *qg = q + g * q_head_stride;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int i = 0; i < D; i++) s += qg[i] * kr[i];
                score[g][j] = s * scale;
            }
        }
        for (int g = 0; g < G; g++) {
            float mt = m[g];
            for (int j = 0; j < nj; j++) mt = score[g][j] > mt ? score[g][j] : mt;
            const float corr = expf(m[g] - mt);
            float sum = 0.0f;
            for (int j = 0; j < nj; j++) {
                score[g][j] = expf(score[g][j] - mt);
                sum += score[g][j];
            }
            l[g] = l[g] * corr + sum;
            m[g] = mt;
            for (int i = 0; i < D; i++) acc[g][i] *= corr;
        }
        for (int j = 0; j < nj; j++) {
            const float *vr = load_row(row, v, dt, (j0 + j) * D, D);
            for (int g = 0; g < G; g++) {
                const float p = score[g][j];
#pragma omp simd
                for (int i = 0; i < D; i++) acc[g][i] += p * vr[i];
            }
        }
    }
    for (int g = 0; g < G; g++) {
        const float inv = 1.0f / l[g];
        for (int i = 0; i < D; i++) out[g * out_head_stride + i] = acc[g][i] * inv;
    }
}

void q3_attention_cpu(float *out, const float *q, const q3_attn_seq *seqs, int n_seqs,
                      const q3_attn_shape *sh) {
    const int Hq = sh->heads, Hkv = sh->kv_heads, D = sh->head_dim, G = Hq / Hkv;
    const int64_t L = sh->L, row = (int64_t)Hq * D;
    const size_t es = q3_dtype_size(sh->kv_dtype);
    const int64_t items = (int64_t)n_seqs * Hkv * L;
#pragma omp parallel for schedule(dynamic, 1) if (items > 1)
    for (int64_t it = 0; it < items; it++) {
        const int64_t t = it % L;
        const int h = (int)((it / L) % Hkv);
        const int s = (int)(it / (L * Hkv));
        const q3_attn_seq *sq = &seqs[s];
        const int64_t head_off = (int64_t)h * sh->capacity * D * (int64_t)es;
        const int64_t tok = (int64_t)s * L + t;
        attend_group(out + tok * row + (int64_t)h * G * D, q + tok * row + (int64_t)h * G * D, D, D,
                     (const char *)sq->k + head_off, (const char *)sq->v + head_off,
                     sq->n_past + t + 1, G, D, sh->kv_dtype, sh->scale);
    }
}
