/* The KV cache: memory allocated once, owned by the engine, for `batch` sequences of
 * independent lengths.
 *
 * Layout (keys and values alike, dtype of the cache):
 *     k [batch, kv_heads, capacity, head_dim]
 * Sequence b, KV head h, position p lives at ((b * kv_heads + h) * capacity + p) * head_dim.
 * The positions of one (sequence, head) are contiguous, so attention reads K and V of a
 * head as one stream, and keys(seq) is a strided view [kv_heads, length, head_dim].
 * Keys are stored after QK-norm and RoPE; values raw. */
#ifndef Q3_ENGINE_CACHE_H
#define Q3_ENGINE_CACHE_H

#include "../../kernels/attention.h"
#include "q3.h"

struct q3_cache {
    int batch;
    int kv_heads;
    int head_dim;
    int64_t capacity; /* tokens per sequence */
    int64_t growths;  /* the times q3_cache_grow moved it into larger blocks */
    q3_dtype dtype;
    int device;       /* -1: host memory; else the CUDA device holding k and v */
    int64_t *lengths; /* [batch] tokens held by each sequence (host memory always) */
    int64_t *padding; /* [batch] leading tokens of each sequence that are padding: later tokens
                         do not attend to them, and positions count from the first real token */
    int64_t *first_pos; /* [batch] the first real token's position (0 unless set): RoPE's
                           position of row i >= padding is first_pos + i - padding */
    void *k;          /* [batch, kv_heads, capacity, head_dim] */
    void *v;          /* [batch, kv_heads, capacity, head_dim] */
};

/* the bytes of one of K or V for this geometry in *n; 0 when the size overflows (or passes
 * INT64_MAX / 2, so that K and V together fit too) */
int q3_cache_block_bytes(int batch, int64_t capacity, int kv_heads, int head_dim, q3_dtype dtype, int64_t *n);
/* n zeroed bytes of K or V on the host (every page touched now, so that appending a token
 * never faults new memory in) or on CUDA device `device`; NULL when they cannot be had */
void *q3_cache_block_alloc(size_t n, int device);
void q3_cache_block_free(void *p, int device);

/* Q3_ERR_INDEX unless 0 <= seq < batch, the message naming the argument `arg` */
q3_status q3_cache_check_seq(const q3_cache *c, const char *arg, int64_t seq, q3_error *err);

/* what attention reads of sequence seq: its K and V blocks, length and padding */
q3_attn_seq q3_cache_attn_seq(const q3_cache *c, int seq);

#endif
