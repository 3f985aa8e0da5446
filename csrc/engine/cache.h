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
    int64_t *first_pos; /* [batch] the first real token's position (0 unless set): RoPE's
                           position of row i >= padding is first_pos + i - padding */
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
/* the first real token of sequence seq sits at position p (RoPE's, 0 by default: a caller
 * whose positions count its left padding, or run on from elsewhere); only while it is empty;
 * 0 <= p, p + capacity <= Q3_MAX_POSITIONS */
q3_status q3_cache_set_first_position(q3_cache *c, int seq, int64_t p, q3_error *err);
/* keep the first n tokens of sequence seq (n <= its length) */
q3_status q3_cache_truncate(q3_cache *c, int seq, int64_t n, q3_error *err);

/* Operations for generation (cache_ops.c). Each checks every argument before it writes and
 * leaves the cache as it was on failure. Lengths, padding and first positions travel with the tokens. On a
 * device cache the copying ones queue 2-D device copies on `stream` (a cudaStream_t: ordered
 * with the caller's layer calls on it, no wait); stream NULL: on the default stream between
 * two synchronizations of the device (ordered against every stream). A CUDA error leaves
 * lengths and padding unchanged (Q3_ERR_STATE, its text in the message). `stream` is ignored
 * for host caches. */
/* dst sequence i <- src sequence index[i], for i < n = dst->batch (indices may repeat): a
 * prompt expanded to beams, a subset kept, a whole cache copied. dst and src are distinct
 * caches on one device of the same kv_heads, head_dim and dtype; dst's capacity may differ
 * but must hold each copied sequence. Only the tokens held are copied. */
q3_status q3_cache_gather(q3_cache *dst, const q3_cache *src, const int *index, int n, void *stream, q3_error *err);
/* in place: sequence i <- old sequence index[i], n = c->batch (indices may repeat: beam
 * search). Takes a spare block of at most one sequence's tokens while it runs (on the
 * cache's device: allocating and freeing it waits for the device). */
q3_status q3_cache_reorder(q3_cache *c, const int *index, int n, void *stream, q3_error *err);
/* keep the first `length` tokens of sequence seq (seq < 0: of every sequence); a sequence
 * holding fewer keeps what it holds. length < 0 drops -length tokens from the end of each
 * (an error if one holds fewer). The same as transformers' Cache.crop on a batch. */
q3_status q3_cache_crop(q3_cache *c, int seq, int64_t length, q3_error *err);
/* the first `length` tokens of src_seq (length <= its length) become sequence dst_seq's
 * whole content (prefix reuse); padding min(src's, length). src_seq == dst_seq truncates. */
q3_status q3_cache_copy_prefix(q3_cache *c, int src_seq, int dst_seq, int64_t length, void *stream, q3_error *err);

/* base of sequence seq's [kv_heads, capacity, head_dim] block */
void *q3_cache_seq_keys(const q3_cache *c, int seq);
void *q3_cache_seq_values(const q3_cache *c, int seq);
size_t q3_cache_bytes(const q3_cache *c);
/* what attention reads of sequence seq: its K and V blocks, length and padding */
q3_attn_seq q3_cache_attn_seq(const q3_cache *c, int seq);

#endif
