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
                     projection of the loaded layer (by transformers' rule: _not_converted)
                     is refused (the engine takes all of a layer's projections in one
                     format); others (lm_head, embeddings) are not this layer's business
  dequantize, modules_to_convert: load options of transformers, not facts of the files.
"""
from __future__ import annotations

import re
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

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


def _not_converted(pattern: str, module: str, or_within: bool) -> bool:
    """whether modules_to_not_convert's `pattern` keeps `module` unquantized: by transformers'
    rule, taken literally (the pattern names the module, one of its parents: a prefix ending at
    a '.', or a tail of its name: "q_proj", "self_attn.q_proj"), or, with or_within, also where
    the pattern is anywhere within the name ("self_attn" in "model.layers.0.self_attn.q_proj"),
    the substring test some loaders use. Why two readings: an FP8 checkpoint has one loader,
    transformers', so FP8 reads its rule alone; GPTQ loaders differ in how they match, so GPTQ
    takes the reading that keeps more modules dense, and a layer never reads as 4-bit what one
    of them would leave dense."""
    if or_within:
        return pattern in module  # a name, a parent or a tail is within the name too: the union
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
        hit = next((m for m in _projections(layer_idx, num_experts) if _not_converted(pattern, m, or_within=False)),
                   None)
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
            return GPTQ, gptq_settings(qc, f"{cfg_path}: quantization_config", num_experts, layer_idx)
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


class _Field(NamedTuple):
    default: Any  # the value a config that leaves the field out means
    ok: Callable[[Any], bool]  # whether the layer reads the value
    expected: str  # the values it reads, for the error
    why: str = ""


# the fields of a GPTQ module that change how its tensors read, in the order gptq_settings checks
# them, each with its default and the values this layer reads. One table for both readings: the
# config's own value, and what a per-module override (GPTQModel's `dynamic`) is compared with,
# since one that differs makes that module another format.
_GPTQ_LAYOUT = {
    "bits": _Field(4, lambda v: type(v) is int and v == 4, "4", " (only 4-bit GPTQ weights are read)"),
    "group_size": _Field(128, lambda v: type(v) is int and (v == -1 or (v > 0 and v % 8 == 0)),
                         "-1 (one group a matrix) or a positive multiple of 8"),
    "sym": _Field(True, lambda v: type(v) is bool, "true or false"),
    "desc_act": _Field(False, lambda v: type(v) is bool, "true or false"),
    "checkpoint_format": _Field("gptq", lambda v: v in ("gptq", "gptq_v2"), "'gptq' or 'gptq_v2'"),
    "pack_dtype": _Field("int32", lambda v: v == "int32", "'int32'",
                         " (GPTQModel's words of another width are not read)"),
}


def _layout(qc: dict, key: str) -> Any:
    """the layer's value of _GPTQ_LAYOUT's field `key`: the config's, else the default"""
    return qc.get(key, _GPTQ_LAYOUT[key].default)


def gptq_settings(qc: Any, where: str = "quantization_config", num_experts: Optional[int] = None,
                  layer_idx: Optional[int] = None) -> dict:
    """The engine's settings of a gptq_int4 layer ({gptq_group, gptq_v2, gptq_dense_attention}:
    keyword arguments of qwen3layer._C.Layer and random_weights) from a GPTQ quantization_config
    as GPTQModel and AutoGPTQ write it: quant_method "gptq", bits 4, group_size -1 (one group a
    matrix) or a positive multiple of 8 (default 128), sym either (the zeros are read as
    stored), desc_act either (g_idx is read), checkpoint_format "gptq" (a zero stored minus 1)
    or "gptq_v2", pack_dtype int32.

    Which of the layer's projections are 4-bit: all of them, or every expert's with q/k/v/o_proj
    left dense (gptq_dense_attention), as checkpoints quantized to the experts alone say it in
    any of three ways: a `dynamic` rule "-:<regex>" (GPTQModel: the modules whose full name the
    regex matches from its start are skipped), modules_to_not_convert (a name anywhere within
    the module's: transformers' rule or the substring test of other loaders), or
    modules_in_block_to_quantize leaving self_attn out (each read as _dense_by_dynamic,
    _dense_by_not_convert and _dense_by_block_lists say). Names are the checkpoint's,
    "model.layers.<layer_idx>.self_attn.q_proj" (layer 0 where layer_idx is not known). A
    `dynamic` override (a rule "+:<regex>" or a bare regex) that changes a field of _GPTQ_LAYOUT
    for one of the layer's projections, a rule leaving some of the attention dense and not the
    rest, or any expert dense: ValueError naming the field and the module (a layer holds its
    experts in one format). ValueError naming the field (`where`.field) for any other value the
    layer cannot read. Load options (damp_percent, true_sequential, static_groups, use_exllama,
    backend, meta, ...) are not facts of the files and are not read."""
    if not isinstance(qc, dict):
        raise ValueError(f"{where}: expected a dict (a GPTQ quantization_config), got {show(qc)}")
    if qc.get("quant_method") != "gptq":
        raise ValueError(f"{where}.quant_method: expected 'gptq', got {show(qc.get('quant_method'))}")
    for key, f in _GPTQ_LAYOUT.items():
        value = _layout(qc, key)
        if not f.ok(value):
            raise ValueError(f"{where}.{key}: expected {f.expected}, got {show(value)}{f.why}")
    group, fmt = _layout(qc, "group_size"), _layout(qc, "checkpoint_format")
    modules = _gptq_modules(layer_idx, num_experts)
    by_field = {"dynamic": _dense_by_dynamic(qc, where, modules),
                "modules_to_not_convert": _dense_by_not_convert(qc, where, modules),
                "modules_in_block_to_quantize": _dense_by_block_lists(qc, where, modules, num_experts)}
    dense = set().union(*by_field.values())
    attention = [m for m in modules if ".self_attn." in m]
    # in the layer's order; then any expert outside `modules` (one modules_in_block_to_quantize names where
    # num_experts is not known)
    experts = [m for m in modules if m in dense and m not in attention] + sorted(dense - set(modules))
    partial = bool(dense) and not experts and dense != set(attention)
    if experts or partial:
        first = experts[0] if experts else next(m for m in attention if m in dense)
        said = next(f for f, ms in by_field.items() if first in ms)
        raise ValueError(f"{where}.{said}: leaves {first} dense" + (
            "; expected every expert's projections 4-bit (a layer holds its experts in one format)" if experts else
            f" and {next(m for m in attention if m not in dense)} 4-bit; expected q/k/v/o_proj all 4-bit or all "
            "dense"))
    return {"gptq_group": group if group != 128 else 0, "gptq_v2": fmt == "gptq_v2",
            "gptq_dense_attention": bool(dense)}


def _gptq_modules(layer_idx: Optional[int], num_experts: Optional[int]) -> List[str]:
    """the full names of the layer's projection modules the rules are tested on (one expert,
    "<e>", where num_experts is not known: rules naming single experts then match none)"""
    p = f"model.layers.{layer_idx or 0}."
    experts = range(num_experts) if num_experts is not None else ("<e>",)
    return [p + "self_attn." + a for a in ATTENTION] + [f"{p}mlp.experts.{e}.{x}" for e in experts for x in EXPERT_PARTS]


def _dense_by_dynamic(qc: dict, where: str, modules: List[str]) -> set:
    """the modules GPTQModel's `dynamic` skips ("-:" rules); an override of a layout field for
    one of them: ValueError"""
    dynamic = qc.get("dynamic")
    if not dynamic:
        return set()
    if not isinstance(dynamic, dict) or not all(isinstance(k, str) for k in dynamic):
        raise ValueError(f"{where}.dynamic: expected an object of regex -> overrides, got {show(dynamic)}")
    skipped = set()
    for rule, overrides in dynamic.items():
        negative = rule.startswith("-:")
        try:
            pattern = re.compile(rule[2:] if rule[:2] in ("-:", "+:") else rule)
        except re.error as e:
            raise ValueError(f"{where}.dynamic: {show(rule)} is not a regular expression ({e})") from None
        hits = [m for m in modules if pattern.match(m)]
        if negative:
            skipped.update(hits)
            continue
        if not isinstance(overrides, dict):
            raise ValueError(f"{where}.dynamic[{show(rule)}]: expected an object of overrides, got {show(overrides)}")
        changed = [k for k in _GPTQ_LAYOUT if k in overrides and overrides[k] != _layout(qc, k)]
        if hits and changed:
            raise ValueError(f"{where}.dynamic[{show(rule)}].{changed[0]}: {show(overrides[changed[0]])} for {hits[0]}, "
                             f"where the layer's others have {show(_layout(qc, changed[0]))}; "
                             "expected every 4-bit projection of a layer in one layout")
    return skipped


def _dense_by_not_convert(qc: dict, where: str, modules: List[str]) -> set:
    """the modules modules_to_not_convert keeps dense, by transformers' rule or a name within
    theirs (_not_converted: GPTQ loaders differ in how they match)"""
    skip = qc.get("modules_to_not_convert")
    if skip is None:
        return set()
    if not (isinstance(skip, list) and all(isinstance(s, str) for s in skip)):
        raise ValueError(f"{where}.modules_to_not_convert: expected a list of module names, got {show(skip)}")
    return {m for m in modules for pattern in skip if _not_converted(pattern, m, or_within=True)}


def _dense_by_block_lists(qc: dict, where: str, modules: List[str], num_experts: Optional[int]) -> set:
    """the modules modules_in_block_to_quantize (transformers' GPTQConfig: lists of a block's
    module names quantized, the others left dense) leaves out: self_attn's (of `modules`), and
    any expert's gate/up/down_proj ("mlp.experts.<e>.<part>", e of range(num_experts), or of the
    experts it names where num_experts is not known: ValueError where it names none)"""
    lists = qc.get("modules_in_block_to_quantize")
    if lists is None:
        return set()
    if not (isinstance(lists, list) and all(isinstance(x, list) and all(isinstance(n, str) for n in x)
                                            for x in lists)):
        raise ValueError(f"{where}.modules_in_block_to_quantize: expected lists of module names, got {show(lists)}")
    named = {n for x in lists for n in x}
    experts = sorted({int(n.split(".")[2]) for n in named if n.count(".") == 3 and n.startswith("mlp.experts.")
                      and n.split(".")[2].isdecimal() and len(n.split(".")[2]) <= 9}) if num_experts is None else range(num_experts)
    if not experts:
        raise ValueError(f"{where}.modules_in_block_to_quantize: names no expert's gate_proj/up_proj/down_proj; "
                         "expected every expert's projections 4-bit")
    prefix = modules[0][:modules[0].index("self_attn.")]
    return {prefix + n for n in [f"self_attn.{a}" for a in ATTENTION]
            + [f"mlp.experts.{e}.{x}" for e in experts for x in EXPERT_PARTS] if n not in named}
