/* Causal GQA attention of L new tokens over a sequence's KV cache.
 *
 * The one attention routine of the layer: prefill (n_past = 0, L = S), a prefill chunk
 * (n_past = tokens already cached) and decode (L = 1) are the same call. The block's own
 * keys and values are written to the cache first, so the query at position n_past + t
 * attends to cache rows [0, n_past + t]. Query head h reads KV head h / (Hq / Hkv).
 * Softmax in fp32, computed online over key tiles: the working set is one tile of
 * scores per query head, whatever the context length. */
#ifndef Q3_KERNELS_ATTENTION_H
#define Q3_KERNELS_ATTENTION_H

#include "dtype.h"

typedef struct {
    const void *k;   /* [Hkv, capacity, D] keys of this sequence, after QK-norm and RoPE */
    const void *v;   /* [Hkv, capacity, D] values of this sequence */
    int64_t n_past;  /* cached tokens before this block */
} q3_attn_seq;

typedef struct {
    int64_t L;         /* new tokens per sequence */
    int heads;         /* Hq query heads */
    int kv_heads;      /* Hkv; heads % kv_heads == 0 */
    int head_dim;      /* D */
    int64_t capacity;  /* cache rows per (sequence, KV head) */
    q3_dtype kv_dtype; /* storage dtype of k and v */
    float scale;       /* 1 / sqrt(D) */
} q3_attn_shape;

/* out [n_seqs, L, Hq, D] fp32 <- q [n_seqs, L, Hq, D] fp32 (after QK-norm and RoPE) */
void q3_attention_cpu(float *out, const float *q, const q3_attn_seq *seqs, int n_seqs,
                      const q3_attn_shape *shape);

#endif
