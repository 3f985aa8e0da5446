/* The MoE half of the layer for one pass of R rows:
 *   h = rmsnorm(x); router softmax/top-k; pairs grouped by expert; for each expert with
 *   tokens: gather its rows, (silu(h G^T) * h U^T) D^T, scatter-add w * y into x.
 * Each selected expert's weights are read once per pass, whatever its token count. */
#include "layer_internal.h"

void q3_moe_block(q3_layer *layer, const q3_pass *p) {
    const q3_config *c = &layer->cfg;
    const q3_weights *w = &layer->w;
    q3_workspace *ws = &layer->ws;
    const int64_t H = c->hidden, I = c->moe_inter;
    const int E = c->experts, top_k = c->top_k;
    const int64_t R = p->n_seqs * p->L;
    const q3_cpu_ops *k = p->k;

    k->rmsnorm(ws->h, ws->x, w->dense[Q3_W_POST_NORM], w->dtype, R, H, c->eps);
    /* the router stays in fp32 (no bf16 scratch): its top-k choice is sensitive to rounding */
    k->matmul(ws->logits, ws->h, w->dense[Q3_W_ROUTER], w->dtype, R, E, H, 0, NULL);
    k->router_topk(ws->topk_idx, ws->topk_w, ws->logits, R, E, top_k, c->norm_topk);
    k->moe_group(ws->offsets, ws->pair_row, ws->pair_w, ws->topk_idx, ws->topk_w, R, top_k, E);

    for (int e = 0; e < E; e++) {
        const int64_t first = ws->offsets[e], n = ws->offsets[e + 1] - first;
        if (n == 0) continue;
        const int32_t *rows = ws->pair_row + first;
        k->gather_rows(ws->xe, ws->h, rows, n, H);
        k->matmul(ws->gate, ws->xe, w->experts[Q3_X_GATE][e], w->dtype, n, I, H, 0, ws->xb);
        k->matmul(ws->up, ws->xe, w->experts[Q3_X_UP][e], w->dtype, n, I, H, 0, ws->xb);
        k->swiglu(ws->gate, ws->gate, ws->up, n * I);
        k->matmul(ws->ye, ws->gate, w->experts[Q3_X_DOWN][e], w->dtype, n, H, I, 0, ws->xb);
        k->scatter_add_rows(ws->x, ws->ye, rows, ws->pair_w + first, n, H);
    }
}
