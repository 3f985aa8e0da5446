/* RMSNorm over the last dimension: out = w * x / sqrt(mean(x^2) + eps).
 * No mean subtraction, no bias; the weight is w, not 1 + w.
 * Used for the two layer norms (rows = tokens, n = hidden) and for QK-norm
 * (rows = tokens * heads, n = head_dim, one weight vector shared by all heads). */
#ifndef Q3_KERNELS_RMSNORM_H
#define Q3_KERNELS_RMSNORM_H

#include "dtype.h"

/* out [rows, n] fp32 (may alias x) <- x [rows, n] fp32, w [n] of dtype w_dt */
typedef void q3_rmsnorm_fn(float *out, const float *x, const void *w, q3_dtype w_dt,
                    int64_t rows, int64_t n, float eps);

#endif
