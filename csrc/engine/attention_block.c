/* The attention half of the layer for one pass:
 *   h = rmsnorm(x); q, k, v = h Wq^T, h Wk^T, h Wv^T; QK-norm per head; RoPE (the layer's table);
 *   append k, v to the cache; causal GQA attention over the cache; x += attn Wo^T. */
#include <math.h>

#include "layer_internal.h"

void q3_attention_block(q3_layer *layer, q3_cache *cache, const q3_pass *p) {
    const q3_config *c = &layer->cfg;
    const q3_weights *w = &layer->w;
    q3_workspace *ws = &layer->ws;
    const int64_t R = p->n_seqs * p->L, H = c->hidden;
    const int D = c->head_dim, Hq = c->heads, Hkv = c->kv_heads;
    const int64_t QD = (int64_t)Hq * D, KVD = (int64_t)Hkv * D;
    const q3_cpu_ops *k = p->k;

    k->rmsnorm(ws->h, ws->x, w->dense[Q3_W_INPUT_NORM], w->dtype, R, H, c->eps);
    q3_profile_mark(p->prof, Q3_STAGE_INPUT_NORM);
    q3_project(layer, k, ws->q, ws->h, q3_dense_matrix(layer, Q3_W_Q_PROJ), R, QD, H, 0, ws->xb, ws->threads);
    q3_project(layer, k, ws->k, ws->h, q3_dense_matrix(layer, Q3_W_K_PROJ), R, KVD, H, 0, ws->xb, ws->threads);
    q3_project(layer, k, ws->v, ws->h, q3_dense_matrix(layer, Q3_W_V_PROJ), R, KVD, H, 0, ws->xb, ws->threads);
    q3_profile_mark(p->prof, Q3_STAGE_QKV_PROJ);
    k->rmsnorm(ws->q, ws->q, w->dense[Q3_W_Q_NORM], w->dtype, R * Hq, D, c->eps);
    k->rmsnorm(ws->k, ws->k, w->dense[Q3_W_K_NORM], w->dtype, R * Hkv, D, c->eps);

    for (int s = 0; s < p->n_seqs; s++) q3_pass_positions(cache, p, s, ws->pos + s * p->L);
    k->rope(ws->q, ws->pos, R, Hq, D, layer->rope_inv_freq, layer->rope_scale);
    k->rope(ws->k, ws->pos, R, Hkv, D, layer->rope_inv_freq, layer->rope_scale);
    q3_profile_mark(p->prof, Q3_STAGE_QK_NORM_ROPE);

    for (int s = 0; s < p->n_seqs; s++) {
        const int seq = p->seqs[s];
        const int64_t n = cache->lengths[seq];
        k->kv_write(q3_cache_seq_keys(cache, seq), cache->dtype, ws->k + s * p->L * KVD, KVD,
                        p->L, Hkv, D, cache->capacity, n);
        k->kv_write(q3_cache_seq_values(cache, seq), cache->dtype, ws->v + s * p->L * KVD, KVD,
                        p->L, Hkv, D, cache->capacity, n);
        ws->attn_seqs[s] = q3_pass_attn_seq(cache, p, s);
    }
    q3_profile_mark(p->prof, Q3_STAGE_KV_WRITE);
    const q3_attn_shape shape = {p->L, Hq, Hkv, D, cache->capacity, cache->dtype,
                                 1.0f / sqrtf((float)D), 0};
    if (p->call && p->call->attention) /* before attention: its output overwrites q */
        k->attention_probs(p->call->attention, ws->q, ws->attn_seqs, p->n_seqs, &shape, p->t0, p->call->tokens,
                           p->call->attention_context, ws->threads);
    k->attention(ws->attn, ws->q, ws->attn_seqs, p->n_seqs, &shape, ws->attn_scratch, ws->threads);
    q3_profile_mark(p->prof, Q3_STAGE_ATTENTION);
    q3_project(layer, k, ws->x, ws->attn, q3_dense_matrix(layer, Q3_W_O_PROJ), R, H, QD, 1, ws->xb, ws->threads);
    q3_profile_mark(p->prof, Q3_STAGE_O_PROJ);
}
