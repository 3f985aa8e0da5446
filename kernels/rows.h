/* Row movement between the token order of a call and an expert's group of tokens. */
#ifndef Q3_KERNELS_ROWS_H
#define Q3_KERNELS_ROWS_H

#include "dtype.h"

/* dst [n, H] <- src[rows[i]] for i < n, src [T, H] fp32 */
typedef void q3_gather_rows_fn(float *dst, const float *src, const int32_t *rows, int64_t n, int64_t H);
/* dst[rows[i]] += scale[i] * src[i] for i < n; dst [T, H], src [n, H]; rows distinct */
typedef void q3_scatter_add_rows_fn(float *dst, const float *src, const int32_t *rows,
                             const float *scale, int64_t n, int64_t H);
/* dst [n, H] <- src[rows[i]] for i < n, src [R, H]; both of dtype dt (2 or 4 bytes an
 * element: moved, not converted); rows already checked in [0, R) */
typedef void q3_take_rows_fn(void *dst, const void *src, q3_dtype dt, const int32_t *rows, int64_t n, int64_t H);
/* dst[rows[i]] += src[i] for i < n in turn, dst [R, H] fp32, src [n, H] fp32 or bf16 (widened
 * exactly); rows checked in [0, R). On the host a row may be named twice (its parts add in
 * order); the CUDA twin runs rows in parallel and takes distinct rows only. */
typedef void q3_add_rows_fn(float *dst, const void *src, q3_dtype src_dt, const int32_t *rows, int64_t n, int64_t H);

#endif
