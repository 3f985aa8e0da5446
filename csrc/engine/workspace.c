/* Workspace carving: every array is a 64-byte aligned slice of one block. */
#include "../../kernels/fp8.h"
#include "../../kernels/int4.h"
#include "../../kernels/matmul.h"
#include "workspace.h"

/* Lays the arrays out from base (NULL: only measures); returns the bytes used. */
size_t q3_workspace_layout(q3_workspace *w, char *base, const q3_config *c, int fp8, int64_t R, int S,
                           int threads) {
    const int64_t H = c->hidden, QD = (int64_t)c->heads * c->head_dim,
                  KVD = (int64_t)c->kv_heads * c->head_dim, I = c->moe_inter;
    size_t off = 0;
#define CARVE(field, type, count)                                  \
    do {                                                           \
        w->field = (type *)(base ? base + off : NULL);             \
        off += ((size_t)(count) * sizeof(type) + 63) / 64 * 64;    \
    } while (0)
    CARVE(x, float, R * H);
    CARVE(h, float, R * H);
    CARVE(logits, float, R * c->experts);
    CARVE(topk_idx, int32_t, R * c->top_k);
    CARVE(topk_w, float, R * c->top_k);
    CARVE(offsets, int64_t, c->experts + 2); /* + the group of skipped entries (the expert half) */
    CARVE(pair_row, int32_t, R * c->top_k);
    CARVE(pair_w, float, R * c->top_k);
    /* the attention stage's buffers and the MoE stage's share memory: neither stage reads
     * the other's (x and h carry everything across) */
    const size_t stages = off;
    CARVE(q, float, R * QD);
    w->attn = w->q; /* attention reads each query row before it writes that row's output */
    CARVE(k, float, R * KVD);
    CARVE(v, float, R * KVD);
    const size_t attention_end = off;
    off = stages;
    CARVE(xe, float, R * H);
    CARVE(gate, float, R * I);
    CARVE(up, float, R * I);
    CARVE(ye, float, R * H);
    off = off > attention_end ? off : attention_end;
    CARVE(pos, int64_t, R);
    int64_t max_k = H > QD ? H : QD;
    max_k = max_k > I ? max_k : I;
    CARVE(xb, uint16_t, q3_matmul_scratch_elems(R, max_k));
    const q3_attn_shape shape = {.heads = c->heads, .kv_heads = c->kv_heads, .head_dim = c->head_dim};
    CARVE(attn_scratch, float, threads * q3_attention_scratch_floats(&shape));
    CARVE(expert_thread, float, threads * q3_expert_thread_floats(c));
    CARVE(expert_xb, uint16_t, threads * q3_expert_thread_xb(c));
    CARVE(pair_out, float, (int64_t)Q3_MOE_THREAD_ROWS * c->top_k * H);
    CARVE(attn_seqs, q3_attn_seq, S);
    /* the quantized formats' matmul scratch (FP8, GPTQ int4: the larger of the two) */
    const int64_t q8 = q3_matmul_fp8_scratch_floats(R, max_k), q4 = q3_matmul_int4_scratch_floats(R, max_k);
    CARVE(fp8_scratch, float, fp8 ? threads * (q8 > q4 ? q8 : q4) : 0);
    if (!fp8) w->fp8_scratch = NULL;
#undef CARVE
    return off;
}

q3_status q3_workspace_reserve(q3_workspace *ws, const q3_config *cfg, int fp8, int64_t rows, int seqs,
                               q3_error *err) {
    if (rows <= ws->rows && seqs <= ws->seqs && q3_max_threads() <= ws->threads) return Q3_OK;
    /* with the config's limits, rows * top_k <= 2^31 - 1 keeps every product of the layout
     * below 2^60 bytes (q3_layer_check_call holds calls to it) */
    if (rows <= 0 || seqs <= 0 || rows > INT32_MAX / cfg->top_k)
        return q3_fail(err, Q3_ERR_VALUE, "workspace: expected 1 to %d rows and at least 1 sequence, got %lld "
                       "rows and %d", INT32_MAX / cfg->top_k, (long long)rows, seqs);
    if (rows < ws->rows) rows = ws->rows;
    if (seqs < ws->seqs) seqs = ws->seqs;
    q3_workspace grown = *ws;
    const int threads = q3_max_threads();
    const size_t bytes = q3_workspace_layout(&grown, NULL, cfg, fp8, rows, seqs, threads);
    char *block = q3_alloc(bytes);
    if (!block)
        return q3_fail(err, Q3_ERR_NOMEM, "workspace: cannot allocate %zu bytes for %lld rows",
                       bytes, (long long)rows);
    q3_workspace_layout(&grown, block, cfg, fp8, rows, seqs, threads);
    grown.threads = threads;
    grown.block = block;
    grown.bytes = bytes;
    grown.rows = rows;
    grown.seqs = seqs;
    q3_free(ws->block);
    *ws = grown;
    return Q3_OK;
}

void q3_workspace_release(q3_workspace *ws) {
    q3_free(ws->block);
    *ws = (q3_workspace){0};
}
