"""FP8 layers (weight_format fp8_e4m3_block128) against references: a float64 run of
transformers' layer on the dequantized weights (fp32 layers to 1e-5; bf16 layers within twice
the error of transformers' own bf16 layer on the same weights), and transformers loading the
same FP8 checkpoint (it dequantizes it on the CPU). Checkpoints are written here, from tiny
random models, with torch's float8_e4m3fn."""
import pytest
import torch
from transformers import Qwen3MoeForCausalLM

import qwen3layer as q3
import qwen3layer.testing
from fp8_reference import ALIGNED, ODD, quantize_model, random_model, write_checkpoint
from hf_reference import converted, draw_input, rel_err, run

BEST = q3.build_info()["cpu_paths"][-1]
SCALES = {"f32_scales": torch.float32, "bf16_scales": torch.bfloat16}


@pytest.fixture(autouse=True, params=sorted({"portable", BEST}))
def cpu_path(request):
    """Every test runs on the portable C kernels and on the best path of this CPU."""
    q3.set_cpu_path(request.param)
    yield request.param
    q3.set_cpu_path(BEST)


def fp8_checkpoint(tmp_path, geometry, seed, scale_dtype, dtype=torch.float32):
    """(path, fp32 model holding the checkpoint's dequantized weights): norms and router of
    `dtype` in the file, and in the model rounded to it"""
    model = random_model(geometry, seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    tensors = quantize_model(model, scale_dtype)
    tensors = {k: v if v.dtype == torch.float8_e4m3fn or k.endswith("_scale_inv") else v.to(dtype)
               for k, v in tensors.items()}
    return write_checkpoint(tmp_path / "fp8", model, tensors), model


@pytest.mark.parametrize("scales", sorted(SCALES))
def test_float32_fp8_layer_matches_float64_on_the_dequantized_weights(tmp_path, scales):
    """Odd geometry (a partial 128-block in every matrix): prefill of two sequences, then a
    decode step each, against fp64 over all the positions."""
    path, model = fp8_checkpoint(tmp_path, ODD, 1, SCALES[scales])
    H, S = ODD["hidden_size"], 13
    x = draw_input(model, (2, S + 1, H), seed=1)
    exact = run(converted(model, torch.float64), x.double())
    layer = q3.DecoderLayer.from_checkpoint(path, 0)
    assert layer.weight_format == "fp8_e4m3_block128" and layer.dtype == "float32" and layer.converted == ()
    cache = layer.new_cache(32, batch=2)
    y = layer.prefill(x[:, :S].contiguous(), cache)
    y_dec = layer.decode(x[:, S].contiguous(), cache)
    assert rel_err(y, exact.y[:, :S]) <= 1e-5
    assert rel_err(y - x[:, :S], exact.y[:, :S] - x[:, :S].double()) <= 1e-5  # the layer's own update
    assert rel_err(y_dec, exact.y[:, S]) <= 1e-5
    for b in range(2):
        assert rel_err(torch.from_dlpack(cache.keys(b)), exact.keys[b]) <= 1e-5
        assert rel_err(torch.from_dlpack(cache.values(b)), exact.values[b]) <= 1e-5


@pytest.mark.parametrize("scales", sorted(SCALES))
def test_bfloat16_fp8_layer_error_at_most_twice_transformers(tmp_path, scales):
    """bf16 activations, norms and router: judged with transformers' bf16 layer (the
    dequantized weights rounded to bf16, as its CPU dequantize makes them) against fp64 on
    the dequantized weights."""
    path, model = fp8_checkpoint(tmp_path, ODD, 2, SCALES[scales], torch.bfloat16)
    H, S = ODD["hidden_size"], 17
    x = draw_input(model, (1, S + 1, H), seed=2, dtype=torch.bfloat16)
    layer = q3.DecoderLayer.from_checkpoint(path, 0)
    assert layer.dtype == "bfloat16" and layer.converted == ()
    # a prefill of S tokens, a decode step; the reference: the fp32 model's copies in bf16 and fp64
    q3.testing.assert_matches(layer, model.model.layers[0], x, torch.bfloat16, calls=(S, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformers_loading_the_same_fp8_checkpoint(tmp_path, dtype):
    """transformers reads the FP8 checkpoint on the CPU by dequantizing it to `dtype`; our
    layer reads the same file's FP8 bytes. (ALIGNED geometry: transformers' dequantize takes
    the block size from the scale grid, right only where each dimension is a multiple of 128
    or below 128; the partial blocks of other sizes are checked against fp64 above.)"""
    path, model = fp8_checkpoint(tmp_path, ALIGNED, 3, torch.float32, dtype)
    hf = Qwen3MoeForCausalLM.from_pretrained(path, dtype=dtype).eval()
    assert hf.model.layers[0].self_attn.q_proj.weight.dtype == dtype
    H, S = ALIGNED["hidden_size"], 11
    x = draw_input(model, (1, S + 1, H), seed=3, dtype=dtype)
    layer = q3.DecoderLayer.from_checkpoint(path, 0)
    assert layer.weight_format == "fp8_e4m3_block128" and layer.dtype == str(dtype).split(".")[1]
    if dtype == torch.float32:
        cache = layer.new_cache(16)
        y = torch.cat([layer.prefill(x[0, :S], cache), layer.decode(x[0, S:], cache)])
        theirs = run(hf, x)
        assert torch.equal(hf.model.layers[0].self_attn.q_proj.weight, model.model.layers[0].self_attn.q_proj.weight)
        assert rel_err(y, theirs.y[0]) <= 1e-5
        assert rel_err(torch.from_dlpack(cache.keys()), theirs.keys[0]) <= 1e-5
    else:
        # transformers' bf16 weights are the dequantized ones rounded: the wide run is fp64 on the exact ones
        exact = converted(model, torch.float64).model.layers[0]
        q3.testing.assert_matches(layer, hf.model.layers[0], x, torch.bfloat16, wide=exact, calls=(S, 1))
