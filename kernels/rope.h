/* Rotary position embedding with a precomputed frequency table, half-split pairing:
 *   angle       = (float)pos * inv_freq[i]                     (fp32, as transformers)
 *   c, s        = cos(angle) * scale, sin(angle) * scale       (fp32 products)
 *   out[i]      = x[i] c - x[i + D/2] s
 *   out[i+D/2]  = x[i + D/2] c + x[i] s                        for i in [0, D/2).
 * The table is the engine's (csrc/engine/rope_table.c: the default, linear or YaRN RoPE, as
 * transformers' inv_freq buffer); scale is its attention_scaling (1 but for YaRN). */
#ifndef Q3_KERNELS_ROPE_H
#define Q3_KERNELS_ROPE_H

#include "dtype.h"

/* x [rows, heads, D] fp32, rotated in place; pos [rows] is each row's absolute position;
 * inv_freq [D / 2] */
typedef void q3_rope_fn(float *x, const int64_t *pos, int64_t rows, int heads, int D, const float *inv_freq,
                        float scale);

#endif
