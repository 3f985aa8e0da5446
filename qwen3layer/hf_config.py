"""The reading of a transformers Qwen3MoeConfig (4.57 or 5.x, an object or its config.json as
a dict) into LayerConfig's fields: each field that changes the layer's math is taken or
refused here by name (docs/config_fields.md lists every field and what happens to it).

The RoPE parameters come in two spellings: 5.x's `rope_parameters` (rope_type, rope_theta,
factor, ... in one dict) and 4.57's `rope_scaling` (`type` or `rope_type`, factor, ...) beside
`rope_theta`. A config object is read as its own version reads it: 5.x objects from
rope_parameters, 4.x ones from rope_scaling and rope_theta. A config.json is read as 5.x
loads one (rope_scaling, when given, in place of rope_parameters; a top-level
original_max_position_embeddings first). Where 4.57 fails and 5.x computes (a yarn factor of
None: 5.x takes max_position_embeddings / original_max_position_embeddings), 5.x is followed.
The numbers go to the engine as given, with transformers' defaults filled in; the engine
computes the table from them (csrc/engine/rope_table.c).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

# the C layer computes these; every other rope_type is refused by name
ROPE_TYPES = ("default", "linear", "yarn")
# transformers' ACT2FN names of the activation the experts use (both are torch's F.silu)
SILU_NAMES = ("silu", "swish")
WHY_NOT = {
    "dynamic": "dynamic NTK recomputes inv_freq from each call's sequence length, so keys cached at one length "
               "would be rotated by another's frequencies",
    "longrope": "LongRoPE switches between two frequency tables at the original length",
    "llama3": "Llama 3's frequency smoothing is not implemented",
}


def _getter(hf_config: Any) -> Callable[..., Any]:
    """get(name, default): a dict's key or an object's attribute; None counts as missing;
    num_experts may be spelled num_local_experts (transformers 5.x's config.json)."""
    if isinstance(hf_config, Mapping):
        raw = lambda k: hf_config.get(k)  # noqa: E731
    else:
        raw = lambda k: getattr(hf_config, k, None)  # noqa: E731
    aliases = {"num_experts": "num_local_experts"}

    def get(name: str, default: Any = None) -> Any:
        value = raw(name)
        if value is None and name in aliases:
            value = raw(aliases[name])
        return default if value is None else value
    return get


def _is_legacy_object(hf_config: Any) -> bool:
    """A transformers 4.x config object: its class declares no rope_parameters (5.x's field)."""
    return not isinstance(hf_config, Mapping) and not hasattr(type(hf_config), "rope_parameters")


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: expected a number, got {value!r}")
    return float(value)


def _refuse_layer_math(get: Callable[..., Any], hf_config: Any) -> None:
    """The fields whose effect the C layer does not implement, refused when they take effect."""
    act = get("hidden_act", "silu")
    if act not in SILU_NAMES:
        raise ValueError(f"config.hidden_act: expected 'silu' (the experts' SiLU gate), got {act!r}")
    if get("attention_bias", False):
        raise ValueError(f"config.attention_bias: expected False (the C layer's projections have no bias), "
                         f"got {get('attention_bias')!r}")
    # Qwen3MoeConfig keeps sliding_window (default 4096) only with use_sliding_window (both
    # versions); a dict holds them as written. The window then applies to every layer.
    if isinstance(hf_config, Mapping):
        window = hf_config.get("sliding_window", 4096) if get("use_sliding_window", False) else None
    else:
        window = get("sliding_window")
    if window is not None:
        raise ValueError(f"config.sliding_window: a sliding window of {window!r} tokens (use_sliding_window="
                         f"{get('use_sliding_window')!r}) is not implemented (the C attention sees the whole cache); "
                         "expected use_sliding_window False")
    partial = get("partial_rotary_factor", 1.0)
    if partial != 1:
        raise ValueError(f"config.partial_rotary_factor: expected 1 (RoPE over all of head_dim, as qwen3_moe "
                         f"applies it), got {partial!r}")


def _refuse_dense_layer(get: Callable[..., Any], layer_idx: Any) -> None:
    """transformers' rule: layer i has the sparse MoE block unless i is in mlp_only_layers, or
    num_experts is 0, or (i + 1) % decoder_sparse_step != 0; else a dense Qwen3MoeMLP."""
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
        raise ValueError(f"layer_idx: expected an int >= 0 or None, got {layer_idx!r}")
    dense = get("mlp_only_layers", [])
    if not isinstance(dense, (list, tuple)):
        raise ValueError(f"config.mlp_only_layers: expected a list of layer indices, got {dense!r}")
    if layer_idx in dense:
        raise ValueError(f"config.mlp_only_layers: layer {layer_idx} is in it ({list(dense)!r}), so it is a dense "
                         "Qwen3MoeMLP layer, not the sparse MoE block the C layer implements")
    step = get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"config.decoder_sparse_step: expected a positive int, got {step!r}")
    if (layer_idx + 1) % step:
        raise ValueError(f"config.decoder_sparse_step: {step} makes layer {layer_idx} a dense Qwen3MoeMLP layer "
                         f"((layer_idx + 1) % decoder_sparse_step = {(layer_idx + 1) % step}, not 0), not the sparse "
                         "MoE block the C layer implements")


