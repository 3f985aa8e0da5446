/* Causal GQA attention of L new tokens over a sequence's KV cache.
 *
 * The one attention routine of the layer: prefill (n_past = 0, L = S), a prefill chunk
 * (n_past = tokens already cached) and decode (L = 1) are the same call. The block's own
 * keys and values are written to the cache first, so the query at cache row i = n_past + t
 * attends to rows [first_key, i] (first_key: the sequence's leading padding, 0 by default),
 * less the hidden ones: tokens whose call masked them (right padding, holes), which no query
 * sees. A query with no key to see (a padding row, i < first_key) sees only itself.
 * Query head h reads KV head h / (Hq / Hkv).
 * Softmax in fp32, computed online over key tiles: the working set is one tile of keys,
 * values and scores for a block of queries, whatever the context length. */
#ifndef Q3_KERNELS_ATTENTION_H
#define Q3_KERNELS_ATTENTION_H

#include "dtype.h"

typedef struct {
    const void *k;   /* [Hkv, capacity, D] keys of this sequence, after QK-norm and RoPE */
    const void *v;   /* [Hkv, capacity, D] values of this sequence */
    int64_t n_past;  /* cached tokens before this block */
    int64_t start;   /* leading padding: the rows before it are padding (positions count from
                        it; attention reads first_key) */
    int64_t first_pos; /* RoPE position of the first real token (cache row start): row i >= start
                          is at first_pos + i - start, a padding row at 0 */
    const uint8_t *hidden; /* [capacity] nonzero: a key no query sees (a token its call masked);
                              NULL: none hidden. In the memory the kernel runs in (host for the
                              CPU kernels, the device for the CUDA ones) */
    int64_t first_key; /* the first row >= start that is not hidden (n_past + L when none;
                          start when hidden is NULL): a query at row i >= first_key sees the
                          keys of [first_key, i] not hidden, one at i < first_key only itself */
    const uint8_t *tree; /* [tree_tokens, tree_tokens] a call's per-query mask (NULL: causal): of
                            the rows from tree_first on (the call's tokens u), the query at row
                            tree_first + t sees those with tree[t * tree_tokens + u] (u <= t, its
                            own set), the rows before as above; memory as hidden's */
    int64_t tree_first;
    int64_t tree_tokens;
} q3_attn_seq;

typedef struct {
    int64_t L;         /* new tokens per sequence */
    int heads;         /* Hq query heads */
    int kv_heads;      /* Hkv; heads % kv_heads == 0 */
    int head_dim;      /* D */
    int64_t capacity;  /* cache rows per (sequence, KV head) */
    q3_dtype kv_dtype; /* storage dtype of k and v */
    float scale;       /* 1 / sqrt(D) */
    int64_t max_keys;  /* the most keys any query of the call sees (0: unknown); lets the CUDA
                          kernel split long contexts across blocks */
} q3_attn_shape;

#define Q3_ATTN_QUERY_BLOCK 4 /* query tokens of one KV head processed together */
#define Q3_ATTN_KEY_TILE 64   /* keys per step of the online softmax */

/* scratch floats one thread needs: for the block's query rows (padded to 16) the queries
 * transposed, accumulators, scores, running max and sum; one tile of keys and of values in
 * fp32 (head_dim padded to 32); 64-byte multiples */
static inline int64_t q3_attention_scratch_floats(const q3_attn_shape *s) {
    const int64_t rows = ((int64_t)Q3_ATTN_QUERY_BLOCK * (s->heads / s->kv_heads) + 15) / 16 * 16;
    const int64_t dp = (s->head_dim + 31) / 32 * 32;
    return rows * (2 * dp + Q3_ATTN_KEY_TILE + 2) + 2 * (int64_t)Q3_ATTN_KEY_TILE * dp + 64;
}

/* out [n_seqs, L, Hq, D] fp32 <- q [n_seqs, L, Hq, D] fp32 (after QK-norm and RoPE).
 * scratch: threads * q3_attention_scratch_floats(shape) floats; at most `threads` threads. */
typedef void q3_attention_fn(float *out, const float *q, const q3_attn_seq *seqs, int n_seqs,
                             const q3_attn_shape *shape, float *scratch, int threads);

/* The attention probabilities of the same call, for introspection (computed on request
 * only, never on the layer's own path): for sequence s, query head h and new token t,
 *     probs[((s * Hq + h) * out_tokens + t0 + t) * context + j] = softmax_j(scale q . K[j])
 * over the keys the attention routine lets that query see (j in [first_key, n_past + t] not
 * hidden; a query before first_key only itself), and 0 in every other column j < context. q as above
 * [n_seqs, L, Hq, D]; rows t0 .. t0 + L - 1 of each (s, h) are written, the rest untouched
 * (a call in passes fills them pass by pass). Needs context >= n_past + L for every sequence
 * and t0 + L <= out_tokens. fp32 throughout; at most `threads` threads, no scratch. */
typedef void q3_attention_probs_fn(float *probs, const float *q, const q3_attn_seq *seqs, int n_seqs,
                                   const q3_attn_shape *shape, int64_t t0, int64_t out_tokens, int64_t context,
                                   int threads);

#endif
