/* Deterministic random numbers for synthetic weights and inputs.
 *
 * Element i of stream `stream` under `seed` is a pure function of (seed, stream, i): the
 * result does not depend on the number of threads or on how a tensor is split. The
 * distribution is the sum of four uniforms (Irwin-Hall), rescaled to mean 0 and variance
 * 1: close to normal, bounded at +-3.46 sigma, and cheap enough to fill the 2.5 G
 * parameters of a real-geometry layer in a few seconds. */
#ifndef Q3_KERNELS_RANDOM_H
#define Q3_KERNELS_RANDOM_H

#include "dtype.h"

/* dst [n] of dtype dt <- mean + std * z, z ~ approximately N(0, 1) */
typedef void q3_fill_normal_fn(void *dst, q3_dtype dt, int64_t n, uint64_t seed, uint64_t stream,
                        float mean, float std);

#endif
