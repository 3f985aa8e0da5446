/* The MoE half of the layer for one pass of R rows:
 *   h = rmsnorm(x); router softmax/top-k; pairs grouped by expert; for each expert with
 *   tokens: gather its rows, (silu(h G^T) * h U^T) D^T, scatter-add w * y into x.
 * Each selected expert's weights are read once per pass, whatever its token count. */
#include "../kernels/matmul.h"
#include "../kernels/moe_group.h"
#include "../kernels/rmsnorm.h"
#include "../kernels/router.h"
#include "../kernels/rows.h"
#include "../kernels/swiglu.h"
#include "layer_internal.h"

void q3_moe_block(q3_layer *layer, int64_t R) {
    const q3_config *c = &layer->cfg;
    const q3_weights *w = &layer->w;
    q3_workspace *ws = &layer->ws;
    const int64_t H = c->hidden, I = c->moe_inter;
    const int E = c->experts, k = c->top_k;

    q3_rmsnorm_cpu(ws->h, ws->x, w->dense[Q3_W_POST_NORM], w->dtype, R, H, c->eps);
    q3_matmul_cpu(ws->logits, ws->h, w->dense[Q3_W_ROUTER], w->dtype, R, E, H, 0);
    q3_router_topk_cpu(ws->topk_idx, ws->topk_w, ws->logits, R, E, k, c->norm_topk);
    q3_moe_group_cpu(ws->offsets, ws->pair_row, ws->pair_w, ws->topk_idx, ws->topk_w, R, k, E);

    for (int e = 0; e < E; e++) {
        const int64_t first = ws->offsets[e], n = ws->offsets[e + 1] - first;
        if (n == 0) continue;
        const int32_t *rows = ws->pair_row + first;
        q3_gather_rows_cpu(ws->xe, ws->h, rows, n, H);
        q3_matmul_cpu(ws->gate, ws->xe, w->experts[Q3_X_GATE][e], w->dtype, n, I, H, 0);
        q3_matmul_cpu(ws->up, ws->xe, w->experts[Q3_X_UP][e], w->dtype, n, I, H, 0);
        q3_swiglu_cpu(ws->gate, ws->gate, ws->up, n * I);
        q3_matmul_cpu(ws->ye, ws->gate, w->experts[Q3_X_DOWN][e], w->dtype, n, H, I, 0);
        q3_scatter_add_rows_cpu(ws->x, ws->ye, rows, ws->pair_w + first, n, H);
    }
}
