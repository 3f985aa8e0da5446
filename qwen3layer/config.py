"""LayerConfig: the geometry of one Qwen3-MoE decoder layer."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from . import _C


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """Geometry of one Qwen3-MoE decoder layer (the fields of transformers' Qwen3MoeConfig).

    The engine checks it on construction: sizes positive, head_dim even, heads a multiple of
    KV heads, top-k at most the number of experts.
    """

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 40960

    def __post_init__(self) -> None:
        _C.check_config(self)

    @classmethod
    def qwen3_235b_a22b(cls) -> "LayerConfig":
        """The real geometry of Qwen/Qwen3-235B-A22B (config.json)."""
        return cls(hidden_size=4096, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                   num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536,
                   norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6,
                   max_position_embeddings=40960)

    @classmethod
    def tiny(cls) -> "LayerConfig":
        """A small geometry with the real structure (head_dim != hidden / heads, GQA 4:1)."""
        return cls(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                   num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)

    @classmethod
    def from_hf(cls, hf_config: Any) -> "LayerConfig":
        """From a transformers Qwen3MoeConfig (4.57 or 5.x) or a dict of its fields (a
        config.json: num_experts may be spelled num_local_experts)."""
        raw = hf_config.get if isinstance(hf_config, Mapping) else (lambda k, d=None: getattr(hf_config, k, d))
        # transformers 5.x writes num_experts as num_local_experts in config.json
        aliases = {"num_experts": "num_local_experts"}
        get = lambda k, d=None: raw(k) if raw(k) is not None else raw(aliases.get(k, k), d)  # noqa: E731
        hidden, heads = get("hidden_size"), get("num_attention_heads")
        missing = [k for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_experts",
                               "num_experts_per_tok", "moe_intermediate_size") if get(k) is None]
        if missing:
            raise ValueError(f"config: missing {', '.join(missing)}")
        theta = get("rope_theta")
        rope = get("rope_parameters") or get("rope_scaling") or {}
        if not isinstance(rope, Mapping):
            raise ValueError(f"config.rope_parameters: expected a mapping, got {type(rope).__name__}")
        if theta is None:
            theta = rope.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"config.rope_parameters: expected the default RoPE, got rope_type={rope_type!r}")
        return cls(hidden_size=hidden, num_attention_heads=heads,
                   num_key_value_heads=get("num_key_value_heads"),
                   head_dim=get("head_dim") or hidden // heads,
                   num_experts=get("num_experts"), num_experts_per_tok=get("num_experts_per_tok"),
                   moe_intermediate_size=get("moe_intermediate_size"),
                   norm_topk_prob=bool(get("norm_topk_prob", False)),
                   rms_norm_eps=float(get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
                   max_position_embeddings=get("max_position_embeddings", 40960))
