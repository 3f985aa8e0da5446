/* KV cache operations that generation needs: reorder and gather sequences (beam search, a
 * prompt expanded to beams, a cache copied), crop, copying a prefix between sequences, and
 * growing every sequence's room (a generation that outgrows the cache it began with).
 *
 * Layout as in cache.h: k and v are [batch, kv_heads, capacity, head_dim]. A sequence is
 * moved as kv_heads blocks of [length, head_dim] (contiguous within a head, capacity *
 * head_dim apart between heads): only the tokens it holds are copied, never the capacity.
 *
 * Every operation checks all of its arguments before it writes anything, and takes the
 * memory it needs before it writes, so that a failure leaves the cache as it was. On a device
 * cache (device >= 0) the same moves are 2-D device copies through the device backend (one
 * per sequence, K or V: rows = kv_heads, width = the tokens held, pitch = a head's capacity),
 * queued on the caller's stream (see `q3_copier`); a CUDA error there leaves lengths and padding
 * as they were and is reported with its text. Cropping touches only the host-side lengths. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache_copy.h"
#include "device_backend.h"

/* index [n] as a caller gave it: each entry a sequence of c */
static q3_status check_index(const q3_cache *c, const int64_t *index, int64_t n, q3_error *err) {
    for (int64_t i = 0; i < n; i++)
        if (index[i] < 0 || index[i] >= c->batch)
            return q3_fail(err, Q3_ERR_INDEX, "index[%lld]: expected 0 <= index < %d (the cache's batch), got %lld",
                           (long long)i, c->batch, (long long)index[i]);
    return Q3_OK;
}

/* dst sequence i <- src sequence index[i], for i < dst->batch: dst a new cache of src's geometry,
 * capacity and device, index checked. Only the tokens held are copied. */
static q3_status gather(q3_cache *dst, const q3_cache *src, const int64_t *index, void *stream, q3_error *err) {
    q3_copier cp;
    q3_status s = q3_copier_begin(&cp, "gather", src->device, stream, err);
    if (s != Q3_OK) return s;
    for (int i = 0; i < dst->batch; i++) q3_copy_seq(&cp, dst, i, src, (int)index[i], src->lengths[index[i]]);
    if ((s = q3_copier_end(&cp)) != Q3_OK) return s;
    for (int i = 0; i < dst->batch; i++) {
        dst->lengths[i] = src->lengths[index[i]];
        dst->padding[i] = src->padding[index[i]];
        dst->first_pos[i] = src->first_pos[index[i]];
        q3_cache_copy_flags(dst, i, src, (int)index[i]);
    }
    return Q3_OK;
}

/* *out <- a new cache of `batch` sequences like src (geometry, capacity, device) gathered from
 * src's index[batch] (checked); NULL on failure */
static q3_status gather_new(q3_cache **out, const q3_cache *src, const int64_t *index, int batch, void *stream,
                            q3_error *err) {
    q3_status s = q3_cache_create_on(out, batch, src->capacity, src->kv_heads, src->head_dim, src->dtype,
                                     src->device, err);
    if (s == Q3_OK && (s = gather(*out, src, index, stream, err)) != Q3_OK) {
        q3_cache_destroy(*out);
        *out = NULL;
    }
    return s;
}

q3_status q3_cache_select(q3_cache **out, const q3_cache *src, const int64_t *index, int64_t n, void *stream,
                          q3_error *err) {
    *out = NULL;
    q3_status s = check_index(src, index, n, err);
    if (s != Q3_OK) return s;
    if (n < 1 || n > INT_MAX)
        return q3_fail(err, Q3_ERR_VALUE, "index: expected 1 to %d entries, got %lld", INT_MAX, (long long)n);
    return gather_new(out, src, index, (int)n, stream, err);
}

/* the index of sequence i * n + j is i: int64 [batch * n], at most INT_MAX entries */
q3_status q3_cache_repeat_interleave(q3_cache **out, const q3_cache *src, int64_t n, void *stream, q3_error *err) {
    *out = NULL;
    if (n < 1 || n > INT_MAX / src->batch)
        return q3_fail(err, Q3_ERR_VALUE, "n: expected 1 <= n <= %d (a batch of at most %d from %d sequences), "
                       "got %lld", INT_MAX / src->batch, INT_MAX, src->batch, (long long)n);
    const int batch = src->batch * (int)n;
    int64_t *index = malloc((size_t)batch * sizeof *index);
    if (!index) return q3_fail(err, Q3_ERR_NOMEM, "repeat_interleave: out of memory for %d indices", batch);
    for (int i = 0; i < batch; i++) index[i] = i / (int)n;
    q3_status s = gather_new(out, src, index, batch, stream, err);
    free(index);
    return s;
}