def _rope_source(get: Callable[..., Any], legacy: bool) -> tuple:
    """(the RoPE dict, its name in messages, rope_theta) as the config's transformers reads them."""
    if legacy:
        where, rope, theta = "rope_scaling", get("rope_scaling") or {}, get("rope_theta")
    else:  # 5.x: a rope_scaling given at load replaces rope_parameters; rope_theta inside it first
        scaling, params = get("rope_scaling"), get("rope_parameters")
        if scaling and scaling is not params:  # (a 5.x object's rope_scaling is its rope_parameters)
            where, rope = "rope_scaling", scaling
        else:
            where, rope = "rope_parameters", params or {}
        theta = rope.get("rope_theta") if isinstance(rope, Mapping) else None
        theta = get("rope_theta") if theta is None else theta
    if not isinstance(rope, Mapping):
        raise ValueError(f"config.{where}: expected a mapping, got {type(rope).__name__}")
    return rope, where, 10000.0 if theta is None else theta  # Qwen3MoeConfig's default theta


def _rope_type(rope: Mapping, where: str) -> str:
    """rope_type, or 4.57's `type` (both spellings: refused when they disagree)."""
    kind, old = rope.get("rope_type"), rope.get("type")
    if kind is not None and old is not None and kind != old:
        raise ValueError(f"config.{where}: rope_type {kind!r} and type {old!r} disagree")
    kind = kind if kind is not None else old if old is not None else "default"
    if kind not in ROPE_TYPES:
        why = WHY_NOT.get(kind, "the C layer computes the static default, linear and yarn RoPE only") \
            if isinstance(kind, str) else "not a name"
        raise ValueError(f"config.{where}['rope_type']: expected one of {', '.join(map(repr, ROPE_TYPES))}, got "
                         f"{kind!r} ({why})")
    return kind


