"""4-bit GPTQ checkpoints through DecoderLayer.from_checkpoint: the qweight, qzeros, scales and
g_idx of each projection borrowed from the mapping (nothing dequantized at load), the layer
equal to transformers' on the dequantized weights (tests/helpers/gptq_reference.py packs them
from the packing rules), and every bad GPTQ checkpoint refused naming the file and tensor (or
config.json and the field) before any layer is made, the mappings closed."""
import json
import os
import re

import pytest
import torch
from safetensors.torch import save_file

import qwen3layer as q3
from gptq_reference import gptq_model, prefill_then_decode_error, random_model
from hf_reference import converted, draw_input, rel_err, run
from qwen3layer.checkpoint import CheckpointError, UnsupportedDtypeError
from qwen3layer.checkpoint.quantization import gptq_settings

G128 = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=6,
            num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True)
QC = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False,
      "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True}
P = "model.layers.0."


def gptq_checkpoint(path, seed=0, quant=None, change=None, geometry=G128, **pack):
    """(model with the dequantized weights, checkpoint folder): layer 0's GPTQ tensors with the
    model's other tensors, config.json with QC | quant; change(tensors) edits the tensors (names
    with the layer prefix) before they are written"""
    model = random_model(geometry, seed)
    layer = gptq_model(model, seed=seed, **pack)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if ".layers." not in k}
    tensors.update({P + k: v for k, v in layer.items()})
    if change:
        change(tensors)
    os.makedirs(path, exist_ok=True)
    cfg = model.config.to_dict()
    cfg["quantization_config"] = dict(QC, **(quant or {}))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return model, str(path)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return gptq_checkpoint(tmp_path_factory.mktemp("gptq") / "good", seed=3)


def mapped(layer, ptr):
    starts = [(q3._C.buffer_view(mm, 0, (1,), "float32").data_ptr, len(mm)) for mm in layer._mappings]
    return any(a <= ptr < a + n for a, n in starts)


LAYOUT_DEFAULTS = {"bits": 4, "group_size": 128, "sym": True, "desc_act": False, "checkpoint_format": "gptq",
                   "pack_dtype": "int32"}


@pytest.mark.parametrize("key,other", [("bits", 8), ("group_size", 64), ("sym", False), ("desc_act", True),
                                       ("checkpoint_format", "gptq_v2"), ("pack_dtype", "int16")])
def test_a_field_left_out_is_its_default_for_the_config_and_for_a_dynamic_override(key, other):
    """a config without the layout fields reads as one with their defaults, and a `dynamic`
    override is compared with the same default: equal to it changes nothing, another value is
    refused naming the default"""
    bare = {"quant_method": "gptq"}
    plain = {"gptq_group": 0, "gptq_v2": False, "gptq_dense_attention": False}
    assert gptq_settings(bare, num_experts=6) == gptq_settings(bare | LAYOUT_DEFAULTS, num_experts=6) == plain
    assert gptq_settings(bare | {"dynamic": {r"+:.*down_proj": LAYOUT_DEFAULTS}}, num_experts=6) == plain
    with pytest.raises(ValueError, match=re.escape(f"quantization_config.dynamic['+:.*down_proj'].{key}: {other!r} "
                                                   f"for model.layers.0.mlp.experts.0.down_proj, where the layer's "
                                                   f"others have {LAYOUT_DEFAULTS[key]!r}")):
        gptq_settings(bare | {"dynamic": {r"+:.*down_proj": {key: other}}}, num_experts=6)


