/* KV cache: one allocation per tensor at creation, and again only when it grows
 * (cache_ops.c's q3_cache_grow; layout in cache.h). */
#include <stdlib.h>
#include <string.h>

#include "cache.h"
#include "device_backend.h"

q3_status q3_cache_create(q3_cache **out, int batch, int64_t capacity, int kv_heads,
                          int head_dim, q3_dtype dtype, q3_error *err) {
    return q3_cache_create_on(out, batch, capacity, kv_heads, head_dim, dtype, -1, err);
}

static void *block_alloc(size_t n, int device) {
    if (device < 0) {
        void *p = q3_alloc(n);
        /* touch every page now, so that appending a token never faults new memory in */
        if (p) memset(p, 0, n);
        return p;
    }
    const q3_device_backend *d = q3_device();
    return d ? d->alloc_zeroed(n, device) : NULL;
}

static void block_free(void *p, int device) {
    if (device < 0) q3_free(p);
    else if (p && q3_device()) q3_device()->free(p);
}

q3_cache_blocks *q3_cache_blocks_new(size_t n, int device) {
    q3_cache_blocks *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    b->device = device;
    atomic_init(&b->refs, 1);
    b->k = block_alloc(n, device);
    b->v = b->k ? block_alloc(n, device) : NULL;
    if (b->v) return b;
    q3_cache_blocks_unref(b);
    return NULL;
}

q3_cache_blocks *q3_cache_blocks_ref(q3_cache *c) {
    atomic_fetch_add(&c->blocks->refs, 1);
    return c->blocks;
}

void q3_cache_blocks_unref(q3_cache_blocks *b) {
    if (!b || atomic_fetch_sub(&b->refs, 1) != 1) return;
    block_free(b->k, b->device);
    block_free(b->v, b->device);
    free(b);
}

int q3_cache_block_bytes(int batch, int64_t capacity, int kv_heads, int head_dim, q3_dtype dtype, int64_t *n) {
    return q3_mul_i64(batch, kv_heads, n) && q3_mul_i64(*n, capacity, n) && q3_mul_i64(*n, head_dim, n) &&
           q3_mul_i64(*n, (int64_t)q3_dtype_size(dtype), n) && *n <= INT64_MAX / 2;
}

q3_status q3_cache_create_on(q3_cache **out, int batch, int64_t capacity, int kv_heads, int head_dim,
                             q3_dtype dtype, int device, q3_error *err) {
    *out = NULL;
    if (batch <= 0) return q3_fail(err, Q3_ERR_VALUE, "batch: expected a positive integer, got %d", batch);
    if (capacity <= 0)
        return q3_fail(err, Q3_ERR_VALUE, "max_tokens: expected a positive integer, got %lld",
                       (long long)capacity);
    if (kv_heads <= 0 || head_dim <= 0)
        return q3_fail(err, Q3_ERR_VALUE, "KV cache: expected positive kv_heads and head_dim, got %d and %d",
                       kv_heads, head_dim);
    if (!q3_dtype_is_float(dtype))
        return q3_fail(err, Q3_ERR_TYPE, "dtype: expected float32, bfloat16 or float16, got %s", q3_dtype_name(dtype));
    int64_t n;
    if (!q3_cache_block_bytes(batch, capacity, kv_heads, head_dim, dtype, &n))
        return q3_fail(err, Q3_ERR_VALUE,
                       "max_tokens: %lld tokens x batch %d x %d KV heads x %d dims do not fit in memory "
                       "(the size overflows)", (long long)capacity, batch, kv_heads, head_dim);
    q3_cache *c = calloc(1, sizeof *c);
    if (!c) return q3_fail(err, Q3_ERR_NOMEM, "KV cache: out of memory");
    c->batch = batch;
    c->kv_heads = kv_heads;
    c->head_dim = head_dim;
    c->capacity = capacity;
    c->dtype = dtype;
    c->device = device;
    c->lengths = calloc((size_t)batch, sizeof *c->lengths);
    c->padding = calloc((size_t)batch, sizeof *c->padding);
    c->first_pos = calloc((size_t)batch, sizeof *c->first_pos);
    c->hidden_end = calloc((size_t)batch, sizeof *c->hidden_end);
    c->verify_start = malloc((size_t)batch * sizeof *c->verify_start);
    for (int i = 0; c->verify_start && i < batch; i++) c->verify_start[i] = -1;
    c->hidden = calloc((size_t)batch, (size_t)capacity); /* pages touched only where a mask writes */
    c->blocks = q3_cache_blocks_new((size_t)n, device);
    if (c->blocks) c->k = c->blocks->k, c->v = c->blocks->v;
    if (!c->lengths || !c->padding || !c->first_pos || !c->hidden_end || !c->hidden || !c->verify_start ||
        !c->blocks) {
        q3_cache_destroy(c);
        return q3_fail(err, Q3_ERR_NOMEM, "KV cache: cannot allocate 2 x %lld bytes on %s", (long long)n,
                       device < 0 ? "the host" : "the CUDA device");
    }
    *out = c;
    return Q3_OK;
}

