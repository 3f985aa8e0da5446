"""Weight names: from any of the accepted spellings to the engine's canonical names.

Accepted: the per-layer names of a transformers Qwen3-MoE checkpoint, with or without a
"model.layers.N." prefix; experts either per expert (mlp.experts.{e}.gate_proj.weight, ...)
or fused as transformers 5.x holds them (mlp.experts.gate_up_proj [E, 2I, H],
mlp.experts.down_proj [E, H, I]). FP8 layers add a "<matrix>_scale_inv" beside each projection
matrix (SCALED: q/k/v/o_proj and the experts'). Shapes and dtypes are checked by the engine.
"""
from __future__ import annotations

import difflib
import re
from typing import Any, Mapping, Optional, Sequence

from .config import LayerConfig

DENSE = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "post_attention_layernorm.weight",
    "mlp.gate.weight",
)
FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
SCALED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight")
SCALE = "_scale_inv"
EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")
_PREFIX = re.compile(r"^(?:.*\.)?layers\.(\d+)\.")


def expert_names(num_experts: int, experts: Optional[Sequence[int]] = None) -> list[str]:
    """the per-expert names of every expert, or of `experts` (ids) only"""
    ids = range(num_experts) if experts is None else experts
    return [f"mlp.experts.{e}.{p}.weight" for e in ids for p in EXPERT_PARTS]


def expert_id_list(experts: Optional[Sequence[int]]) -> Optional[list]:
    """experts= as a list (None stays None); a TypeError for what is no sequence of ids (the
    engine checks the ids themselves)"""
    if experts is None:
        return None
    if isinstance(experts, (str, bytes)) or not isinstance(experts, Sequence):
        raise TypeError(f"experts: expected a sequence of expert ids, got {type(experts).__name__}")
    return list(experts)


def valid_expert_ids(experts: Optional[Sequence[int]], num_experts: int) -> Optional[list]:
    """the ids of experts= that name an expert (None stays None): the names a subset layer
    needs are made of these; the others are the engine's to refuse by position"""
    if experts is None:
        return None
    return [e for e in expert_id_list(experts) if type(e) is int and 0 <= e < num_experts]


def canonical_weights(weights: Mapping[str, Any], config: LayerConfig,
                      experts: Optional[Sequence[int]] = None) -> dict[str, Any]:
    """Returns {canonical name: tensor}; raises ValueError naming any missing, extra or
    misnamed weight. experts: the ids a layer holding a subset holds (checked by the engine):
    per-expert weights of the others are left out (fused tensors stay whole)."""
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights: expected a mapping of name -> tensor, got {type(weights).__name__}")
    out: dict[str, Any] = {}
    layers = set()
    for name, tensor in weights.items():
        if not isinstance(name, str):
            raise TypeError(f"weights: expected str names, got {name!r}")
        m = _PREFIX.match(name)
        if m:
            layers.add(int(m.group(1)))
            name = name[m.end():]
        if name in out:
            raise ValueError(f"weights: '{name}' given twice (with and without a prefix)")
        out[name] = tensor
    if len(layers) > 1:
        raise ValueError(f"weights: expected the tensors of one layer, got layers {sorted(layers)}")

    per_expert = expert_names(config.num_experts)
    if experts is not None:  # the other experts' weights belong to other layers holding them
        held = set(expert_names(config.num_experts, valid_expert_ids(experts, config.num_experts)))
        others = {n for n in per_expert if n not in held}
        out = {n: t for n, t in out.items() if n not in others and n.removesuffix(SCALE) not in others}
        per_expert = [n for n in per_expert if n in held]
    fused = any(n in out for n in FUSED)
    if fused and any(n in out for n in per_expert):
        raise ValueError("weights: expected experts either fused (mlp.experts.gate_up_proj, "
                         "mlp.experts.down_proj) or per expert (mlp.experts.{e}.*.weight), got both")
    expected = list(DENSE) + (list(FUSED) if fused else per_expert)
    if any(n.endswith(SCALE) for n in out):  # FP8: every projection matrix has its scale
        expected += [n + SCALE for n in SCALED + (FUSED if fused else tuple(per_expert))]
    expected_set = set(expected)
    extra = [n for n in out if n not in expected_set]
    if extra:
        hints = []
        for n in extra[:5]:
            close = difflib.get_close_matches(n, expected, n=1)
            hints.append(f"'{n}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise ValueError(f"weights: unexpected {', '.join(hints)}{more}")
    missing = [n for n in expected if n not in out]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"weights: missing {', '.join(repr(n) for n in missing[:5])}{more}")
    _check_fused_gate_up_scale(out.get(FUSED[0] + SCALE), config)
    return out


