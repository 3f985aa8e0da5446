"""config.json's "quantization_config": which weight format a checkpoint's layer is stored in.

None: dense (bf16/fp32 matrices). {"quant_method": "fp8", ...}: the fine-grained FP8 format of
transformers' FineGrainedFP8Config and of the published Qwen3 FP8 checkpoints: every projection
matrix (q/k/v/o_proj, each expert's gate/up/down_proj) float8_e4m3fn with a
"<matrix>_scale_inv" of fp32 or bf16 scales, one per 128 x 128 block; the norms and the router
as they were. Fields, as those configs write them:
  quant_method       "fp8" (anything else: not taken)
  fmt                "e4m3" (Qwen's configs write it; transformers' has no such field and
                     always means e4m3); "e5m2" is refused
  weight_block_size  [128, 128] (transformers' default when absent; null means one scale per
                     matrix, refused, as is any other block)
  activation_scheme  "dynamic" (the default): activations quantized per call by FP8 kernels;
                     this layer keeps them in bf16/fp32 and reads only the weights in FP8.
                     "static" (calibrated activation scales stored beside the weights) is
                     refused rather than silently ignored
  scale_fmt          "float" (the default); "ue8m0" (power-of-two scales in one byte) refused
  expert_dtype       "fp8" (the default); "fp4" refused
  modules_to_not_convert (alias ignored_layers): modules kept unquantized; one that names a
                     projection of the loaded layer is refused (the engine takes all of a
                     layer's projections in one format); others (lm_head, embeddings) are
                     not this layer's business
  dequantize, modules_to_convert: load options of transformers, not facts of the files.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

from .safetensors import CheckpointError, show

DENSE = "dense"
FP8 = "fp8_e4m3_block128"
GPTQ = "gptq_int4"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")


def _field(cfg_path: str, qc: dict, key: str, default: Any, expected: tuple, why: str) -> None:
    value = qc.get(key, default)
    if value not in expected or type(value) is not type(expected[0]):
        raise CheckpointError(f"{cfg_path}: quantization_config.{key}: expected "
                              f"{' or '.join(repr(e) for e in expected)}, got {show(value)}{why}")


def _projections(layer_idx: int, num_experts: int) -> List[str]:
    """the module names of the layer's projections, as transformers names them (experts both
    fused, as 5.x holds them, and one by one, as the checkpoints store them)"""
    p = f"model.layers.{layer_idx}."
    return ([p + "self_attn." + a for a in ATTENTION] + [p + "mlp.experts"]
            + [f"{p}mlp.experts.{e}.{x}" for e in range(num_experts) for x in EXPERT_PARTS])


def _matches(pattern: str, module: str) -> bool:
    """transformers' rule, taken literally: the pattern names the module, one of its parents
    (a prefix ending at a '.'), or a tail of its name ("q_proj", "self_attn.q_proj")"""
    return module == pattern or module.startswith(pattern + ".") or module.endswith("." + pattern)


def _check_not_converted(cfg_path: str, qc: dict, layer_idx: int, num_experts: int) -> None:
    key = "modules_to_not_convert" if "modules_to_not_convert" in qc else "ignored_layers"
    skip = qc.get(key)
    if skip is None:
        return
    if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        raise CheckpointError(f"{cfg_path}: quantization_config.{key}: expected a list of module names, "
                              f"got {show(skip)}")
    for pattern in skip:
        hit = next((m for m in _projections(layer_idx, num_experts) if _matches(pattern, m)), None)
        if hit is not None:
            raise CheckpointError(f"{cfg_path}: quantization_config.{key}: {show(pattern)} keeps {hit} unquantized; "
                                  "expected every projection of the layer in FP8 (a layer mixing FP8 and "
                                  "dense projections is not supported)")


def weight_format(cfg_path: str, raw: dict, layer_idx: int, num_experts: int) -> Tuple[str, dict]:
    """(DENSE, FP8 or GPTQ, the engine's settings of that format: gptq_settings' for GPTQ, else
    {}) for layer `layer_idx` of the checkpoint whose config.json (at cfg_path) holds `raw`; a
    quantization this layer cannot read raises CheckpointError naming config.json and the
    field, before any tensor is read."""
    if raw.get("quantization_config") is None:
        return DENSE, {}
    qc = raw["quantization_config"]
    if not isinstance(qc, dict):
        raise CheckpointError(f"{cfg_path}: quantization_config: expected an object, got {show(qc)}")
    if qc.get("quant_method") == "gptq":
        try:
            return GPTQ, gptq_settings(qc, f"{cfg_path}: quantization_config", num_experts)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    _field(cfg_path, qc, "quant_method", None, ("fp8",),
           " (block-scaled FP8; other quantizations are not supported: expected no quantization_config for "
           "bf16/fp32 weights)")
    _field(cfg_path, qc, "fmt", "e4m3", ("e4m3",), " (only float8_e4m3fn weights are supported)")
    block = qc.get("weight_block_size", [128, 128])
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int for b in block)
            and block == [128, 128]):
        raise CheckpointError(f"{cfg_path}: quantization_config.weight_block_size: expected [128, 128], "
                              f"got {show(block)} (only 128 x 128 scale blocks are supported)")
    scheme = qc.get("activation_scheme", "dynamic")
    qc = dict(qc, activation_scheme=scheme.lower() if isinstance(scheme, str) else scheme)  # as transformers
    _field(cfg_path, qc, "activation_scheme", "dynamic", ("dynamic",),
           " (static activation scales are not supported: this layer keeps activations in bf16/fp32)")
    _field(cfg_path, qc, "scale_fmt", "float", ("float",), " (scales must be fp32 or bf16 numbers)")
    _field(cfg_path, qc, "expert_dtype", "fp8", ("fp8",), " (FP4 experts are not supported)")
    _check_not_converted(cfg_path, qc, layer_idx, num_experts)
    return FP8, {}


# modules a GPTQ checkpoint may keep unquantized without touching a decoder layer's projections
# (the router, mlp.gate, is dense in the gptq_int4 format as GPTQModel's qwen3_moe leaves it)
_GPTQ_DENSE_OK = ("lm_head", "embed_tokens", "mlp.gate", "norm")


def gptq_settings(qc: Any, where: str = "quantization_config", num_experts: Optional[int] = None) -> dict:
    """The engine's settings of a gptq_int4 layer ({gptq_group, gptq_v2}: keyword arguments of
    qwen3layer._C.Layer and random_weights) from a GPTQ quantization_config as GPTQModel and
    AutoGPTQ write it: quant_method "gptq", bits 4, group_size -1 (one group a matrix) or a
    positive multiple of 8 (default 128), sym either (the zeros are read as stored), desc_act
    either (g_idx is read), checkpoint_format "gptq" (a zero stored minus 1) or "gptq_v2".
    ValueError naming the field (`where`.field) for anything else: other bits, per-module
    `dynamic` overrides, modules_to_not_convert naming a layer's projection, a pack_dtype other
    than int32, modules_in_block_to_quantize leaving one of a layer's projections out. Load
    options (damp_percent, true_sequential, static_groups, use_exllama, backend, meta, ...) are
    not facts of the files and are not read."""
    if not isinstance(qc, dict):
        raise ValueError(f"{where}: expected a dict (a GPTQ quantization_config), got {show(qc)}")

    def field(key: str, default: Any, ok: Any, expected: str, why: str = "") -> Any:
        value = qc.get(key, default)
        if not ok(value):
            raise ValueError(f"{where}.{key}: expected {expected}, got {show(value)}{why}")
        return value

    field("quant_method", None, lambda v: v == "gptq", "'gptq'")
    field("bits", 4, lambda v: type(v) is int and v == 4, "4", " (only 4-bit GPTQ weights are read)")
    group = field("group_size", 128, lambda v: type(v) is int and (v == -1 or (v > 0 and v % 8 == 0)),
                  "-1 (one group a matrix) or a positive multiple of 8")
    field("sym", True, lambda v: type(v) is bool, "true or false")
    field("desc_act", False, lambda v: type(v) is bool, "true or false")
    fmt = field("checkpoint_format", "gptq", lambda v: v in ("gptq", "gptq_v2"), "'gptq' or 'gptq_v2'")
    field("pack_dtype", "int32", lambda v: v == "int32", "'int32'", " (GPTQModel's words of another width are not read)")
    _check_all_quantized(qc, where, num_experts)
    field("dynamic", None, lambda v: not v, "no per-module overrides",
          " (a layer whose modules differ in bits or group is not read yet)")
    skip = field("modules_to_not_convert", None, lambda v: v is None or (isinstance(v, list) and all(
        isinstance(s, str) for s in v)), "a list of module names")
    for name in skip or ():
        if not any(name == ok or name.endswith("." + ok) for ok in _GPTQ_DENSE_OK):
            raise ValueError(f"{where}.modules_to_not_convert: {show(name)} may keep a decoder layer's projection "
                             "dense; expected only lm_head, embed_tokens, mlp.gate or norms (a layer mixing dense "
                             "and 4-bit projections is not read yet)")
    return {"gptq_group": group if group != 128 else 0, "gptq_v2": fmt == "gptq_v2"}


def _check_all_quantized(qc: dict, where: str, num_experts: Optional[int]) -> None:
    """modules_in_block_to_quantize (transformers' GPTQConfig: lists of a block's module names
    quantized, the others left dense), where given, must name every projection of the layer:
    q/k/v/o_proj and each expert's gate/up/down_proj ("mlp.experts.<e>.<part>", e of
    range(num_experts), or of the experts it names where num_experts is not known)"""
    lists = qc.get("modules_in_block_to_quantize")
    if lists is None:
        return
    if not (isinstance(lists, list) and all(isinstance(x, list) and all(isinstance(n, str) for n in x)
                                            for x in lists)):
        raise ValueError(f"{where}.modules_in_block_to_quantize: expected lists of module names, got {show(lists)}")
    named = {n for x in lists for n in x}
    missing = [f"self_attn.{a}" for a in ATTENTION if f"self_attn.{a}" not in named]
    experts = sorted({int(n.split(".")[2]) for n in named if n.count(".") == 3 and n.startswith("mlp.experts.")
                      and n.split(".")[2].isdecimal() and len(n.split(".")[2]) <= 9}) if num_experts is None else range(num_experts)
    for e in experts:
        missing += [f"mlp.experts.{e}.{x}" for x in EXPERT_PARTS if f"mlp.experts.{e}.{x}" not in named]
    if not experts:
        missing.append("mlp.experts.<e>.gate_proj/up_proj/down_proj")
    if missing:
        raise ValueError(f"{where}.modules_in_block_to_quantize: leaves {', '.join(missing[:3])}"
                         + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
                         + " dense; expected every projection of a decoder layer quantized (a layer mixing dense "
                         "and 4-bit projections is not read yet)")
