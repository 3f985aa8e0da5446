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
    q3_dtype dtype;
    int device;       /* -1: host memory; else the CUDA device holding k and v */
    int64_t *lengths; /* [batch] tokens held by each sequence (host memory always) */
    int64_t *padding; /* [batch] leading tokens of each sequence that are padding: later tokens
                         do not attend to them, and positions count from the first real token */
    void *k;          /* [batch, kv_heads, capacity, head_dim] */
    void *v;          /* [batch, kv_heads, capacity, head_dim] */
};

q3_status q3_cache_create(q3_cache **out, int batch, int64_t capacity, int kv_heads,
                          int head_dim, q3_dtype dtype, q3_error *err);
/* the same on CUDA device `device` (-1: host); the CUDA backend must be open */
q3_status q3_cache_create_on(q3_cache **out, int batch, int64_t capacity, int kv_heads, int head_dim,
                             q3_dtype dtype, int device, q3_error *err);
void q3_cache_destroy(q3_cache *c);
/* seq < 0: every sequence */
q3_status q3_cache_reset(q3_cache *c, int seq, q3_error *err);
/* the first n tokens sequence seq will receive are padding; only while it is empty */
q3_status q3_cache_set_padding(q3_cache *c, int seq, int64_t n, q3_error *err);
/* keep the first n tokens of sequence seq (n <= its length) */
q3_status q3_cache_truncate(q3_cache *c, int seq, int64_t n, q3_error *err);
/* base of sequence seq's [kv_heads, capacity, head_dim] block */
void *q3_cache_seq_keys(const q3_cache *c, int seq);
void *q3_cache_seq_values(const q3_cache *c, int seq);
size_t q3_cache_bytes(const q3_cache *c);
/* what attention reads of sequence seq: its K and V blocks, length and padding */
q3_attn_seq q3_cache_attn_seq(const q3_cache *c, int seq);

#endif