def test_the_dense_expert_named_is_the_first_in_the_layers_order():
    """of the experts a config leaves dense, the error names the first as the layer holds them
    (expert 2 before expert 10, up_proj before down_proj), not the first by name; with
    num_experts not known, the experts modules_in_block_to_quantize names stand for them"""
    skip = ["experts.10.gate_proj", "experts.2.down_proj", "experts.2.up_proj"]
    with pytest.raises(ValueError, match=r"modules_to_not_convert: leaves model.layers.0.mlp.experts.2.up_proj dense; "
                                         r"expected every expert's projections 4-bit"):
        gptq_settings(QC | {"modules_to_not_convert": skip}, num_experts=12)
    named = [[f"self_attn.{a}" for a in ("q_proj", "k_proj", "v_proj", "o_proj")],
             [f"mlp.experts.{e}.{p}" for e in range(10) for p in ("gate_proj", "up_proj", "down_proj")]
             + ["mlp.experts.10.up_proj"]]
    with pytest.raises(ValueError, match=r"modules_in_block_to_quantize: leaves model.layers.0.mlp.experts.10.down_proj "
                                         r"dense"):
        gptq_settings(QC | {"modules_in_block_to_quantize": named})


def test_modules_to_not_convert_reads_a_name_within_a_modules_name():
    """GPTQ loaders differ in how they match modules_to_not_convert, so a name anywhere within
    a module's (not its name, a parent or a tail: transformers' rule, FP8's reading,
    tests/fp8/test_fp8_checkpoint.py) leaves it dense too"""
    assert gptq_settings(QC | {"modules_to_not_convert": ["self_attn"]}, num_experts=6)["gptq_dense_attention"]
    with pytest.raises(ValueError, match=r"modules_to_not_convert: leaves model.layers.0.mlp.experts.3.gate_proj dense"):
        gptq_settings(QC | {"modules_to_not_convert": ["experts.3"]}, num_experts=6)


def test_a_gptq_checkpoint_is_borrowed_from_the_mapping_and_equals_transformers(good):
    model, path = good
    layer = q3.DecoderLayer.from_checkpoint(path, 0)
    assert layer.weight_format == "gptq_int4" and layer.converted == ()
    ptrs = layer.weight_ptrs
    assert {"self_attn.q_proj.qweight", "self_attn.q_proj.scales", "mlp.experts.5.down_proj.g_idx"} <= set(ptrs)
    for name, ptr in ptrs.items():  # words, scales, zeros, g_idx, norms, router: all read from the file
        assert mapped(layer, ptr), name
    assert prefill_then_decode_error(layer, model, 9, seed=2) <= 1e-5


def test_what_the_quantization_config_says_is_read_from_config_json(tmp_path):
    """gptq_v2 zeros, group 64: read from config.json, the same layer as transformers'"""
    model, path = gptq_checkpoint(tmp_path / "v2", seed=4, quant={"checkpoint_format": "gptq_v2", "group_size": 64},
                                  v1=False, group=64)
    layer = q3.DecoderLayer.from_checkpoint(path, 0)
    x = draw_input(model, (1, 6, G128["hidden_size"]), seed=5)
    exact = run(converted(model, torch.float64), x.double())
    y = torch.from_dlpack(layer.prefill(x.contiguous(), layer.new_cache(8)))
    assert rel_err(y - x, exact.y - x.double()) <= 1e-5


# inputs 64 (hidden, q heads x head_dim) and 32 (moe_intermediate): multiples of 32, not of 128
G32 = dict(G128, hidden_size=64, head_dim=16, moe_intermediate_size=32)


@pytest.mark.parametrize("group", [32, -1])
def test_a_group_that_divides_a_geometry_128_does_not_is_read(tmp_path, group):
    """the fuzzer's find (tests/fuzz/fuzz_checkpoint.py): the layer's weight names were looked up
    with group 128, so a geometry that 128 does not divide was not taken as GPTQ at all
    ("weights: unexpected 'self_attn.q_proj.qweight'") whatever config.json's group_size"""
    model, path = gptq_checkpoint(tmp_path / f"g{group}", seed=7, quant={"group_size": group}, geometry=G32,
                                  group=group)
    layer = q3.DecoderLayer.from_checkpoint(path, 0)
    assert layer.weight_format == "gptq_int4"
    x = draw_input(model, (1, 5, G32["hidden_size"]), seed=8)
    exact = run(converted(model, torch.float64), x.double())
    y = torch.from_dlpack(layer.prefill(x.contiguous(), layer.new_cache(8)))
    assert rel_err(y - x, exact.y - x.double()) <= 1e-5


