/* The device backend's take_rows and combine_rows (split_rows.c). */
#ifndef Q3_CUDA_SPLIT_ROWS_H
#define Q3_CUDA_SPLIT_ROWS_H

#include "../engine/q3.h"

q3_status q3_take_rows_cuda(void *dst, const void *src, q3_dtype dt, int64_t R, int64_t H, const int32_t *rows,
                            int64_t n, int device, void *stream, q3_error *err);
q3_status q3_combine_rows_cuda(float *resid, int64_t R, int64_t H, const void *parts, q3_dtype parts_dtype,
                               const int32_t *rows, int64_t n, void *out, q3_dtype out_dtype, int device, void *stream,
                               q3_error *err);

#endif