def expert_weights(weights: dict) -> dict:
    """canonical weights without the attention's, the norms' and the router's (and their
    scales): what an expert-only host layer takes"""
    dense = set(DENSE) | {n + SCALE for n in SCALED}
    return {n: t for n, t in weights.items() if n not in dense}


def held_expert_views(weights: dict, config: LayerConfig, experts: Sequence[int]) -> dict:
    """weights (canonical names) with fused expert tensors in host memory replaced by views of
    the held experts' slices under their per-expert names (gate: rows [0, I) of gate_up_proj[e],
    up: [I, 2I); FP8 scales: the gate's ceil(I/128) row blocks, then the up's), so that a CUDA
    layer holding a subset uploads only those. Tensors that cannot be sliced (the extension's
    own) or already on a device are left as they are."""
    gate_up, down = (weights.get(n) for n in FUSED)
    if gate_up is None or down is None or not all(hasattr(t, "__getitem__") and hasattr(t, "__dlpack_device__")
                                                 for t in (gate_up, down)):
        return weights
    if any(t.__dlpack_device__()[0] != 1 for t in (gate_up, down)):  # kDLCPU: on a device, borrowed whole
        return weights
    out = {n: t for n, t in weights.items() if n not in FUSED and n.removesuffix(SCALE) not in FUSED}
    inter, blocks = config.moe_intermediate_size, -(-config.moe_intermediate_size // 128)
    for e in valid_expert_ids(experts, config.num_experts):
        for src, parts in ((gate_up, (("gate_proj", 0, inter), ("up_proj", inter, 2 * inter))),
                           (down, (("down_proj", None, None),))):
            fused_name = FUSED[0] if src is gate_up else FUSED[1]
            scale = weights.get(fused_name + SCALE)
            for part, a, b in parts:
                name = f"mlp.experts.{e}.{part}.weight"
                out[name] = src[e] if a is None else src[e, a:b]
                if scale is not None:
                    sa, sb = (None, None) if a is None else (0, blocks) if a == 0 else (blocks, 2 * blocks)
                    out[name + SCALE] = scale[e] if sa is None else scale[e, sa:sb]
    return out


def _check_fused_gate_up_scale(scale: Any, config: LayerConfig) -> None:
    """A fused FP8 gate_up_proj [E, 2I, H] may come with scales in one of two layouts: the
    gate's ceil(I/128) row blocks then the up's (what per-expert checkpoints concatenate to,
    the layout the engine reads), or ceil(2I/128) blocks over the fused rows (transformers'
    FP8Experts when I is not a multiple of 128), where one block holds both gate and up rows
    and neither half can be read on its own. The second gets its own message."""
    shape = getattr(scale, "shape", None)
    inter = config.moe_intermediate_size
    split, fused = 2 * -(-inter // 128), -(-2 * inter // 128)
    if shape is None or len(shape) != 3 or split == fused or shape[1] != fused:
        return
    raise ValueError(f"weights['{FUSED[0] + SCALE}']: expected shape [{shape[0]}, {split}, {shape[2]}] (the gate's "
                     f"ceil(I/128) = {split // 2} row blocks, then the up's), got {list(shape)}: {fused} blocks "
                     f"over the fused 2I = {2 * inter} rows, one of them holding gate and up rows together "
                     f"(moe_intermediate_size {inter} is not a multiple of 128); not supported: pass the "
                     "experts one by one (mlp.experts.{e}.{gate,up,down}_proj.weight and their scales)")
