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

static inline uint64_t q3_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* the key of stream `stream` under `seed` */
static inline uint64_t q3_normal_key(uint64_t seed, uint64_t stream) {
    return q3_mix64(seed * 0x632be59bd9b4e019ull + q3_mix64(stream + 1));
}

/* element i of the stream of `key`: a 64-bit mix of (key, i) gives four 16-bit uniforms whose
 * sum (mean 2, variance 1/3), centred and scaled, approximates a standard normal. Integer-only
 * until the last step, so loops over i vectorise. */
static inline float q3_normal_at(uint64_t key, uint64_t i) {
    const uint64_t r = q3_mix64(key + 0x9e3779b97f4a7c15ull * (i + 1));
    const uint32_t s = (uint32_t)(r & 0xffff) + (uint32_t)((r >> 16) & 0xffff) +
                       (uint32_t)((r >> 32) & 0xffff) + (uint32_t)(r >> 48);
    return ((float)s * (1.0f / 65536.0f) - 2.0f) * 1.7320508075688772f;
}

/* dst [n] of dtype dt <- mean + std * z, z ~ approximately N(0, 1): dst[i] is element first + i
 * of the stream (a slice of a tensor drawn whole is the slice's draws) */
typedef void q3_fill_normal_fn(void *dst, q3_dtype dt, int64_t n, uint64_t seed, uint64_t stream, uint64_t first,
                        float mean, float std);

#endif
