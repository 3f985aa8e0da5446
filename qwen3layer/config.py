"""LayerConfig: the geometry and RoPE of one Qwen3-MoE decoder layer.

LayerConfig.from_hf reads a transformers Qwen3MoeConfig (4.57 or 5.x) or its config.json;
qwen3layer/hf_config.py holds the reading rules (which fields change the layer, which the
C layer refuses, the RoPE parameters' spellings), docs/config_fields.md the table of them.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from . import _C

# the RoPE fields and their values when unused: the engine's (Q3_ROPE_SCALING_DEFAULT)
ROPE_DEFAULTS = _C.rope_defaults()
# the tokens of each sequence a prefill pass takes when no chunk_size is given: the engine's
DEFAULT_CHUNK = int(_C.build_info()["default_chunk"])


def expert_ids(ids: Any, num_experts: int, arg: str) -> list:
    """ids (a sequence of expert ids: gpu_experts, one rank's placement) as a list, refused
    naming `arg` unless each is an int in [0, num_experts) listed once: the one check of an
    id list the package makes (the extension checks its own experts= again, in C)"""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{arg}: expected a sequence of expert ids, got {type(ids).__name__}")
    out: list = []
    for e in ids:
        if type(e) is not int or not 0 <= e < num_experts:
            raise ValueError(f"{arg}: expected expert ids in [0, {num_experts}), got {e!r}")
        if e in out:
            raise ValueError(f"{arg}: expert {e} is listed twice")
        out.append(e)
    return out


def pass_tokens(chunk_size: Optional[int]) -> int:
    """the tokens a pass takes of each sequence: chunk_size, or DEFAULT_CHUNK when None"""
    return chunk_size or DEFAULT_CHUNK


@dataclasses.dataclass(frozen=True, repr=False)
class LayerConfig:
    """Geometry and RoPE of one Qwen3-MoE decoder layer (the fields of transformers'
    Qwen3MoeConfig that change the layer's math).

    The engine checks it on construction: sizes positive, head_dim even, heads a multiple of
    KV heads, top-k at most the number of experts, the RoPE parameters in their domain.

    RoPE (transformers' rope_parameters / rope_scaling, static variants only):
    rope_type 'default' (inv_freq = rope_theta^(-2i/head_dim)), 'linear' (inv_freq /
    rope_factor) or 'yarn' (rope_factor, rope_original_max_position_embeddings (None:
    max_position_embeddings), rope_beta_fast, rope_beta_slow, rope_truncate, and cos/sin scaled
    by rope_attention_factor, or when None by 0.1 ln(factor) + 1, or the ratio of that with
    rope_mscale and rope_mscale_all_dim when both are set). A field the variant does not read
    must keep its default. The engine computes the table once per layer
    (DecoderLayer.rope_inv_freq, rope_attention_scaling).
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
    rope_type: str = ROPE_DEFAULTS["rope_type"]
    rope_factor: float = ROPE_DEFAULTS["rope_factor"]
    rope_original_max_position_embeddings: Optional[int] = ROPE_DEFAULTS["rope_original_max_position_embeddings"]
    rope_attention_factor: Optional[float] = ROPE_DEFAULTS["rope_attention_factor"]
    rope_beta_fast: float = ROPE_DEFAULTS["rope_beta_fast"]
    rope_beta_slow: float = ROPE_DEFAULTS["rope_beta_slow"]
    rope_mscale: Optional[float] = ROPE_DEFAULTS["rope_mscale"]
    rope_mscale_all_dim: Optional[float] = ROPE_DEFAULTS["rope_mscale_all_dim"]
    rope_truncate: bool = ROPE_DEFAULTS["rope_truncate"]

    def __post_init__(self) -> None:
        _C.check_config(self)

    def __repr__(self) -> str:
        """Every field but the RoPE ones left at their defaults (all of them for the default RoPE)."""
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                 if f.name not in ROPE_DEFAULTS or getattr(self, f.name) != ROPE_DEFAULTS[f.name]]
        return f"LayerConfig({', '.join(shown)})"

    @property
    def context_length(self) -> int:
        """The positions the model is configured for: max_position_embeddings, or with YaRN
        the scaled context rope_factor x rope_original_max_position_embeddings (None:
        max_position_embeddings) where that is larger. The drop-in's caches grow up to it."""
        if self.rope_type != "yarn":
            return self.max_position_embeddings
        original = self.rope_original_max_position_embeddings or self.max_position_embeddings
        return max(self.max_position_embeddings, int(self.rope_factor * original))

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
    def from_hf(cls, hf_config: Any, layer_idx: Optional[int] = None) -> "LayerConfig":
        """From a transformers Qwen3MoeConfig (4.57 or 5.x) or a dict of its fields (a
        config.json: num_experts may be spelled num_local_experts).

        Every field that changes the layer's math is honoured or refused with a ValueError
        naming it and its value (docs/config_fields.md): hidden_act other than silu,
        attention_bias, a sliding window, a RoPE other than default / linear / yarn, a partial
        rotary factor. layer_idx: the index of the layer in the model; given, a layer that
        mlp_only_layers or decoder_sparse_step make a dense MLP layer is refused too."""
        from .hf_config import layer_fields

        return cls(**layer_fields(hf_config, layer_idx))