void q3_cache_destroy(q3_cache *c) {
    if (!c) return;
    free(c->lengths);
    free(c->padding);
    free(c->first_pos);
    free(c->hidden_end);
    free(c->hidden);
    free(c->verify_start);
    q3_cache_blocks_unref(c->blocks); /* freed here unless a view still holds them */
    free(c);
}

/* a sequence index as a caller gave it (any int64): in [0, batch) */
q3_status q3_cache_check_seq(const q3_cache *c, const char *arg, int64_t seq, q3_error *err) {
    if (seq < 0 || seq >= c->batch)
        return q3_fail(err, Q3_ERR_INDEX, "%s: expected 0 <= %s < %d (the cache's batch), got %lld", arg, arg,
                       c->batch, (long long)seq);
    return Q3_OK;
}

static q3_status check_seq(const q3_cache *c, int64_t seq, q3_error *err) {
    return q3_cache_check_seq(c, "seq", seq, err);
}

q3_status q3_cache_reset(q3_cache *c, const int64_t *seq, q3_error *err) {
    if (!seq) {
        memset(c->lengths, 0, (size_t)c->batch * sizeof *c->lengths);
        memset(c->padding, 0, (size_t)c->batch * sizeof *c->padding);
        memset(c->first_pos, 0, (size_t)c->batch * sizeof *c->first_pos);
        for (int i = 0; i < c->batch; i++) {
            c->lengths[i] = 0;
            q3_cache_hidden_trim(c, i);
        }
        return Q3_OK;
    }
    q3_status s = check_seq(c, *seq, err);
    if (s == Q3_OK) {
        c->lengths[*seq] = c->padding[*seq] = c->first_pos[*seq] = 0;
        q3_cache_hidden_trim(c, (int)*seq);
    }
    return s;
}

q3_status q3_cache_set_padding(q3_cache *c, int64_t seq, int64_t n, q3_error *err) {
    q3_status s = check_seq(c, seq, err);
    if (s != Q3_OK) return s;
    if (c->lengths[seq] != 0)
        return q3_fail(err, Q3_ERR_STATE, "padding: sequence %lld already holds %lld tokens (set it while empty)",
                       (long long)seq, (long long)c->lengths[seq]);
    if (n < 0 || n >= c->capacity)
        return q3_fail(err, Q3_ERR_VALUE, "n: expected 0 <= n < %lld (the capacity), got %lld",
                       (long long)c->capacity, (long long)n);
    c->padding[seq] = n;
    return Q3_OK;
}

q3_status q3_cache_set_first_position(q3_cache *c, int64_t seq, int64_t p, q3_error *err) {
    q3_status s = check_seq(c, seq, err);
    if (s != Q3_OK) return s;
    if (c->lengths[seq] != 0)
        return q3_fail(err, Q3_ERR_STATE, "first_position: sequence %lld already holds %lld tokens (set it while empty)",
                       (long long)seq, (long long)c->lengths[seq]);
    if (p < 0 || p > Q3_MAX_POSITIONS - c->capacity)
        return q3_fail(err, Q3_ERR_VALUE, "position: expected 0 <= position <= %lld (2^40 less the capacity), got %lld",
                       (long long)(Q3_MAX_POSITIONS - c->capacity), (long long)p);
    c->first_pos[seq] = p;
    return Q3_OK;
}

q3_status q3_cache_truncate(q3_cache *c, int64_t seq, int64_t n, q3_error *err) {
    q3_status s = check_seq(c, seq, err);
    if (s != Q3_OK) return s;
    if (n < 0 || n > c->lengths[seq])
        return q3_fail(err, Q3_ERR_VALUE,
                       "n: expected 0 <= n <= %lld (the length of sequence %lld), got %lld",
                       (long long)c->lengths[seq], (long long)seq, (long long)n);
    c->lengths[seq] = n;
    if (c->padding[seq] > n) c->padding[seq] = n;
    q3_cache_hidden_trim(c, (int)seq);
    return Q3_OK;
}

static uint8_t *seq_hidden(const q3_cache *c, int seq) { return c->hidden + (size_t)seq * (size_t)c->capacity; }

void q3_cache_hidden_trim(q3_cache *c, int seq) {
    uint8_t *h = seq_hidden(c, seq);
    int64_t end = c->hidden_end[seq] < c->lengths[seq] ? c->hidden_end[seq] : c->lengths[seq];
    memset(h + end, 0, (size_t)(c->hidden_end[seq] - end)); /* every flag from hidden_end on stays 0 */
    while (end > 0 && !h[end - 1]) end--;
    c->hidden_end[seq] = end;
}

void q3_cache_mark_rows(q3_cache *c, int seq, int64_t L, const uint8_t *mask) {
    const int64_t n = c->lengths[seq]; /* >= hidden_end: the flags of rows n.. are 0 */
    uint8_t *h = seq_hidden(c, seq) + n;
    if (!mask) return;
    for (int64_t t = 0; t < L; t++) {
        h[t] = !mask[t];
        if (h[t]) c->hidden_end[seq] = n + t + 1;
    }
}

