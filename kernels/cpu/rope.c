/* RoPE in place; cos/sin computed once per row and applied to all of its heads. */
#include <math.h>

#include "ops.h"
#include "team.h"

/* row r's heads, rotated by its position */
static void rope_row(float *x, const int64_t *pos, int64_t r, int heads, int D, const float *inv_freq, float scale) {
    const int half = D / 2;
    float c[half], s[half];
    const float p = (float)pos[r];
    for (int i = 0; i < half; i++) {
        const float a = p * inv_freq[i];
        /* transformers: cos(emb) * attention_scaling in fp32 (exact for the scale 1) */
        c[i] = cosf(a) * scale;
        s[i] = sinf(a) * scale;
    }
    for (int h = 0; h < heads; h++) {
        float *v = x + (r * heads + h) * D;
#pragma omp simd
        for (int i = 0; i < half; i++) {
            const float lo = v[i], hi = v[i + half];
            v[i] = lo * c[i] - hi * s[i];
            v[i + half] = hi * c[i] + lo * s[i];
        }
    }
}

void Q3_CPU_FN(q3_rope)(float *x, const int64_t *pos, int64_t rows, int heads, int D, const float *inv_freq,
                        float scale) {
    if (!q3_team(rows * heads > 64, 0)) { /* inline (team.h) */
        for (int64_t r = 0; r < rows; r++) rope_row(x, pos, r, heads, D, inv_freq, scale);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) rope_row(x, pos, r, heads, D, inv_freq, scale);
}
