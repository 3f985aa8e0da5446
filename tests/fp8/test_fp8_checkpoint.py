"""FP8 checkpoints through DecoderLayer.from_checkpoint: the e4m3 matrices and their scales
borrowed from the mapping (nothing dequantized at load), and every bad FP8 checkpoint refused
with a clear error naming the file and tensor (or config.json and the field), no layer made
and the mappings closed."""
import json
import os

import pytest
import torch

import qwen3layer as q3
from fp8_reference import ODD, QUANT, dense_tensors, quantize_model, random_model, write_checkpoint
from qwen3layer.checkpoint import CheckpointError, UnsupportedDtypeError

Q = "model.layers.0.self_attn.q_proj.weight"        # [192, 200]: scale [2, 2]
DOWN = "model.layers.0.mlp.experts.3.down_proj.weight"  # [200, 136]: scale [2, 2]


@pytest.fixture(scope="module")
def base():
    """(model, {name: tensor}) of a 1-layer FP8 model of odd geometry, fp32 scales"""
    model = random_model(ODD, 0)
    return model, quantize_model(model)


def write(tmp_path, base, change=None, quant=None):
    model, tensors = base
    tensors = dict(tensors)
    if change:
        change(tensors)
    return write_checkpoint(tmp_path / "ckpt", model, tensors, quant)


def mapped(layer, ptr):
    starts = [(q3._C.buffer_view(mm, 0, (1,), "float32").data_ptr, len(mm)) for mm in layer._mappings]
    return any(a <= ptr < a + n for a, n in starts)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_an_fp8_checkpoint_is_borrowed_from_the_mapping(tmp_path, scale_dtype):
    model = random_model(ODD, 4)
    tensors = quantize_model(model, scale_dtype)
    layer = q3.DecoderLayer.from_checkpoint(write_checkpoint(tmp_path, model, tensors), 0)
    assert layer.weight_format == "fp8_e4m3_block128" and layer.converted == ()
    assert "fp8_e4m3_block128" in repr(layer)
    ptrs = layer.weight_ptrs
    assert Q + "_scale_inv" not in ptrs and "self_attn.q_proj.weight_scale_inv" in ptrs
    for name, ptr in ptrs.items():  # matrices, scales, norms, router: all read from the file
        assert mapped(layer, ptr), name
    own = {k: v for k, v in tensors.items() if k.startswith("model.layers.0.")}
    assert layer.weight_bytes == sum(v.numel() * v.element_size() for v in own.values())
    assert sum(v.numel() for k, v in own.items() if v.dtype == torch.float8_e4m3fn) == \
        2 * 192 * 200 + 2 * 96 * 200 + 6 * 3 * 136 * 200  # q, o; k, v; 6 experts x 3 matrices


def test_a_dense_checkpoint_with_a_null_quantization_config_is_dense(tmp_path):
    model = random_model(ODD, 5)
    path = write_checkpoint(tmp_path, model, dense_tensors(model), None)
    cfg = json.loads(open(os.path.join(path, "config.json")).read())
    cfg["quantization_config"] = None
    open(os.path.join(path, "config.json"), "w").write(json.dumps(cfg))
    layer = q3.DecoderLayer.from_checkpoint(path, 0)
    assert layer.weight_format == "dense" and layer.converted == ()


def drop(name):
    return lambda t: t.pop(name)


def replace(name, value):
    return lambda t: t.__setitem__(name, value(t[name]))


TENSOR_ERRORS = {
    # case: (change to the tensors, error type, message fragment)
    "a matrix without its scale": (drop(Q + "_scale_inv"), CheckpointError,
                                   rf"missing {Q}_scale_inv \(the block scales of an FP8 matrix"),
    "an expert without its scale": (drop(DOWN + "_scale_inv"), CheckpointError, rf"missing {DOWN}_scale_inv"),
    "a scale of the wrong shape": (replace(Q + "_scale_inv", lambda s: s[:1].contiguous()), CheckpointError,
                                   rf"{Q}_scale_inv: expected shape \[2, 2\] \(one scale per 128 x 128 block of "
                                   r"the \[192, 200\] matrix\), got \[1, 2\]"),
    "a scale per 64 x 64 block": (replace(DOWN + "_scale_inv", lambda s: s.repeat_interleave(2, 0).repeat_interleave(
        2, 1)[:4, :3].contiguous()), CheckpointError, rf"{DOWN}_scale_inv: expected shape \[2, 2\].*got \[4, 3\]"),
    "an F8_E5M2 matrix": (replace(Q, lambda w: w.float().to(torch.float8_e5m2)), UnsupportedDtypeError,
                          rf"{Q}: expected dtype F8_E4M3, got F8_E5M2 \(of the FP8 formats only e4m3"),
    "a bf16 matrix": (replace(DOWN, lambda w: w.float().bfloat16()), UnsupportedDtypeError,
                      rf"{DOWN}: expected dtype F8_E4M3, got BF16"),
    "an F16 scale": (replace(Q + "_scale_inv", lambda s: s.half()), UnsupportedDtypeError,
                     rf"{Q}_scale_inv: expected dtype BF16 or F32, got F16"),
    "an FP8 norm": (replace("model.layers.0.input_layernorm.weight", lambda w: w.to(torch.float8_e4m3fn)),
                    UnsupportedDtypeError, "input_layernorm.weight: expected dtype BF16, F32 or F16, got F8_E4M3"),
}


@pytest.mark.parametrize("case", sorted(TENSOR_ERRORS))
def test_a_bad_fp8_tensor_is_refused_naming_it(tmp_path, base, opened, case):
    change, kind, match = TENSOR_ERRORS[case]
    path = write(tmp_path, base, change)
    with pytest.raises(kind, match=match) as e:
        q3.DecoderLayer.from_checkpoint(path, 0)
    if "missing" not in match:
        assert os.path.join(path, "model.safetensors") in str(e.value)
    assert opened and all(s.mm.closed for s in opened)


