/* MoE router after the gate projection: softmax over experts in fp32, top-k,
 * optional renormalisation of the k selected probabilities to sum to 1.
 *
 * Tie rule, the same for every backend (kernels/cpu/router.c, kernels/cuda/router.cu): experts
 * are ranked by their fp32 probability, and experts of equal probability by ascending expert
 * index. The lower index is chosen first, also where the tie straddles the k-th place (experts
 * 3 and 5 tying for the last slot: 3 is chosen; all logits equal: experts 0 .. k-1). The rule
 * is ours: transformers leaves ties to torch.topk, which documents no order. Tested by
 * tests/ops/test_router_ties.py (CPU) and the kernel self-check's tie case (CUDA against the CPU). */
#ifndef Q3_KERNELS_ROUTER_H
#define Q3_KERNELS_ROUTER_H

#include "dtype.h"

/* idx [T, k], weight [T, k] <- logits [T, E]; experts of a token in descending probability */
typedef void q3_router_topk_fn(int32_t *idx, float *weight, const float *logits, int64_t T, int E,
                        int k, int normalize);

#endif
