/* The copies of the cache's operations (cache_copy.h). */
#include <stdio.h>
#include <string.h>

#include "cache_copy.h"
#include "device_backend.h"

/* bytes of one [head_dim] row */
size_t q3_cache_row_bytes(const q3_cache *c) { return (size_t)c->head_dim * q3_dtype_size(c->dtype); }

/* the [kv_heads, capacity, head_dim] block of sequence seq in k (values = 0) or v */
char *q3_cache_seq_block(const q3_cache *c, int seq, int values) {
    return values ? q3_cache_seq_values(c, seq) : q3_cache_seq_keys(c, seq);
}


/* a backend failure, its message prefixed with the operation's name */
void q3_copier_failed(q3_copier *cp, q3_status s) {
    cp->status = s;
    if (!cp->err) return;
    char msg[sizeof cp->err->msg];
    snprintf(msg, sizeof msg, "%s", cp->err->msg);
    q3_fail(cp->err, s, "%s: %s", cp->op, msg);
}

q3_status q3_copier_begin(q3_copier *cp, const char *op, int device, void *stream, q3_error *err) {
    *cp = (q3_copier){op, device, stream, err, Q3_OK};
    if (device < 0) return Q3_OK;
    const q3_device_backend *d = q3_device();
    if (!d)
        return q3_fail(err, Q3_ERR_STATE, "%s: the cache is on CUDA device %d and no device backend is open", op,
                       device);
    if (!stream) {
        q3_status s = d->synchronize(device, NULL, err);
        if (s != Q3_OK) q3_copier_failed(cp, s);
    }
    return cp->status;
}

/* after the last copy: waits for the device when no stream was named; the status */
q3_status q3_copier_end(q3_copier *cp) {
    if (cp->device >= 0 && !cp->stream && cp->status == Q3_OK) {
        q3_status s = q3_device()->synchronize(cp->device, NULL, cp->err);
        if (s != Q3_OK) q3_copier_failed(cp, s);
    }
    return cp->status;
}

/* The first n tokens of every head, from a block of heads `src_stride` bytes apart to a block
 * of heads `dst_stride` bytes apart: kv_heads rows of head_bytes. Blocks never overlap here. */
void q3_copy_heads(q3_copier *cp, char *dst, size_t dst_stride, const char *src, size_t src_stride, int kv_heads,
                       size_t head_bytes) {
    if (head_bytes == 0 || dst == src || cp->status != Q3_OK) return;
    if (cp->device < 0) {
        for (int h = 0; h < kv_heads; h++) memcpy(dst + h * dst_stride, src + h * src_stride, head_bytes);
        return;
    }
    q3_status s = q3_device()->copy_2d(dst, dst_stride, src, src_stride, head_bytes, (size_t)kv_heads, cp->device,
                                       cp->stream, cp->err);
    if (s != Q3_OK) q3_copier_failed(cp, s);
}

/* sequence `from` of src -> sequence `to` of dst: the first n tokens of K and V */
void q3_copy_seq(q3_copier *cp, q3_cache *dst, int to, const q3_cache *src, int from, int64_t n) {
    const size_t rb = q3_cache_row_bytes(src), head_bytes = (size_t)n * rb;
    for (int values = 0; values < 2; values++)
        q3_copy_heads(cp, q3_cache_seq_block(dst, to, values), (size_t)dst->capacity * rb, q3_cache_seq_block(src, from, values),
                   (size_t)src->capacity * rb, src->kv_heads, head_bytes);
}

/* sequence seq's hidden flags [capacity] (cache.h) */
uint8_t *q3_cache_seq_flags(const q3_cache *c, int seq) { return c->hidden + (size_t)seq * (size_t)c->capacity; }

/* sequence `to` of c takes the hidden flags flags [n] (n its new hidden_end), those past them
 * cleared (cache.h: 0 from hidden_end on) */
void q3_cache_set_flags(q3_cache *c, int to, const uint8_t *flags, int64_t n) {
    uint8_t *h = q3_cache_seq_flags(c, to);
    memmove(h, flags, (size_t)n);
    if (c->hidden_end[to] > n) memset(h + n, 0, (size_t)(c->hidden_end[to] - n));
    c->hidden_end[to] = n;
}

/* sequence `from` of src -> sequence `to` of dst: the flags of its hidden tokens, on the host */
void q3_cache_copy_flags(q3_cache *dst, int to, const q3_cache *src, int from) {
    q3_cache_set_flags(dst, to, q3_cache_seq_flags(src, from), src->hidden_end[from]);
}