CONFIG_ERRORS = {
    # case: (quantization_config, message fragment after "config.json: quantization_config.")
    "fmt e5m2": (QUANT | {"fmt": "e5m2"}, r"fmt: expected 'e4m3', got 'e5m2'"),
    "64 x 64 blocks": (QUANT | {"weight_block_size": [64, 64]}, r"weight_block_size: expected \[128, 128\], "
                       r"got \[64, 64\] \(only 128 x 128"),
    "128 x 64 blocks": (QUANT | {"weight_block_size": [128, 64]}, r"got \[128, 64\]"),
    "one scale per matrix": (QUANT | {"weight_block_size": None}, r"weight_block_size: expected \[128, 128\], got None"),
    "another method": ({"quant_method": "awq", "bits": 4}, r"quant_method: expected 'fp8', got 'awq'"),
    "gptq": ({"quant_method": "gptq", "bits": 3}, r"quantization_config.bits: expected 4, got 3 \(only 4-bit GPTQ "
             r"weights are read\)"),
    "static activations": (QUANT | {"activation_scheme": "static"}, r"activation_scheme: expected 'dynamic', got "
                           r"'static' \(static activation scales are not supported"),
    "ue8m0 scales": (QUANT | {"scale_fmt": "ue8m0"}, r"scale_fmt: expected 'float', got 'ue8m0'"),
    "fp4 experts": (QUANT | {"expert_dtype": "fp4"}, r"expert_dtype: expected 'fp8', got 'fp4'"),
    "a projection not converted": (QUANT | {"modules_to_not_convert": ["lm_head", "self_attn.o_proj"]},
                                   r"modules_to_not_convert: 'self_attn.o_proj' keeps model.layers.0.self_attn.o_proj "
                                   "unquantized"),
    "the layer's experts not converted": (QUANT | {"ignored_layers": ["model.layers.0.mlp"]},
                                          r"ignored_layers: 'model.layers.0.mlp' keeps model.layers.0.mlp.experts "),
    "not an object": ([1, 2], r"expected an object, got \[1, 2\]"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_ERRORS))
def test_an_fp8_config_this_layer_cannot_read_is_refused_naming_the_field(tmp_path, base, opened, case):
    quant, match = CONFIG_ERRORS[case]
    path = write(tmp_path, base, quant=quant)
    with pytest.raises(CheckpointError, match=match) as e:
        q3.DecoderLayer.from_checkpoint(path, 0)
    if case != "not an object":
        assert str(e.value).startswith(os.path.join(path, "config.json") + ": quantization_config.")
    assert not opened  # refused before any shard is opened


def test_modules_not_converted_elsewhere_are_fine(tmp_path, base):
    quant = QUANT | {"modules_to_not_convert": ["lm_head", "model.embed_tokens", "model.layers.1", "mlp.gate"]}
    layer = q3.DecoderLayer.from_checkpoint(write(tmp_path, base, quant=quant), 0)
    assert layer.weight_format == "fp8_e4m3_block128"


def test_modules_to_not_convert_is_read_by_transformers_rule_alone(tmp_path, base):
    """FP8 checkpoints have one loader, transformers': a name within a module's that is not its
    name, a parent or a tail ("self_attn", "experts.3") keeps nothing unquantized, and the layer
    is FP8 throughout (a GPTQ config reads such names as dense: tests/io/test_gptq_checkpoint.py)"""
    quant = QUANT | {"modules_to_not_convert": ["self_attn", "experts.3"]}
    layer = q3.DecoderLayer.from_checkpoint(write(tmp_path, base, quant=quant), 0)
    assert layer.weight_format == "fp8_e4m3_block128"


def test_transformers_own_config_without_fmt_is_e4m3(tmp_path, base):
    from transformers import FineGrainedFP8Config

    quant = FineGrainedFP8Config().to_dict()
    assert "fmt" not in quant and quant["weight_block_size"] in ([128, 128], (128, 128))
    quant["weight_block_size"] = list(quant["weight_block_size"])
    layer = q3.DecoderLayer.from_checkpoint(write(tmp_path, base, quant=quant), 0)
    assert layer.weight_format == "fp8_e4m3_block128"


def test_fp8_tensors_in_a_checkpoint_without_quantization_config(tmp_path, base, opened):
    path = write(tmp_path, base)
    cfg = json.loads(open(os.path.join(path, "config.json")).read())
    del cfg["quantization_config"]
    open(os.path.join(path, "config.json"), "w").write(json.dumps(cfg))
    with pytest.raises(UnsupportedDtypeError, match=rf"{Q}: expected dtype BF16, F32 or F16, got F8_E4M3 \(an FP8 tensor "
                       "where config.json declares no FP8 quantization_config"):
        q3.DecoderLayer.from_checkpoint(path, 0)
    assert all(s.mm.closed for s in opened)


def test_an_fp8_matrix_the_engine_refuses_leaves_no_layer_and_closes_the_mapping(tmp_path, base, opened):
    """q_proj transposed with its scale: consistent for the loader, the wrong shape for the
    layer's geometry (the engine's check)"""
    def transpose(t):
        t[Q] = t[Q].t().contiguous()
        t[Q + "_scale_inv"] = t[Q + "_scale_inv"].t().contiguous()

    path = write(tmp_path, base, transpose)
    with pytest.raises(ValueError, match=r"self_attn.q_proj.weight'\]: expected shape \[192, 200\], got \[200, 192\]"):
        q3.DecoderLayer.from_checkpoint(path, 0)
    assert opened and all(s.mm.closed for s in opened)