q3_status q3_cache_copy(q3_cache **out, const q3_cache *src, void *stream, q3_error *err) {
    return q3_cache_repeat_interleave(out, src, 1, stream, err); /* index i -> i */
}

/* ---- reorder in place ------------------------------------------------------------ */

/* One step of an in-place reorder: slot dst <- slot src, or slot src -> the spare block
 * (dst == SPARE), or the spare block -> slot dst (src == SPARE). */
enum { SPARE = -1 };
typedef struct {
    int dst, src;
} move;

/* Orders the copies of new[i] <- old[index[i]] so that no slot is overwritten while a later
 * copy still reads it. A slot that no pending copy reads is written first (a leaf of the
 * map i -> index[i]), which may free its source for writing in turn. What is left when no
 * such slot remains is a set of cycles (each slot read by exactly one other): each goes
 * through the spare block, starting at its shortest sequence so the spare is smallest.
 * Writes the moves (at most 2 * batch) and returns their count; *spare_tokens gets the
 * tokens the spare block must hold. need [batch] and pending [batch] are scratch. */
static int plan_reorder(const q3_cache *c, const int64_t *index, int *need, char *pending, move *moves,
                        int64_t *spare_tokens) {
    const int B = c->batch;
    int n = 0, top = 0;
    int *stack = need + B; /* need has 2 * B entries: the counts, then a stack of ready slots */
    memset(need, 0, (size_t)B * sizeof *need);
    for (int i = 0; i < B; i++) {
        pending[i] = index[i] != i;
        if (pending[i]) need[index[i]]++;
    }
    for (int i = 0; i < B; i++)
        if (pending[i] && need[i] == 0) stack[top++] = i;
    while (top > 0) {
        const int i = stack[--top], from = (int)index[i];
        moves[n++] = (move){i, from};
        pending[i] = 0;
        if (--need[from] == 0 && pending[from]) stack[top++] = from;
    }
    *spare_tokens = 0;
    for (int i = 0; i < B; i++) {
        if (!pending[i]) continue;
        int start = i; /* the cycle's shortest sequence */
        for (int j = (int)index[i]; j != i; j = (int)index[j])
            if (c->lengths[j] < c->lengths[start]) start = j;
        if (c->lengths[start] > *spare_tokens) *spare_tokens = c->lengths[start];
        moves[n++] = (move){SPARE, start};
        int j = start;
        for (; index[j] != start; j = (int)index[j]) {
            moves[n++] = (move){j, (int)index[j]};
            pending[j] = 0;
        }
        moves[n++] = (move){j, SPARE};
        pending[j] = 0;
    }
    return n;
}

/* the spare block's memory: on the cache's side (host or device) */
static void *spare_alloc(const q3_cache *c, size_t bytes) {
    return c->device < 0 ? q3_alloc(bytes) : q3_device()->alloc_zeroed(bytes, c->device);
}

/* frees the spare after the copies that read it: a device spare once its stream has run them */
static void spare_free(const q3_cache *c, void *spare, q3_copier *cp) {
    if (!spare) return;
    if (c->device < 0) {
        q3_free(spare);
        return;
    }
    if (cp->stream) {
        q3_status s = q3_device()->synchronize(c->device, cp->stream, cp->err);
        if (s != Q3_OK && cp->status == Q3_OK) q3_copier_failed(cp, s);
    }
    q3_device()->free(spare);
}

