/* Tree verification for speculative decoding: the inputs of a verify call (a draft tree's
 * per-query mask and positions, from each token's parent), and accept, which keeps the K/V of
 * the accepted path, compacted after the tokens before the verify, and drops the rest.
 *
 * A draft tree of T tokens is given by parents [T]: -1 for a token whose parent is the last
 * cached token (a root), else the index of its parent, an earlier token of the call. Token t
 * sees the cache (less its hidden tokens) and its ancestors in the tree, itself included; its
 * position is the sequence's next position (the cache's rule) plus its depth, so that the
 * accepted path, compacted, lies at the positions a plain decode of it would have. */
#include <stdlib.h>
#include <string.h>

#include "cache_copy.h"

q3_status q3_tree_inputs(const q3_cache *c, const q3_view *parents, int64_t seq, int *ndim, int64_t shape[3],
                         uint8_t *tree, int64_t *positions, q3_error *err) {
    const int whole = parents->ndim == 2, n_seqs = whole ? c->batch : 1;
    const int64_t T = parents->ndim > 0 ? parents->shape[parents->ndim - 1] : 0;
    const int64_t want[2] = {c->batch, T}, tree_shape[3] = {n_seqs, T, T};
    int64_t cells;
    if (parents->ndim != 1 && !whole)
        return q3_fail(err, Q3_ERR_VALUE, "parents: expected shape [tokens] or [batch=%d, tokens], got %d dims",
                       c->batch, parents->ndim);
    if (parents->dtype != Q3_I64 || parents->device >= 0)
        return q3_fail(err, Q3_ERR_TYPE, "parents: expected a host tensor of dtype int64");
    q3_status st = q3_view_check_shape(parents, "parents", parents->ndim, want + !whole, err);
    if (st == Q3_OK) st = q3_view_require(parents, "parents", Q3_NEED_CONTIGUOUS, err);
    if (st != Q3_OK) return st;
    if (!q3_mul_i64(T, T, &cells) || !q3_mul_i64(cells, n_seqs, &cells))
        return q3_fail(err, Q3_ERR_VALUE, "parents: a tree of %lld tokens does not fit in memory", (long long)T);
    *ndim = parents->ndim + 1;
    memcpy(shape, tree_shape + !whole, (size_t)*ndim * sizeof *shape);
    if (!tree) return Q3_OK;
    for (int s = 0; s < n_seqs; s++) {
        const int64_t sq = whole ? s : seq;
        const q3_status bad = q3_cache_check_seq(c, "seq", sq, err); /* before its state is read */
        if (bad != Q3_OK) return bad;
        const int64_t n = c->lengths[sq], pad = c->padding[sq];
        const int64_t next = n >= pad ? c->first_pos[sq] + n - pad : 0; /* the cache's rule for row n */
        const int64_t *par = (const int64_t *)parents->data + (int64_t)s * T;
        uint8_t *rows = tree + (size_t)s * (size_t)T * (size_t)T;
        int64_t *pos = positions + (int64_t)s * T;
        memset(rows, 0, (size_t)T * (size_t)T);
        for (int64_t t = 0; t < T; t++) {
            if (par[t] < -1 || par[t] >= t)
                return q3_fail(err, Q3_ERR_VALUE, "parents[%d, %lld]: expected -1 (a root, after the cache) or an "
                               "earlier token of the tree (0 to %lld), got %lld", s, (long long)t, (long long)t - 1,
                               (long long)par[t]);
            uint8_t *row = rows + t * T;
            if (par[t] >= 0) memcpy(row, rows + par[t] * T, (size_t)t); /* the parent's ancestors */
            row[t] = 1;
            pos[t] = par[t] < 0 ? next : pos[par[t]] + 1;
        }
    }
    return Q3_OK;
}

q3_status q3_cache_accept(q3_cache *c, int64_t seq, const int64_t *kept, int64_t n, void *stream, q3_error *err) {
    q3_status s = q3_cache_check_seq(c, "seq", seq, err);
    if (s != Q3_OK) return s;
    const int64_t start = c->verify_start[seq], drafted = c->lengths[seq] - start;
    if (start < 0)
        return q3_fail(err, Q3_ERR_STATE, "accept: sequence %lld's last call was not a verify (a call with a tree), "
                       "or the cache changed since", (long long)seq);
    for (int64_t i = 0; i < n; i++)
        if (kept[i] < 0 || kept[i] >= drafted || (i > 0 && kept[i] <= kept[i - 1]))
            return q3_fail(err, Q3_ERR_VALUE, "kept[%lld]: expected increasing indices of the %lld tokens of the "
                           "verify (0 to %lld), got %lld", (long long)i, (long long)drafted, (long long)drafted - 1,
                           (long long)kept[i]);
    q3_copier cp;
    if ((s = q3_copier_begin(&cp, "accept", c->device, stream, err)) != Q3_OK) return s;
    const size_t rb = q3_cache_row_bytes(c), stride = (size_t)c->capacity * rb;
    for (int64_t i = 0; i < n; i++) /* rows only move down (kept[i] >= i): in order, none read after it is written */
        for (int values = 0; values < 2; values++) {
            char *block = q3_cache_seq_block(c, (int)seq, values);
            q3_copy_heads(&cp, block + (size_t)(start + i) * rb, stride, block + (size_t)(start + kept[i]) * rb, stride,
                          c->kv_heads, rb);
        }
    if ((s = q3_copier_end(&cp)) != Q3_OK) return s;
    uint8_t *h = q3_cache_seq_flags(c, (int)seq);
    for (int64_t i = 0; i < n; i++) h[start + i] = h[start + kept[i]];
    c->lengths[seq] = start + n;
    if (c->padding[seq] > start + n) c->padding[seq] = start + n;
    q3_cache_hidden_trim(c, (int)seq);
    c->verify_start[seq] = -1;
    return Q3_OK;
}
