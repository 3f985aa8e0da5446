/* Row movement between the token order of a call and an expert's group of tokens. */
#ifndef Q3_KERNELS_ROWS_H
#define Q3_KERNELS_ROWS_H

#include "dtype.h"

/* dst [n, H] <- src[rows[i]] for i < n, src [T, H] fp32 */
typedef void q3_gather_rows_fn(float *dst, const float *src, const int32_t *rows, int64_t n, int64_t H);
/* dst[rows[i]] += scale[i] * src[i] for i < n; dst [T, H], src [n, H]; rows distinct */
typedef void q3_scatter_add_rows_fn(float *dst, const float *src, const int32_t *rows,
                             const float *scale, int64_t n, int64_t H);

#endif
