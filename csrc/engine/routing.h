/* The router's choices summed up for a routing summary (qwen3layer.routing): how many
 * (token, slot) choices went to each expert in one layer call. Host memory only. */
#ifndef Q3_ENGINE_ROUTING_H
#define Q3_ENGINE_ROUTING_H

#include "q3.h"

/* The most dimensions an experts tensor may have ([batch, tokens, top_k] is 3) */
#define Q3_ROUTING_MAX_DIM 8

/* counts [E] = how many entries of experts equal each e in [0, E). experts: a tensor of
 * `ndim` dims [shape], element strides `strides` (any layout: a slice of a trace's
 * [..., top_k] choices works as well), int32. counts is zeroed first and counts every
 * entry, so rows x top_k in all. An entry outside [0, E) fails with Q3_ERR_INDEX naming its
 * position ("experts[2, 7]") and value, counts then zeroed. E in [1, Q3_MAX_EXPERTS];
 * ndim in [1, Q3_ROUTING_MAX_DIM]; shape non-negative; no two elements at one address
 * (Q3_ERR_VALUE otherwise: the walk is bounded by the memory the tensor holds). The caller checked the strides as
 * the DLPack import does: the sum over dims of (shape - 1) x |stride| fits int64 (and the
 * elements it reaches are the tensor's memory). */
q3_status q3_count_experts(const int32_t *experts, int ndim, const int64_t *shape, const int64_t *strides, int E,
                           int64_t *counts, q3_error *err);

#endif
