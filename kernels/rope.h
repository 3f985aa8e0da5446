/* Rotary position embedding, default (unscaled) variant, half-split pairing:
 *   inv_freq[i] = theta^(-2i/D), angle = pos * inv_freq[i]   (fp32, as transformers)
 *   out[i]      = x[i] cos - x[i + D/2] sin
 *   out[i+D/2]  = x[i + D/2] cos + x[i] sin          for i in [0, D/2). */
#ifndef Q3_KERNELS_ROPE_H
#define Q3_KERNELS_ROPE_H

#include "dtype.h"

/* x [rows, heads, D] fp32, rotated in place; pos [rows] is each row's absolute position */
typedef void q3_rope_fn(float *x, const int64_t *pos, int64_t rows, int heads, int D, float theta);

#endif