q3_status q3_cache_reorder(q3_cache *c, const int64_t *index, int64_t n, void *stream, q3_error *err) {
    q3_status s;
    if ((s = check_index(c, index, n, err)) != Q3_OK) return s;
    if (n != c->batch)
        return q3_fail(err, Q3_ERR_VALUE, "index: expected %d entries (the cache's batch), got %lld", c->batch,
                       (long long)n);
    const int B = c->batch;
    int *need = malloc((size_t)B * 2 * sizeof *need);
    char *pending = malloc((size_t)B);
    move *moves = malloc((size_t)B * 2 * sizeof *moves);
    int64_t *lengths = malloc((size_t)B * 5 * sizeof *lengths), *padding = lengths + B, *first = lengths + 2 * B;
    int64_t *hidden_end = lengths + 3 * B, *flags_at = lengths + 4 * B;
    uint8_t *flags = NULL; /* the old hidden flags of every sequence, packed: sequence i's at flags_at[i] */
    char *spare = NULL;
    q3_copier cp = {"reorder", c->device, stream, err, Q3_OK};
    if (!need || !pending || !moves || !lengths) {
        s = q3_fail(err, Q3_ERR_NOMEM, "reorder: out of memory for the plan of %d sequences", B);
        goto done;
    }
    int64_t spare_tokens;
    const int n_moves = plan_reorder(c, index, need, pending, moves, &spare_tokens);
    const size_t rb = q3_cache_row_bytes(c), stride = (size_t)c->capacity * rb, spare_head = (size_t)spare_tokens * rb;
    /* the spare block: [2 (K, V), kv_heads, spare_tokens, head_dim], heads packed */
    if (spare_tokens > 0 && !(spare = spare_alloc(c, 2 * (size_t)c->kv_heads * spare_head))) {
        s = q3_fail(err, Q3_ERR_NOMEM, "reorder: cannot allocate a spare block of %lld tokens on %s",
                    (long long)spare_tokens, c->device < 0 ? "the host" : "the CUDA device");
        goto done;
    }
    int64_t flag_bytes = 0; /* at most batch x capacity: fits */
    for (int i = 0; i < B; i++) {
        lengths[i] = c->lengths[index[i]];
        padding[i] = c->padding[index[i]];
        first[i] = c->first_pos[index[i]];
        hidden_end[i] = c->hidden_end[index[i]];
        flag_bytes += c->hidden_end[i];
    }
    if (flag_bytes > 0 && !(flags = malloc((size_t)flag_bytes))) {
        s = q3_fail(err, Q3_ERR_NOMEM, "reorder: out of memory for %lld hidden flags", (long long)flag_bytes);
        goto done;
    }
    if ((s = q3_copier_begin(&cp, "reorder", c->device, stream, err)) != Q3_OK) goto done;
    /* c->lengths holds the old lengths until every block has moved */
    for (int m = 0; m < n_moves; m++) {
        const move mv = moves[m];
        for (int values = 0; values < 2; values++) {
            char *spare_v = spare ? spare + (size_t)values * c->kv_heads * spare_head : NULL;
            if (mv.dst == SPARE)
                q3_copy_heads(&cp, spare_v, spare_head, q3_cache_seq_block(c, mv.src, values), stride, c->kv_heads,
                           (size_t)c->lengths[mv.src] * rb);
            else if (mv.src == SPARE)
                q3_copy_heads(&cp, q3_cache_seq_block(c, mv.dst, values), stride, spare_v, spare_head, c->kv_heads,
                           (size_t)c->lengths[index[mv.dst]] * rb);
            else
                q3_copy_heads(&cp, q3_cache_seq_block(c, mv.dst, values), stride, q3_cache_seq_block(c, mv.src, values), stride,
                           c->kv_heads, (size_t)c->lengths[mv.src] * rb);
        }
    }
    q3_copier_end(&cp);
    spare_free(c, spare, &cp); /* before the lengths: a failed wait for the stream counts too */
    spare = NULL;
    if ((s = cp.status) != Q3_OK) goto done;
    memcpy(c->lengths, lengths, (size_t)B * sizeof *lengths);
    memcpy(c->padding, padding, (size_t)B * sizeof *padding);
    memcpy(c->first_pos, first, (size_t)B * sizeof *first);
    if (flags) { /* the old flags out, then each sequence's from its source */
        for (int64_t i = 0, at = 0; i < B; at += c->hidden_end[i], i++) {
            flags_at[i] = at;
            memcpy(flags + at, q3_cache_seq_flags(c, (int)i), (size_t)c->hidden_end[i]);
        }
        for (int i = 0; i < B; i++) q3_cache_set_flags(c, i, flags + flags_at[index[i]], hidden_end[i]);
    }
done:
    free(flags);
    spare_free(c, spare, &cp);
    free(need);
    free(pending);
    free(moves);
    free(lengths);
    return s;
}