def test_an_expert_subset_maps_only_its_experts(good):
    _, path = good
    layer = q3.DecoderLayer.from_checkpoint(path, 0, experts=[1, 4])
    held = {n.split(".")[2] for n in layer.weight_ptrs if n.startswith("mlp.experts.")}
    assert held == {"1", "4"}
    whole = q3.DecoderLayer.from_checkpoint(path, 0)
    assert layer.weight_bytes < whole.weight_bytes


@pytest.mark.parametrize("quant,message", [
    ({"bits": 8}, r"config.json: quantization_config.bits: expected 4, got 8"),
    ({"group_size": 100}, r"config.json: quantization_config.group_size: expected -1 .* got 100"),
    ({"pack_dtype": "int16"}, r"config.json: quantization_config.pack_dtype: expected 'int32', got 'int16'"),
    ({"dynamic": {"-:.*experts.*": {}}}, r"config.json: quantization_config.dynamic: leaves "
                                          r"model.layers.0.mlp.experts.0.gate_proj dense; expected every expert's"),
    ({"dynamic": {r"+:.*experts\.3\..*": {"group_size": 64}}},
     r"quantization_config.dynamic\['\+:.*'\].group_size: 64 for model.layers.0.mlp.experts.3.gate_proj, where the "
     r"layer's others have 128"),
    ({"modules_in_block_to_quantize": [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                                       ["self_attn.o_proj"], [f"mlp.experts.{e}.{p}" for e in range(5)
                                                              for p in ("gate_proj", "up_proj", "down_proj")]]},
     r"modules_in_block_to_quantize: leaves model.layers.0.mlp.experts.5.gate_proj dense"),
    ({"modules_to_not_convert": ["model.layers.0.self_attn.q_proj"]},
     r"modules_to_not_convert: leaves model.layers.0.self_attn.q_proj dense and model.layers.0.self_attn.k_proj "
     r"4-bit; expected q/k/v/o_proj all 4-bit or all dense"),
])
def test_a_quantization_config_the_layer_cannot_read_is_refused_before_any_shard_opens(good, tmp_path, opened, quant,
                                                                                        message):
    _, path = good
    folder = tmp_path / "ck"
    folder.mkdir()
    os.symlink(os.path.join(path, "model.safetensors"), folder / "model.safetensors")
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["quantization_config"].update(quant)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=message):
        q3.DecoderLayer.from_checkpoint(str(folder), 0)
    assert opened == []


def _set(name, value):
    return lambda t: t.__setitem__(P + name, value(t[P + name]))


