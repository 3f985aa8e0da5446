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

#include <stdatomic.h>

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
    uint8_t *hidden;  /* [batch, capacity] (host memory always) nonzero: a token its call masked
                         (right padding, a hole), which no query sees; 0 from hidden_end on */
    int64_t *hidden_end; /* [batch] 1 + the last hidden token (0: none, and attention then reads
                            no flag: an unmasked call costs nothing); at most the length between calls */
    int64_t *verify_start; /* [batch] the first row of the sequence's last call when that was a tree
                              call (a verify), which accept may compact; -1 otherwise, and after
                              any other call or operation */
    void *k;          /* [batch, kv_heads, capacity, head_dim] */
    void *v;          /* [batch, kv_heads, capacity, head_dim] */
    q3_cache_blocks *blocks; /* the owner of k and v, the cache's reference (views hold others) */
};

/* K and V with the count of their holders: the cache and the views taken of them (atomic: a
 * view's reference may go on another thread while the cache grows without the GIL) */
struct q3_cache_blocks {
    void *k, *v;
    int device;
    atomic_int refs;
};

/* the bytes of one of K or V for this geometry in *n; 0 when the size overflows (or passes
 * INT64_MAX / 2, so that K and V together fit too) */
int q3_cache_block_bytes(int batch, int64_t capacity, int kv_heads, int head_dim, q3_dtype dtype, int64_t *n);
/* K and V of n zeroed bytes each on the host (every page touched now, so that appending a token
 * never faults new memory in) or on CUDA device `device`, held once; NULL when they cannot be had */
q3_cache_blocks *q3_cache_blocks_new(size_t n, int device);

/* Q3_ERR_INDEX unless 0 <= seq < batch, the message naming the argument `arg` */
q3_status q3_cache_check_seq(const q3_cache *c, const char *arg, int64_t seq, q3_error *err);

/* what attention reads of sequence seq when L new tokens follow the held ones (their K/V and
 * hidden flags written): its K and V blocks, length, padding, first position, and the hidden
 * flags with the first key (kernels/attention.h) */
q3_attn_seq q3_cache_attn_seq(const q3_cache *c, int seq, int64_t L);

/* The hidden flags of the L tokens about to follow sequence seq's held ones, from the call's
 * token mask [L] (0: hidden; NULL: none hidden), before their attention reads them. */
void q3_cache_mark_rows(q3_cache *c, int seq, int64_t L, const uint8_t *mask);
/* hidden_end brought back within the tokens held, after sequence seq's length shrank */
void q3_cache_hidden_trim(q3_cache *c, int seq);

#endif