/* ---- crop and prefix copy ---------------------------------------------------------- */

/* the length sequence seq keeps under crop(length): see cache.h */
static q3_status crop_length(const q3_cache *c, int seq, int64_t length, int64_t *keep, q3_error *err) {
    const int64_t held = c->lengths[seq];
    if (length >= 0) {
        *keep = length < held ? length : held;
        return Q3_OK;
    }
    if (length < -held) /* -length > held, written so that INT64_MIN does not overflow */
        return q3_fail(err, Q3_ERR_VALUE,
                       "length: expected -%lld <= length (sequence %d holds %lld tokens), got %lld",
                       (long long)held, seq, (long long)held, (long long)length);
    *keep = held + length;
    return Q3_OK;
}

q3_status q3_cache_crop(q3_cache *c, const int64_t *seq, int64_t length, q3_error *err) {
    q3_status s = seq ? q3_cache_check_seq(c, "seq", *seq, err) : Q3_OK;
    if (s != Q3_OK) return s;
    const int first = seq ? (int)*seq : 0, last = seq ? (int)*seq + 1 : c->batch;
    int64_t keep = 0;
    for (int i = first; i < last; i++) {
        q3_status s = crop_length(c, i, length, &keep, err);
        if (s != Q3_OK) return s;
    }
    for (int i = first; i < last; i++) {
        crop_length(c, i, length, &keep, NULL);
        q3_cache_truncate(c, i, keep, NULL);
    }
    return Q3_OK;
}

q3_status q3_cache_copy_prefix(q3_cache *c, int64_t src_seq, int64_t dst_seq, int64_t length, void *stream,
                               q3_error *err) {
    q3_status s = q3_cache_check_seq(c, "src_seq", src_seq, err);
    if (s == Q3_OK) s = q3_cache_check_seq(c, "dst_seq", dst_seq, err);
    if (s != Q3_OK) return s;
    if (length < 0 || length > c->lengths[src_seq])
        return q3_fail(err, Q3_ERR_VALUE, "length: expected 0 <= length <= %lld (the length of sequence %lld), got "
                       "%lld", (long long)c->lengths[src_seq], (long long)src_seq, (long long)length);
    q3_copier cp;
    if ((s = q3_copier_begin(&cp, "copy_prefix", c->device, stream, err)) != Q3_OK) return s;
    q3_copy_seq(&cp, c, (int)dst_seq, c, (int)src_seq, length); /* nothing when src_seq == dst_seq */
    if ((s = q3_copier_end(&cp)) != Q3_OK) return s;
    c->lengths[dst_seq] = length;
    c->padding[dst_seq] = c->padding[src_seq] < length ? c->padding[src_seq] : length;
    c->first_pos[dst_seq] = c->first_pos[src_seq];
    q3_cache_copy_flags(c, (int)dst_seq, c, (int)src_seq);
    q3_cache_hidden_trim(c, (int)dst_seq);
    return Q3_OK;
}

/* ---- growth ----------------------------------------------------------------------- */