@pytest.mark.parametrize("what,change,error,message", [
    ("qweight as float32", _set("self_attn.q_proj.qweight", lambda v: v.float()), UnsupportedDtypeError,
     r"model.safetensors: model.layers.0.self_attn.q_proj.qweight: expected dtype I32, got F32"),
    ("scales as bf16", _set("mlp.experts.2.up_proj.scales", lambda v: v.bfloat16()), UnsupportedDtypeError,
     r"model.layers.0.mlp.experts.2.up_proj.scales: expected dtype F16, got BF16"),
    ("qzeros cut short", _set("self_attn.v_proj.qzeros", lambda v: v[:, :4].contiguous()), CheckpointError,
     r"model.layers.0.self_attn.v_proj.qzeros: expected shape \[2, 16\] \(of the layer's geometry, 4-bit GPTQ\), "
     r"got \[2, 4\]"),
    ("g_idx of another length", _set("mlp.experts.0.down_proj.g_idx", lambda v: v[:64].contiguous()),
     CheckpointError, r"model.layers.0.mlp.experts.0.down_proj.g_idx: expected shape \[128\] .* got \[64\]"),
    ("a g_idx missing", lambda t: t.pop(P + "mlp.experts.4.gate_proj.g_idx"), CheckpointError,
     r"missing model.layers.0.mlp.experts.4.gate_proj.g_idx \(a 4-bit matrix's qweight, qzeros, scales and g_idx: "
     r"config.json declares a GPTQ quantization_config\)"),
    ("a dense matrix instead", lambda t: t.update({P + "self_attn.o_proj.weight": torch.zeros(256, 256)}) or [
        t.pop(P + f"self_attn.o_proj.{n}") for n in ("qweight", "qzeros", "scales", "g_idx")], CheckpointError,
     r"missing model.layers.0.self_attn.o_proj.qweight"),
    ("a float64 router", _set("mlp.gate.weight", lambda v: v.double()), UnsupportedDtypeError,
     r"mlp.gate.weight: expected dtype BF16, F32 or F16, got F64"),
])
def test_a_tensor_of_another_dtype_shape_or_name_is_refused_naming_the_file(tmp_path, opened, what, change, error,
                                                                             message):
    _, path = gptq_checkpoint(tmp_path / "bad", seed=5, change=change)
    with pytest.raises(error, match=message):
        q3.DecoderLayer.from_checkpoint(path, 0)
    assert opened and all(s.mm.closed for s in opened), what


@pytest.mark.parametrize("what,change,message", [
    ("g_idx out of range", _set("self_attn.k_proj.g_idx", lambda v: v.index_fill(0, torch.tensor([7]), 2)),
     r"self_attn.k_proj.g_idx: expected groups in \[0, 2\), got 2 at input 7"),
    ("a NaN scale", _set("mlp.experts.1.down_proj.scales", lambda v: v.index_fill(1, torch.tensor([3]), float("nan"))),
     r"mlp.experts.1.down_proj.scales: expected finite scales, got NaN at \[0, 3\]"),
    ("an Inf scale", _set("self_attn.q_proj.scales", lambda v: v.index_fill(0, torch.tensor([1]), float("inf"))),
     r"self_attn.q_proj.scales: expected finite scales, got Inf at \[1, 0\]"),
])
def test_values_a_file_may_hold_are_checked_before_the_layer_is_made(tmp_path, what, change, message):
    _, path = gptq_checkpoint(tmp_path / "bad", seed=6, change=change)
    with pytest.raises(ValueError, match=message):
        q3.DecoderLayer.from_checkpoint(path, 0)


@pytest.mark.parametrize("rule", [{"dynamic": {r"-:model\.layers\.0\.self_attn\..*": {}}},
                                  {"modules_to_not_convert": ["lm_head", "self_attn", "mlp.gate"]}])
def test_a_checkpoint_of_4_bit_experts_and_dense_attention_is_read_as_it_says(tmp_path, opened, rule):
    """q/k/v/o_proj stored dense ("<module>.weight"), as checkpoints quantized to their experts
    store them, and config.json's rule saying so: borrowed from the mapping and equal to
    transformers on the dequantized experts; the same tensors under a config that says the
    attention is 4-bit: the missing qweight named before the layer is made"""
    model, path = gptq_checkpoint(tmp_path / "ck", seed=4, quant=rule, dense_attention=True)
    layer = q3.DecoderLayer.from_checkpoint(path, 0)
    assert layer.weight_format == "gptq_int4" and layer.converted == ()
    assert "self_attn.q_proj.weight" in layer.weight_ptrs and "self_attn.q_proj.qweight" not in layer.weight_ptrs
    for name, ptr in layer.weight_ptrs.items():
        assert mapped(layer, ptr), name
    assert prefill_then_decode_error(layer, model, 9, seed=2) <= 1e-5
    del layer
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["quantization_config"] = dict(QC)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(CheckpointError, match=r"self_attn.q_proj.qweight"):
        q3.DecoderLayer.from_checkpoint(path, 0)
