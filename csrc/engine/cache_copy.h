/* The copies of the cache's operations (cache_ops.c, cache_accept.c): a sequence's rows moved
 * between blocks of K and V on the host or on a CUDA device, and its hidden flags (cache.h)
 * on the host. Internal to the engine. */
#ifndef Q3_ENGINE_CACHE_COPY_H
#define Q3_ENGINE_CACHE_COPY_H

#include "cache.h"

/* Where an operation's copies go: memcpy for a host cache; for a device cache, 2-D device
 * copies queued on `stream` (a cudaStream_t). Ordering against the layer's calls, which queue
 * on the caller's stream: a caller that names its stream (the glue's stream=, torch's current
 * stream) gets the copies queued there, behind its layer calls and before its next ones, with
 * no wait; stream NULL (none named) queues them on the legacy default stream between two
 * synchronizations of the whole device, so they are ordered against work on any stream at the
 * cost of two waits. The first failure is kept, with the operation's name before its text, and
 * the copies after it are skipped. */
typedef struct {
    const char *op;
    int device; /* -1: host */
    void *stream;
    q3_error *err;
    q3_status status;
} q3_copier;

/* bytes of one [head_dim] row; the [kv_heads, capacity, head_dim] block of sequence seq in k
 * (values = 0) or v */
size_t q3_cache_row_bytes(const q3_cache *c);
char *q3_cache_seq_block(const q3_cache *c, int seq, int values);

/* a backend failure kept in cp, its message prefixed with the operation's name */
void q3_copier_failed(q3_copier *cp, q3_status s);
/* the copies of operation `op` on a cache on `device` begin (no stream: the device waited
 * for first); after the last, q3_copier_end (no stream: waits again); the first failure */
q3_status q3_copier_begin(q3_copier *cp, const char *op, int device, void *stream, q3_error *err);
q3_status q3_copier_end(q3_copier *cp);
/* kv_heads rows of head_bytes from a block of heads src_stride bytes apart to one dst_stride
 * apart (never overlapping; nothing when dst == src or after a failure) */
void q3_copy_heads(q3_copier *cp, char *dst, size_t dst_stride, const char *src, size_t src_stride, int kv_heads,
                   size_t head_bytes);
/* sequence `from` of src -> sequence `to` of dst: the first n tokens of K and V */
void q3_copy_seq(q3_copier *cp, q3_cache *dst, int to, const q3_cache *src, int from, int64_t n);

/* sequence seq's hidden flags [capacity]; sequence `to` of c takes flags [n] (n its new
 * hidden_end, those past cleared); sequence `from` of src -> sequence `to` of dst */
uint8_t *q3_cache_seq_flags(const q3_cache *c, int seq);
void q3_cache_set_flags(q3_cache *c, int to, const uint8_t *flags, int64_t n);
void q3_cache_copy_flags(q3_cache *dst, int to, const q3_cache *src, int from);

#endif
