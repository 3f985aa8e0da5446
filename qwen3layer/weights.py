"""Weight names: from any of the accepted spellings to the engine's canonical names.

Accepted: the per-layer names of a transformers Qwen3-MoE checkpoint, with or without a
"model.layers.N." prefix; experts either per expert (mlp.experts.{e}.gate_proj.weight, ...)
or fused as transformers 5.x holds them (mlp.experts.gate_up_proj [E, 2I, H],
mlp.experts.down_proj [E, H, I]). Which names a layer reads, in which format, is the engine's
one table (_C.weight_table: names, shapes, storage; an FP8 layer adds a "<matrix>_scale_inv"
beside each projection matrix, a GPTQ int4 layer holds "<module>.qweight" with its ".scales",
".qzeros" and ".g_idx"); this module only matches what it was given against it.
Shapes and dtypes are checked by the engine.
"""
from __future__ import annotations

import difflib
import re
from typing import Any, Mapping, Optional, Sequence

from . import _C
from .config import LayerConfig

_PREFIX = re.compile(r"^(?:.*\.)?layers\.(\d+)\.")


def names(config: LayerConfig, fmt: str = "dense", experts: Optional[Sequence[int]] = None, fused: bool = False,
          experts_only: bool = False, gptq_group: int = 0, gptq_dense_attention: bool = False) -> list[str]:
    """the names of the engine's table (_C.weight_table) for a layer of `fmt` holding
    `experts` (None: all), in the order it reads them (gptq_group: a GPTQ layer's group, the
    engine's: 0 for 128, -1 for one a matrix; the table refuses a geometry it does not divide;
    gptq_dense_attention: its q/k/v/o_proj dense)"""
    return [row[0] for row in _C.weight_table(config, fmt, experts, fused, experts_only, gptq_group=gptq_group,
                                              gptq_dense_attention=gptq_dense_attention)]


def gptq_attention_dense(weights: Mapping[str, Any]) -> bool:
    """whether a GPTQ layer's weights hold self_attn.q_proj dense ("<...>.q_proj.weight", as
    checkpoints quantized to the experts alone store it) rather than 4-bit (".qweight")"""
    return any(isinstance(k, str) and (k == "self_attn.q_proj.weight" or k.endswith(".self_attn.q_proj.weight"))
               for k in weights)


def scales(config: LayerConfig, fmt: str, experts: Optional[Sequence[int]] = None,
           fused: bool = False, gptq_group: int = 0) -> dict[str, str]:
    """{scale name: its matrix's name} of the table: what a format stores beside a matrix"""
    table = _C.weight_table(config, fmt, experts, fused, gptq_group=gptq_group)
    return {name: table[of][0] for name, _, storage, of in table if storage == "scale"}


def _format_of(out: Mapping[str, Any], config: LayerConfig, gptq_group: int = 0, dense_attention: bool = False) -> str:
    """the format whose own names (beyond the dense format's: FP8's scales, GPTQ's qweight and
    what stands beside it) appear in out; a format the geometry cannot take (the engine's
    table refuses it: GPTQ's with a group, `gptq_group`, that does not divide it) is passed over"""
    for fmt in _C.weight_formats()[1:]:
        for fused in (False, True):
            try:
                own = set(names(config, fmt, None, fused, gptq_group=gptq_group,
                                gptq_dense_attention=dense_attention and fmt == "gptq_int4")) \
                    - set(names(config, "dense", None, fused))
            except ValueError:
                break
            if any(n in out for n in own):
                return fmt
    return "dense"


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
                      experts: Optional[Sequence[int]] = None, gptq_group: int = 0,
                      gptq_dense_attention: bool = False) -> dict[str, Any]:
    """Returns {canonical name: tensor}; raises ValueError naming any missing, extra or
    misnamed weight. experts: the ids a layer holding a subset holds (checked by the engine):
    per-expert weights of the others are left out (fused tensors stay whole). gptq_group: a
    GPTQ layer's group (as names()), without which a geometry that 128 does not divide would
    not be read as GPTQ at all; gptq_dense_attention: its q/k/v/o_proj dense (as names())."""
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

    fmt = _format_of(out, config, gptq_group, gptq_dense_attention)
    dense_attention = gptq_dense_attention and fmt == "gptq_int4"
    held = None if experts is None else valid_expert_ids(experts, config.num_experts)
    per_expert = names(config, fmt, held, experts_only=True, gptq_group=gptq_group, gptq_dense_attention=dense_attention)
    if held is not None:  # the other experts' weights (and scales) belong to other layers holding them
        others = set(names(config, fmt, None, experts_only=True, gptq_group=gptq_group,
                           gptq_dense_attention=dense_attention)) - set(per_expert)
        out = {n: t for n, t in out.items() if n not in others}
    fused_names = names(config, "dense", None, True, True)
    fused = any(n in out for n in fused_names)
    if fused and any(n in out for n in per_expert):
        raise ValueError(f"weights: expected experts either fused ({', '.join(fused_names)}) or per expert "
                         "(mlp.experts.{e}.*.weight), got both")
    expected = names(config, fmt, held, fused, gptq_group=gptq_group, gptq_dense_attention=dense_attention)
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
    if fused:
        for scale, matrix in scales(config, fmt, None, True).items():
            if matrix == fused_names[0]:
                _check_fused_gate_up_scale(out.get(scale), scale, config)
    return out