def _rope_fields(get: Callable[..., Any], legacy: bool, max_pos: Any) -> dict:
    """LayerConfig's rope_* fields and rope_theta, transformers' defaults filled in."""
    rope, where, theta = _rope_source(get, legacy)
    kind = _rope_type(rope, where)
    partial = rope.get("partial_rotary_factor", 1.0)
    if partial is not None and partial != 1:
        raise ValueError(f"config.{where}['partial_rotary_factor']: expected 1 (RoPE over all of head_dim), got "
                         f"{partial!r}")
    out = dict(rope_theta=_number(theta, "config.rope_theta"), rope_type=kind)
    if kind == "default":
        return out
    if "factor" not in rope:
        raise ValueError(f"config.{where}: the {kind} RoPE needs 'factor' (transformers requires it too)")
    factor = rope["factor"]
    if kind == "linear":
        return dict(out, rope_factor=_number(factor, f"config.{where}['factor']"))
    # yarn: 5.x moves a top-level original_max_position_embeddings (Phi-3's place) into the dict
    top = None if legacy else get("original_max_position_embeddings")
    original = top if top is not None else rope.get("original_max_position_embeddings") or max_pos
    if isinstance(original, bool) or not isinstance(original, int):
        raise ValueError(f"config.{where}['original_max_position_embeddings']: expected an int, got {original!r}")
    if factor is None:  # 5.x: the ratio of the post- and pre-YaRN lengths (4.57 fails)
        if not isinstance(max_pos, int) or original <= 0:
            raise ValueError(f"config.{where}['factor']: None, and max_position_embeddings / "
                             f"original_max_position_embeddings = {max_pos!r} / {original!r} is no factor")
        factor = max_pos / original
    optional = {}
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        value = rope.get(key)
        if value is not None:
            optional[key] = _number(value, f"config.{where}['{key}']")
    truncate = rope.get("truncate", True)
    if truncate is not None and not isinstance(truncate, bool):
        raise ValueError(f"config.{where}['truncate']: expected a bool, got {truncate!r}")
    return dict(out, rope_factor=_number(factor, f"config.{where}['factor']"),
                rope_original_max_position_embeddings=original,
                rope_attention_factor=optional.get("attention_factor"),
                # transformers: `or 32`, `or 1`; mscale used only when both are truthy
                rope_beta_fast=_number(rope.get("beta_fast") or 32, f"config.{where}['beta_fast']"),
                rope_beta_slow=_number(rope.get("beta_slow") or 1, f"config.{where}['beta_slow']"),
                rope_mscale=optional.get("mscale") or None,
                rope_mscale_all_dim=optional.get("mscale_all_dim") or None,
                rope_truncate=bool(truncate))


def layer_fields(hf_config: Any, layer_idx: Optional[int] = None) -> dict:
    """LayerConfig's keyword arguments from a Qwen3MoeConfig or its dict; ValueError naming
    the field for what the C layer does not implement (see the module docstring)."""
    get = _getter(hf_config)
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_experts",
                           "num_experts_per_tok", "moe_intermediate_size") if get(k) is None]
    if missing:
        raise ValueError(f"config: missing {', '.join(missing)}")
    _refuse_layer_math(get, hf_config)
    if layer_idx is not None:
        _refuse_dense_layer(get, layer_idx)
    max_pos = get("max_position_embeddings", 32768)  # Qwen3MoeConfig's default
    fields = dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=get("num_key_value_heads"),
                  head_dim=get("head_dim") or hidden // heads, num_experts=get("num_experts"),
                  num_experts_per_tok=get("num_experts_per_tok"), moe_intermediate_size=get("moe_intermediate_size"),
                  norm_topk_prob=bool(get("norm_topk_prob", False)),  # Qwen3MoeConfig's default: False
                  rms_norm_eps=float(get("rms_norm_eps", 1e-6)), max_position_embeddings=max_pos)
    fields.update(_rope_fields(get, _is_legacy_object(hf_config), max_pos))
    return fields


def hf_rope_kwargs(cfg: Any) -> dict:
    """The Qwen3MoeConfig keyword arguments (4.57 and 5.x take both) that give transformers
    the RoPE of a LayerConfig: rope_theta, and rope_scaling for a scaled variant."""
    if cfg.rope_type == "default":
        return dict(rope_theta=cfg.rope_theta)
    scaling = dict(rope_type=cfg.rope_type, factor=cfg.rope_factor)
    if cfg.rope_type == "yarn":
        optional = dict(original_max_position_embeddings=cfg.rope_original_max_position_embeddings,
                        attention_factor=cfg.rope_attention_factor, mscale=cfg.rope_mscale,
                        mscale_all_dim=cfg.rope_mscale_all_dim)
        scaling.update({k: v for k, v in optional.items() if v is not None}, beta_fast=cfg.rope_beta_fast,
                       beta_slow=cfg.rope_beta_slow, truncate=cfg.rope_truncate)
    return dict(rope_theta=cfg.rope_theta, rope_scaling=scaling)
