"""Hand counts of the work of one layer: the bytes a decode token must read and the FLOPs
of a prefill. Used to turn measured times into GB/s and GFLOP/s."""
from __future__ import annotations

from .config import LayerConfig


def _size(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else 4


def decode_weight_bytes(cfg: LayerConfig, dtype: str = "bfloat16") -> int:
    """Weight bytes one decode token reads: attention (q, k, v, o and the QK-norm weights),
    the two layer norms, the router, and its top-k experts."""
    H, D = cfg.hidden_size, cfg.head_dim
    attn = H * D * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) + 2 * D
    norms = 2 * H
    router = cfg.num_experts * H
    experts = cfg.num_experts_per_tok * 3 * H * cfg.moe_intermediate_size
    return _size(dtype) * (attn + norms + router + experts)


def kv_bytes_per_token(cfg: LayerConfig, dtype: str = "bfloat16") -> int:
    """KV-cache bytes of one cached token (K and V of every KV head)."""
    return 2 * cfg.num_key_value_heads * cfg.head_dim * _size(dtype)


def decode_bytes(cfg: LayerConfig, context: int, dtype: str = "bfloat16") -> int:
    """Bytes one decode token must read at a context of `context` cached tokens."""
    return decode_weight_bytes(cfg, dtype) + context * kv_bytes_per_token(cfg, dtype)


def prefill_flops(cfg: LayerConfig, tokens: int, context: int = 0) -> float:
    """Multiply-add FLOPs (2 per multiply-add) of `tokens` new tokens after `context` cached
    ones: projections, router, top-k experts, and causal attention (scores and values)."""
    H, D = cfg.hidden_size, cfg.head_dim
    proj = 2 * tokens * H * D * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    router = 2 * tokens * H * cfg.num_experts
    experts = 2 * tokens * cfg.num_experts_per_tok * 3 * H * cfg.moe_intermediate_size
    keys_seen = tokens * context + tokens * (tokens + 1) / 2
    attn = 2 * 2 * cfg.num_attention_heads * D * keys_seen
    return proj + router + experts + attn
