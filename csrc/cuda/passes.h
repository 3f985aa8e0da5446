/* The passes of a layer on a CUDA device: the stages of one pass (passes.c), the driver that
 * runs a call's passes chunk by chunk (layer.c), the halves (layer_halves.c), and the entries
 * the engine's device backend table points at (backend.c). The device state they work in is
 * device_state.h's. */
#ifndef Q3_CUDA_PASSES_H
#define Q3_CUDA_PASSES_H

#include "device_state.h"

/* q3_device_backend's layer entries (csrc/engine/device_backend.h): the forward of a layer
 * whose weights live on a CUDA device, after the engine checked the call; whether the kernels
 * take the layer's geometry; the halves, after the engine's checks */
q3_status q3_layer_forward_cuda(q3_layer *layer, q3_cache *cache, const q3_forward_args *a, q3_error *err);
q3_status q3_layer_cuda_config_check(const q3_config *cfg, q3_error *err);
q3_status q3_layer_attention_half_cuda(q3_layer *layer, q3_cache *cache, const q3_forward_args *a,
                                       const q3_attention_half_out *out, q3_pass_cursor *cur, q3_error *err);
q3_status q3_layer_expert_half_cuda(q3_layer *layer, const q3_expert_half_args *a, q3_error *err);

/* The passes of a checked call chunk by chunk (layer.c): the whole layer (half NULL), or its
 * attention half, each pass stopped after the router and its rows written to half's outputs
 * (q3_gpu_attention_half_write); cur: the cursor's next pass alone. The device state grown for passes of the call's rows first. */
q3_status q3_layer_cuda_passes(q3_layer *layer, q3_cache *cache, const q3_forward_args *a,
                               const q3_attention_half_out *half, q3_pass_cursor *cur, q3_error *err);

/* A decode pass's starting state: sequences seqs [n]'s lengths and cache rows (sequences
 * without hidden tokens: the rows' flags would be host memory), staged in the
 * host arrays lengths [n] and rows [n] (which must outlive nothing: copies from pageable
 * memory are staged before they return) and queued for upload into ws; a CUDA code. */
int q3_gpu_upload_decode_state(const q3_cuda_ops *g, q3_gpu_ws *ws, const q3_cache *c, const int32_t *seqs, int n,
                               int64_t *lengths, q3_attn_seq *rows, void *stream);

/* a pass's rows of the attention half's outputs, from dev.x (resid), dev.h (normed) and the
 * router's choices, device to device on the run's stream */
void q3_gpu_attention_half_write(const q3_layer *l, const q3_pass *p, const q3_attention_half_out *half,
                                 q3_gpu_run *run);

/* Whether pass p stages its positions and its sequences' cache rows on the host: every pass
 * but a decode one (q3_gpu_is_decode) whose call gives no positions and no tree and whose
 * sequences hold no hidden tokens (their flags marked for the pass already, q3_cache_mark_rows) */
int q3_gpu_stages_on_host(const q3_cache *c, const q3_pass *p);

/* One pass over the rows in ws->dev.x. A decode pass not staged on the host
 * (q3_gpu_stages_on_host) reads its positions from ws->lengths (which it advances) and
 * ws->dev.attn_seqs' cache pointers and padding, both uploaded beforehand; max_keys bounds
 * the keys any query sees (a graph passes the capacity). Other passes stage positions (the
 * call's, or from the cache's host lengths), the hidden flags and the call's trees; passes past a decode
 * pass's size also group experts on the host (one stream synchronisation). */
void q3_gpu_attention_pass(q3_layer *l, q3_cache *c, const q3_pass *p, int64_t max_keys, q3_gpu_run *run);
/* the MoE stage: the router's (post norm: x += h, h = norm(x); logits, top-k into dev.topk_idx
 * and dev.topk_w, the call's router insides), then the experts' (x += the weighted experts of
 * h); a forward pass is q3_gpu_attention_pass, q3_gpu_route_pass, q3_gpu_experts_pass, and
 * q3_gpu_moe_pass the last two */
void q3_gpu_route_pass(q3_layer *l, const q3_pass *p, q3_gpu_run *run);
void q3_gpu_experts_pass(q3_layer *l, const q3_pass *p, q3_gpu_run *run);
void q3_gpu_moe_pass(q3_layer *l, const q3_pass *p, q3_gpu_run *run);
/* The expert half's experts on the p->L rows of dev.h into dev.x: on_device, grouped on the
 * device from dev.topk_idx and dev.topk_w (a decode pass's way; every entry an expert held);
 * else grouped on the host from st->topk_idx and st->topk_w already staged there, an entry
 * E marking an expert held elsewhere, skipped, on the prefill path forced or chosen */
void q3_gpu_experts_rows(q3_layer *l, const q3_pass *p, q3_gpu_run *run, int on_device);

#endif
