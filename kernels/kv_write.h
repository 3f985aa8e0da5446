/* Append the keys and values of L new tokens to one sequence of the KV cache.
 * The cache layout of one sequence is [kv_heads, capacity, D] (see csrc/engine/cache.h):
 * the positions of one head are contiguous, so attention streams them in order. */
#ifndef Q3_KERNELS_KV_WRITE_H
#define Q3_KERNELS_KV_WRITE_H

#include "dtype.h"

/* cache [kv_heads, capacity, D] of dtype dt, rows [start, start + L) of every head
 *   <- src [L, kv_heads, D] fp32, each token's row read with stride src_stride (elements) */
typedef void q3_kv_write_fn(void *cache, q3_dtype dt, const float *src, int64_t src_stride,
                     int64_t L, int kv_heads, int D, int64_t capacity, int64_t start);

#endif
