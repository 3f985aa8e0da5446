"""transformers' Qwen3MoeDecoderLayer as the reference: tiny random models, a causal
forward with a KV cache, and inputs drawn with a routing margin (so that rounding cannot
flip a top-k choice between implementations); a tiny causal LM for generation and
left-padded prompts (the drop-in tests, tests/torch/, and tests/gpu/)."""
from __future__ import annotations

import copy

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.cache_utils import DynamicCache

from qwen3layer.testing.runs import LayerRun, routing_margin, run_hf_layer

# config name -> geometry; all have head_dim != hidden / heads. (transformers 5.x runs bf16
# experts through grouped_mm, which needs rows of a multiple of 16 bytes: I % 8 == 0.)
GEOMETRIES = {
    "gqa4_topk_norm": dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=24,
                           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "mha_no_norm": dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                        num_experts=6, num_experts_per_tok=3, moe_intermediate_size=40, norm_topk_prob=False),
    "gqa8_odd": dict(hidden_size=72, num_attention_heads=8, num_key_value_heads=1, head_dim=10,
                     num_experts=16, num_experts_per_tok=4, moe_intermediate_size=40, norm_topk_prob=True),
}


def hf_config(geometry: str, rope_theta: float = 1e6) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(vocab_size=16, intermediate_size=64, num_hidden_layers=1,
                          max_position_embeddings=4096, rope_theta=rope_theta, rms_norm_eps=1e-6,
                          attn_implementation="eager", **GEOMETRIES[geometry])


def hf_model(geometry: str, seed: int = 0) -> Qwen3MoeForCausalLM:
    """A tiny model with every parameter re-randomised (norm weights near 1, matrices
    scaled by 1/sqrt(fan_in) so every stage carries signal)."""
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(hf_config(geometry)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model


def converted(model: Qwen3MoeForCausalLM, dtype: torch.dtype) -> Qwen3MoeForCausalLM:
    m = copy.deepcopy(model).to(dtype)
    if dtype == torch.float64 and hasattr(m, "set_experts_implementation"):
        m.set_experts_implementation("eager")  # 5.x: grouped_mm has no fp64 kernel; the per-expert loop does
    return m


Reference = LayerRun  # y [B, S, H], keys and values [B, Hkv, S, D], router_logits [B * S, E], attention


def run(model: Qwen3MoeForCausalLM, x: torch.Tensor, cache: DynamicCache | None = None,
        start: int = 0, layer_idx: int = 0) -> Reference:
    """Layer `layer_idx` over x [B, S, H] at positions [start, start + S), causal, with a cache
    (qwen3layer.testing's run of the reference, with the model's own rotary embedding)."""
    return run_hf_layer(model.model.layers[layer_idx], model.model.rotary_emb, x, model.config, cache, start)


def draw_input(model: Qwen3MoeForCausalLM, shape, seed: int, dtype=torch.float32,
               margin: float = 1e-4, tries: int = 50, scale: float = 1.0) -> torch.Tensor:
    """Random x [B, S, H] of N(0, scale^2) entries whose every token routes with at least
    `margin` between the last chosen and the first rejected expert (checked in fp64)."""
    ref = converted(model, torch.float64)
    k = model.config.num_experts_per_tok
    for t in range(tries):
        g = torch.Generator().manual_seed(seed * 1000 + t)
        x = (torch.randn(*shape, generator=g) * scale).to(dtype)
        if routing_margin(run(ref, x.double()).router_logits, k) >= margin:
            return x
    raise RuntimeError(f"no input with routing margin {margin} in {tries} draws")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def randomize_for_generation(model: Qwen3MoeForCausalLM) -> Qwen3MoeForCausalLM:
    """Weights that make greedy generation vary: norms N(1, 0.04), embeddings and lm_head
    N(0, 9), matrices N(0, 1/in)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "embed" in name or "lm_head" in name:
                p.normal_(0.0, 3.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model


def tiny_model(seed=0, dtype=torch.float32, **config):
    """2 layers, vocab 101; embeddings and lm_head scaled up so greedy output varies; `config`
    overrides the Qwen3MoeConfig's fields (max_position_embeddings 512, eager attention)."""
    torch.manual_seed(seed)
    fields = dict(vocab_size=101, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=24, num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                  max_position_embeddings=512, rope_theta=1e4, pad_token_id=0, attn_implementation="eager")
    cfg = Qwen3MoeConfig(**{**fields, **config})
    model = Qwen3MoeForCausalLM(cfg).eval()
    randomize_for_generation(model)
    return model.to(dtype)


def greedy(model, ids, n=32):
    return model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)


def left_padded(lengths, total, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), total, dtype=torch.long)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, total - n:] = torch.randint(1, 101, (n,), generator=g)
        mask[b, total - n:] = 1
    return ids, mask


def sharp_attention_model() -> Qwen3MoeForCausalLM:
    """hf_model("gqa4_topk_norm", seed=3) with its attention weights N(0, 0.15): scores far from
    uniform, so that a key seen or hidden wrongly shows far outside the tolerance (the mask
    tests: tests/layer/test_key_masks.py, test_tree_verify.py)"""
    m = hf_model("gqa4_topk_norm", seed=3)
    with torch.no_grad():
        for p in m.model.layers[0].self_attn.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15, generator=torch.Generator().manual_seed(4))
    return m
