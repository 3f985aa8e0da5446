/* Activation memory of one pass of the layer over R rows (tokens of all sequences of a
 * chunk). One allocation, grown only when a call needs more rows than any call before;
 * its size is linear in R: the layer never holds [R, R] attention scores. */
#ifndef Q3_ENGINE_WORKSPACE_H
#define Q3_ENGINE_WORKSPACE_H

#include "../../kernels/attention.h"
#include "../../kernels/matmul.h"
#include "q3.h"

typedef struct {
    int64_t rows; /* capacity in rows */
    int seqs;     /* capacity in sequences */
    int threads;  /* kernel threads the per-thread scratch is sized for */
    size_t bytes;
    void *block;
    float *x;          /* [R, H] residual stream, fp32 */
    float *h;          /* [R, H] normed activations */
    /* attention stage (its memory reused by the MoE stage's xe, gate, up, ye) */
    float *q;          /* [R, Hq * D] */
    float *k;          /* [R, Hkv * D] */
    float *v;          /* [R, Hkv * D] */
    float *attn;       /* [R, Hq * D] attention output: the same memory as q */
    float *logits;     /* [R, E] router logits */
    int32_t *topk_idx; /* [R, k] */
    float *topk_w;     /* [R, k] */
    int64_t *offsets;  /* [E + 2] expert groups (and the expert half's skipped entries) */
    int32_t *pair_row; /* [R * k] token of each (token, expert) pair, grouped by expert */
    float *pair_w;     /* [R * k] its routing weight */
    /* MoE stage */
    float *xe;         /* [R, H] one expert's gathered inputs */
    float *gate;       /* [R, I] */
    float *up;         /* [R, I] */
    float *ye;         /* [R, H] one expert's outputs */
    int64_t *pos;      /* [R] absolute positions */
    uint16_t *xb;      /* bf16 activations for the matmuls (kernels/matmul.h) */
    float *attn_scratch; /* [threads] x q3_attention_scratch_floats */
    float *expert_thread; /* [threads] x q3_expert_thread_floats: decode's experts per thread */
    uint16_t *expert_xb;  /* [threads] x q3_expert_thread_xb: their bf16 activations (kernels/matmul.h) */
    float *pair_out;      /* [Q3_MOE_THREAD_ROWS * k, H] decode's weighted expert outputs, by pair */
    float *fp8_scratch;   /* FP8 layers: [threads] x q3_matmul_fp8_scratch_floats(R, max K), else NULL */
    q3_attn_seq *attn_seqs; /* [seqs] */
} q3_workspace;

/* Calls of at most this many rows run whole experts per thread (moe_block.c). */
#define Q3_MOE_THREAD_ROWS 15

/* one thread's buffers for that: the expert's inputs, gate and up activations */
static inline int64_t q3_expert_thread_floats(const q3_config *c) {
    return ((int64_t)Q3_MOE_THREAD_ROWS * (c->hidden + 2 * c->moe_inter) + 15) / 16 * 16;
}

/* and its bf16 scratch for the matmuls: Q3_MOE_THREAD_ROWS rows of the longer of H and I */
static inline int64_t q3_expert_thread_xb(const q3_config *c) {
    return q3_matmul_scratch_elems(Q3_MOE_THREAD_ROWS, c->hidden > c->moe_inter ? c->hidden : c->moe_inter);
}

/* Makes room for `rows` rows and `seqs` sequences; keeps the old block on failure. */
q3_status q3_workspace_reserve(q3_workspace *ws, const q3_config *cfg, int fp8, int64_t rows, int seqs,
                               q3_error *err);
void q3_workspace_release(q3_workspace *ws);
/* Lays the arrays out from base (NULL: only measures) for R rows, S sequences and `threads`
 * threads (with the quantized matmuls' scratch when fp8: FP8 or GPTQ int4); returns the bytes. For a device block
 * the host-only scratch is simply unused. */
size_t q3_workspace_layout(q3_workspace *w, char *base, const q3_config *c, int fp8, int64_t R, int S,
                           int threads);

#endif
