/* Group the (token, expert) pairs of a call by expert, so that each expert's weights are
 * read once per call for all the tokens that chose it.
 *
 * After the call, expert e owns pair slots [offsets[e], offsets[e+1]); slot s names the
 * token rows[s] and the routing weight weights[s]. Within an expert, tokens are in
 * ascending order (a stable counting sort). */
#ifndef Q3_KERNELS_MOE_GROUP_H
#define Q3_KERNELS_MOE_GROUP_H

#include "dtype.h"

/* A tile of the grouped prefill MoE (kernels/cuda/moe_prefill.cu and its twin): `rows`
 * (1 .. Q3_MOE_TILE_ROWS) consecutive slots from `first`, all of expert `expert`. */
#define Q3_MOE_TILE_ROWS 64
typedef struct {
    int32_t expert, first, rows, unused;
} q3_moe_tile;

/* offsets [E + 1], rows [T * k], weights [T * k] <- idx [T, k], w [T, k] */
typedef void q3_moe_group_fn(int64_t *offsets, int32_t *rows, float *weights, const int32_t *idx,
                      const float *w, int64_t T, int k, int E);

#endif