static size_t seq_offset(const q3_cache *c, int seq) {
    return (size_t)seq * c->kv_heads * (size_t)c->capacity * c->head_dim * q3_dtype_size(c->dtype);
}

void *q3_cache_seq_keys(const q3_cache *c, int seq) { return (char *)c->k + seq_offset(c, seq); }
void *q3_cache_seq_values(const q3_cache *c, int seq) { return (char *)c->v + seq_offset(c, seq); }

size_t q3_cache_bytes(const q3_cache *c) { return 2 * seq_offset(c, c->batch); }

int q3_cache_batch(const q3_cache *c) { return c->batch; }
int q3_cache_kv_heads(const q3_cache *c) { return c->kv_heads; }
int q3_cache_head_dim(const q3_cache *c) { return c->head_dim; }
int64_t q3_cache_capacity(const q3_cache *c) { return c->capacity; }
q3_dtype q3_cache_dtype(const q3_cache *c) { return c->dtype; }
int q3_cache_device(const q3_cache *c) { return c->device; }
int64_t q3_cache_length(const q3_cache *c, int seq) { return c->lengths[seq]; }
int64_t q3_cache_count(const q3_cache *c, q3_cache_count_id id, int seq) {
    switch (id) {
    case Q3_CC_BATCH: return c->batch;
    case Q3_CC_KV_HEADS: return c->kv_heads;
    case Q3_CC_HEAD_DIM: return c->head_dim;
    case Q3_CC_CAPACITY: return c->capacity;
    case Q3_CC_GROWTHS: return c->growths;
    case Q3_CC_BYTES: return (int64_t)q3_cache_bytes(c);
    case Q3_CC_LENGTH: return c->lengths[seq];
    case Q3_CC_PADDING: return c->padding[seq];
    case Q3_CC_FIRST_POSITION: return c->first_pos[seq];
    case Q3_CC_HIDDEN: return q3_cache_hidden_tokens(c, seq, NULL);
    }
    return 0;
}
int64_t q3_cache_hidden_tokens(const q3_cache *c, int seq, int64_t *ids) {
    int64_t n = 0; /* every hidden token lies below hidden_end */
    for (int64_t i = 0; i < c->hidden_end[seq]; i++)
        if (c->hidden[(size_t)seq * (size_t)c->capacity + (size_t)i]) {
            if (ids) ids[n] = i;
            n++;
        }
    return n;
}

int64_t q3_cache_held(const q3_cache *c) {
    int64_t n = 0; /* at most batch x capacity, which fits (the blocks' size was checked) */
    for (int i = 0; i < c->batch; i++) n += c->lengths[i];
    return n;
}

/* Strides in elements of the layout above: a head's block is capacity x head_dim, a sequence's
 * kv_heads of those; both products fit, as the blocks' byte size was checked at creation. */
q3_status q3_cache_view_of(const q3_cache *c, int values, const int64_t *seq, const int64_t *tokens,
                           q3_cache_view *v, q3_error *err) {
    const int64_t head = c->capacity * c->head_dim;
    if (seq) { /* [kv_heads, length, head_dim] of the one sequence */
        q3_status s = check_seq(c, *seq, err);
        if (s != Q3_OK) return s;
        *v = (q3_cache_view){values ? q3_cache_seq_values(c, (int)*seq) : q3_cache_seq_keys(c, (int)*seq), 3,
                             {c->kv_heads, c->lengths[*seq], c->head_dim}, {head, c->head_dim, 1}};
        return Q3_OK;
    }
    int64_t n = c->lengths[0]; /* [batch, kv_heads, n, head_dim] of every sequence */
    if (tokens && (*tokens < 0 || *tokens > c->capacity))
        return q3_fail(err, Q3_ERR_VALUE, "tokens: expected 0 <= tokens <= %lld (the cache's capacity), got %lld",
                       (long long)c->capacity, (long long)*tokens);
    if (tokens) n = *tokens;
    else
        for (int b = 1; b < c->batch; b++)
            if (c->lengths[b] != n)
                return q3_fail(err, Q3_ERR_VALUE, "tokens: the sequences hold different lengths (sequence 0: %lld, "
                               "sequence %d: %lld): pass tokens= to view that many of each", (long long)n, b,
                               (long long)c->lengths[b]);
    *v = (q3_cache_view){values ? c->v : c->k, 4, {c->batch, c->kv_heads, n, c->head_dim},
                         {c->kv_heads * head, head, c->head_dim, 1}};
    return Q3_OK;
}

q3_attn_seq q3_cache_attn_seq(const q3_cache *c, int seq, int64_t L) {
    const int64_t n = c->lengths[seq], start = c->padding[seq];
    q3_attn_seq a = {q3_cache_seq_keys(c, seq), q3_cache_seq_values(c, seq), n, start, c->first_pos[seq], NULL,
                     start, NULL, 0, 0};
    if (c->hidden_end[seq] > start) { /* hidden tokens past the padding: the kernels read the flags */
        a.hidden = seq_hidden(c, seq);
        while (a.first_key < n + L && a.hidden[a.first_key]) a.first_key++;
    }
    return a;
}