q3_status q3_cache_grow(q3_cache *c, int64_t capacity, void *stream, q3_error *err) {
    if (capacity == c->capacity) return Q3_OK; /* nothing to move */
    if (capacity < c->capacity)
        return q3_fail(err, Q3_ERR_VALUE, "max_tokens: expected at least the cache's capacity %lld, got %lld",
                       (long long)c->capacity, (long long)capacity);
    if (capacity > Q3_MAX_POSITIONS)
        return q3_fail(err, Q3_ERR_VALUE, "max_tokens: expected at most 2^40 (the positions RoPE takes), got %lld",
                       (long long)capacity);
    for (int i = 0; i < c->batch; i++) /* q3_cache_set_first_position's bound, for the new capacity */
        if (c->first_pos[i] > Q3_MAX_POSITIONS - capacity)
            return q3_fail(err, Q3_ERR_VALUE,
                           "max_tokens: sequence %d's first position %lld and a capacity of %lld reach past 2^40 "
                           "positions", i, (long long)c->first_pos[i], (long long)capacity);
    int64_t n;
    if (!q3_cache_block_bytes(c->batch, capacity, c->kv_heads, c->head_dim, c->dtype, &n))
        return q3_fail(err, Q3_ERR_VALUE,
                       "max_tokens: %lld tokens x batch %d x %d KV heads x %d dims do not fit in memory "
                       "(the size overflows)", (long long)capacity, c->batch, c->kv_heads, c->head_dim);
    q3_cache grown = *c; /* the same sequences in the new blocks */
    grown.capacity = capacity;
    grown.blocks = q3_cache_blocks_new((size_t)n, c->device);
    if (grown.blocks) grown.k = grown.blocks->k, grown.v = grown.blocks->v;
    grown.hidden = grown.blocks ? calloc((size_t)c->batch, (size_t)capacity) : NULL;
    q3_copier cp;
    q3_status s = Q3_OK;
    if (!grown.hidden)
        s = q3_fail(err, Q3_ERR_NOMEM, "max_tokens: cannot allocate 2 x %lld bytes on %s for %lld tokens a sequence",
                    (long long)n, c->device < 0 ? "the host" : "the CUDA device", (long long)capacity);
    if (s == Q3_OK && (s = q3_copier_begin(&cp, "grow", c->device, stream, err)) == Q3_OK) {
        for (int i = 0; i < c->batch; i++) q3_copy_seq(&cp, &grown, i, c, i, c->lengths[i]);
        q3_copier_end(&cp);
        if (c->device >= 0 && stream && cp.status == Q3_OK) { /* the old blocks are read until the copies ran */
            q3_status w = q3_device()->synchronize(c->device, stream, err);
            if (w != Q3_OK) q3_copier_failed(&cp, w);
        }
        s = cp.status;
    }
    if (s != Q3_OK) {
        q3_cache_blocks_unref(grown.blocks);
        free(grown.hidden);
        return s;
    }
    for (int i = 0; i < c->batch; i++) q3_cache_copy_flags(&grown, i, c, i);
    free(c->hidden);
    c->hidden = grown.hidden;
    q3_cache_blocks_unref(c->blocks); /* freed now unless views of them live */
    c->blocks = grown.blocks;
    c->k = grown.k;
    c->v = grown.v;
    c->capacity = capacity;
    c->growths++;
    return Q3_OK;
}

/* ---- one call, as a binding makes it ----------------------------------------------- */

static q3_status cache_op(q3_cache *c, q3_cache_call_args *a, q3_error *err) {
    const int64_t *seq = a->every_seq ? NULL : &a->seq;
    switch (a->op) {
    case Q3_CACHE_RESET: return q3_cache_reset(c, seq, err);
    case Q3_CACHE_TRUNCATE: return q3_cache_truncate(c, a->seq, a->n, err);
    case Q3_CACHE_SET_PADDING: return q3_cache_set_padding(c, a->seq, a->n, err);
    case Q3_CACHE_SET_FIRST_POSITION: return q3_cache_set_first_position(c, a->seq, a->n, err);
    case Q3_CACHE_CROP: return q3_cache_crop(c, seq, a->n, err);
    case Q3_CACHE_COPY_PREFIX: return q3_cache_copy_prefix(c, a->src_seq, a->seq, a->n, a->stream, err);
    case Q3_CACHE_REORDER: return q3_cache_reorder(c, a->index, a->n, a->stream, err);
    case Q3_CACHE_SELECT: return q3_cache_select(&a->out, c, a->index, a->n, a->stream, err);
    case Q3_CACHE_REPEAT_INTERLEAVE: return q3_cache_repeat_interleave(&a->out, c, a->n, a->stream, err);
    case Q3_CACHE_COPY: return q3_cache_copy(&a->out, c, a->stream, err);
    case Q3_CACHE_GROW: return q3_cache_grow(c, a->n, a->stream, err);
    case Q3_CACHE_ACCEPT: return q3_cache_accept(c, a->seq, a->index, a->n, a->stream, err);
    }
    return q3_fail(err, Q3_ERR_VALUE, "q3_cache_call: expected an operation, got %d", (int)a->op);
}

q3_status q3_cache_call(q3_cache *c, q3_cache_call_args *a, q3_error *err) {
    const q3_status s = cache_op(c, a, err);
    if (s == Q3_OK && a->op != Q3_CACHE_GROW && a->op != Q3_CACHE_ACCEPT) /* a verify's rows stay where accept looks only through a growth */
        for (int i = 0; i < c->batch; i++) c->verify_start[i] = -1;
    return s;
}
