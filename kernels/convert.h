/* Contiguous element conversion between a storage dtype and fp32. */
#ifndef Q3_KERNELS_CONVERT_H
#define Q3_KERNELS_CONVERT_H

#include "dtype.h"

/* dst [n] fp32 <- src [n] of dtype src_dt */
typedef void q3_to_f32_fn(float *dst, const void *src, q3_dtype src_dt, int64_t n);
/* dst [n] of dtype dst_dt <- src [n] fp32 (bf16: round to nearest even) */
typedef void q3_from_f32_fn(void *dst, q3_dtype dst_dt, const float *src, int64_t n);

#endif