def expert_weights(weights: dict, config: LayerConfig, gptq_group: int = 0) -> dict:
    """canonical weights without the attention's, the norms' and the router's (and their
    scales): what an expert-only host layer takes (gptq_group: as names())"""
    dense = set()
    for fmt in _C.weight_formats():
        try:
            dense.update(names(config, fmt, [], gptq_group=gptq_group))
        except ValueError:  # a format this geometry cannot take (GPTQ's groups): none of its names
            pass
    return {n: t for n, t in weights.items() if n not in dense}


def held_expert_views(weights: dict, config: LayerConfig, experts: Sequence[int]) -> dict:
    """weights (canonical names) with fused expert tensors in host memory replaced by views of
    the held experts' slices under their per-expert names (gate: rows [0, I) of gate_up_proj[e],
    up: [I, 2I); FP8 scales: the gate's ceil(I/128) row blocks, then the up's), so that a CUDA
    layer holding a subset uploads only those. Tensors that cannot be sliced (the extension's
    own) or already on a device are left as they are."""
    gate_up_name, down_name = names(config, "dense", None, True, True)
    gate_up, down = weights.get(gate_up_name), weights.get(down_name)
    if gate_up is None or down is None or not all(hasattr(t, "__getitem__") and hasattr(t, "__dlpack_device__")
                                                 for t in (gate_up, down)):
        return weights
    if any(t.__dlpack_device__()[0] != 1 for t in (gate_up, down)):  # kDLCPU: on a device, borrowed whole
        return weights
    fmt = _format_of(weights, config)
    fused_scale = {m: s for s, m in scales(config, fmt, None, True).items() if m in (gate_up_name, down_name)}
    whole = {gate_up_name, down_name} | set(fused_scale.values())
    out = {n: t for n, t in weights.items() if n not in whole}
    inter, blocks = config.moe_intermediate_size, -(-config.moe_intermediate_size // 128)
    # expert e's gate, up and down (the table's order) as slices of the fused tensors: rows
    # [0, I) and [I, 2I) of gate_up[e], down[e] whole; each scale's blocks likewise
    parts = ((gate_up_name, 0, inter, 0, blocks), (gate_up_name, inter, 2 * inter, blocks, 2 * blocks),
             (down_name, None, None, None, None))
    for e in valid_expert_ids(experts, config.num_experts):
        per_scale = scales(config, fmt, [e])
        matrices = [n for n in names(config, fmt, [e], experts_only=True) if n not in per_scale]
        mine = {m: s for s, m in per_scale.items()}
        for name, (src, a, b, sa, sb) in zip(matrices, parts):
            t, scale = weights[src], weights.get(fused_scale.get(src))
            out[name] = t[e] if a is None else t[e, a:b]
            if scale is not None and name in mine:
                out[mine[name]] = scale[e] if sa is None else scale[e, sa:sb]
    return out


def _check_fused_gate_up_scale(scale: Any, name: str, config: LayerConfig) -> None:
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
    raise ValueError(f"weights['{name}']: expected shape [{shape[0]}, {split}, {shape[2]}] (the gate's "
                     f"ceil(I/128) = {split // 2} row blocks, then the up's), got {list(shape)}: {fused} blocks "
                     f"over the fused 2I = {2 * inter} rows, one of them holding gate and up rows together "
                     f"(moe_intermediate_size {inter} is not a multiple of 128); not supported: pass the "
                     "experts one by one (mlp.experts.{e}.{gate,up,down}_proj.weight and their scales)")
