/* MoE router after the gate projection: softmax over experts in fp32, top-k,
 * optional renormalisation of the k selected probabilities to sum to 1.
 * Ties are broken towards the lower expert index. */
#ifndef Q3_KERNELS_ROUTER_H
#define Q3_KERNELS_ROUTER_H

#include "dtype.h"

/* idx [T, k], weight [T, k] <- logits [T, E]; experts of a token in descending probability */
typedef void q3_router_topk_fn(int32_t *idx, float *weight, const float *logits, int64_t T, int E,
                        int k, int normalize);

#endif
