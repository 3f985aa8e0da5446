"""The layer against transformers' Qwen3MoeDecoderLayer (eager attention): outputs and
cache contents, float32, bfloat16 and float16, several geometries."""
import pytest
import torch

import qwen3layer as q3
import qwen3layer.testing
from hf_reference import GEOMETRIES, converted, draw_input, hf_model, rel_err, run

GEOS = sorted(GEOMETRIES)
_PATHS = q3.build_info()["cpu_paths"]
BEST = _PATHS[-1]


@pytest.fixture(autouse=True, params=sorted({"portable", BEST}))
def cpu_path(request):
    """Every parity test runs on the portable C kernels and on the best path of this CPU."""
    q3.set_cpu_path(request.param)
    yield request.param
    q3.set_cpu_path(BEST)


@pytest.mark.parametrize("geometry", GEOS)
def test_float32_prefill_matches_transformers(geometry):
    model = hf_model(geometry, seed=1)
    S = 23
    x = draw_input(model, (1, S, model.config.hidden_size), seed=1)
    ref = run(model, x)
    layer = q3.DecoderLayer.from_hf(model.model.layers[0])
    assert layer.dtype == "float32" and layer.converted == ()
    cache = layer.new_cache(64)
    y = layer.prefill(x[0], cache)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32 and y.shape == (S, x.shape[-1])
    assert rel_err(y, ref.y[0]) <= 1e-5
    # the layer's own contribution, not hidden by the residual
    assert rel_err(y - x[0], ref.y[0] - x[0]) <= 1e-5
    assert cache.lengths == (S,)
    assert rel_err(torch.from_dlpack(cache.keys()), ref.keys[0]) <= 1e-5
    assert rel_err(torch.from_dlpack(cache.values()), ref.values[0]) <= 1e-5


@pytest.mark.parametrize("geometry", GEOS)
def test_float32_batched_prefill_then_decode_matches_transformers(geometry):
    """Two sequences, then one decode step each, against transformers with its own cache."""
    model = hf_model(geometry, seed=2)
    H, S = model.config.hidden_size, 11
    x = draw_input(model, (2, S + 1, H), seed=2)
    full = run(model, x)  # margin and reference over all S + 1 positions
    layer = q3.DecoderLayer.from_hf(model.model.layers[0])
    cache = layer.new_cache(32, batch=2)
    y = layer.prefill(x[:, :S].contiguous(), cache)
    y_dec = layer.decode(x[:, S].contiguous(), cache)
    assert y.shape == (2, S, H) and y_dec.shape == (2, H)
    assert rel_err(y, full.y[:, :S]) <= 1e-5
    assert rel_err(y_dec, full.y[:, S]) <= 1e-5
    assert cache.lengths == (S + 1, S + 1)
    for b in range(2):
        assert rel_err(torch.from_dlpack(cache.keys(b)), full.keys[b]) <= 1e-5
        assert rel_err(torch.from_dlpack(cache.values(b)), full.values[b]) <= 1e-5


@pytest.mark.parametrize("geometry", GEOS)
def test_float32_prefill_of_small_hidden_states_matches_transformers(geometry):
    """Hidden states of N(0, 1e-6) entries: their mean square is the size of rms_norm_eps
    (1e-6), so where eps goes in the input RMSNorm shows (x / sqrt(mean(x^2) + eps); with eps
    outside the root the normalised rows are about 40% too large). At N(0, 1) eps is lost
    in the rounding of mean(x^2) and any placement passes. Keys come straight from the
    input norm; the output and the layer's own update y - x through attention and the MoE."""
    model = hf_model(geometry, seed=6)
    S = 17
    x = draw_input(model, (1, S, model.config.hidden_size), seed=6, scale=1e-3)
    ref = run(model, x)
    layer = q3.DecoderLayer.from_hf(model.model.layers[0])
    cache = layer.new_cache(32)
    y = layer.prefill(x[0], cache)
    assert rel_err(y, ref.y[0]) <= 1e-5
    assert rel_err(y - x[0], ref.y[0] - x[0]) <= 1e-5
    assert rel_err(torch.from_dlpack(cache.keys()), ref.keys[0]) <= 1e-5
    assert rel_err(torch.from_dlpack(cache.values()), ref.values[0]) <= 1e-5


def test_float32_per_expert_names_match_fused():
    """transformers 5.x holds the experts fused, 4.57 one by one: both spellings give one
    result (whichever the installed version has, the test builds the other)."""
    model = hf_model("gqa4_topk_norm", seed=3)
    sd = {k: v.detach() for k, v in model.model.layers[0].state_dict().items()}
    I, E = model.config.moe_intermediate_size, model.config.num_experts
    if "mlp.experts.gate_up_proj" in sd:  # fused -> per expert, with the checkpoint prefix
        gate_up, down = sd.pop("mlp.experts.gate_up_proj"), sd.pop("mlp.experts.down_proj")
        for e in range(E):
            sd[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :I]
            sd[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = gate_up[e, I:]
            sd[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = down[e]
        check = ("mlp.experts.1.up_proj.weight", gate_up[1, I:].data_ptr())
    else:  # per expert -> fused
        sd["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([sd.pop(f"mlp.experts.{e}.gate_proj.weight"),
                                                                 sd.pop(f"mlp.experts.{e}.up_proj.weight")])
                                                      for e in range(E)])
        sd["mlp.experts.down_proj"] = torch.stack([sd.pop(f"mlp.experts.{e}.down_proj.weight") for e in range(E)])
        check = ("mlp.experts.gate_up_proj", sd["mlp.experts.gate_up_proj"].data_ptr())
    cfg = q3.LayerConfig.from_hf(model.config)
    layer = q3.DecoderLayer(cfg, sd)
    assert layer.converted == ()
    assert layer.weight_ptrs[check[0]] == check[1]
    x = draw_input(model, (1, 9, cfg.hidden_size), seed=3)
    y = layer.prefill(x[0], layer.new_cache(16))
    assert rel_err(y, run(model, x).y[0]) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("geometry", GEOS)
def test_half_precision_error_at_most_twice_transformers(geometry, dtype):
    """bf16 or fp16 weights and input; each implementation judged against an fp64 run of the
    same (bf16- or fp16-valued) weights and input: the output, the cached keys and values
    (qwen3layer.testing's rule). The layer borrows the weights and keeps its cache in that
    dtype; a float16 layer sums in fp32 on every path"""
    model = hf_model(geometry, seed=4)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    H, S = model.config.hidden_size, 19
    x = draw_input(model, (1, S, H), seed=4, dtype=dtype)
    hf_half = converted(model, dtype)
    layer = q3.DecoderLayer.from_hf(hf_half.model.layers[0])
    name = str(dtype).removeprefix("torch.")
    assert layer.dtype == name and layer.converted == ()
    assert layer.weight_ptrs["self_attn.q_proj.weight"] == hf_half.model.layers[0].self_attn.q_proj.weight.data_ptr()
    cache = layer.new_cache(32)
    assert cache.dtype == name and layer.prefill(x[0], cache).dtype == dtype
    result = q3.testing.assert_matches(layer, hf_half.model.layers[0], x, dtype)
    assert [o.name for o in result.outputs] == ["y", "keys", "values"] and result.wide_dtype == torch.float64

def test_bfloat16_layer_takes_float32_activations():
    """A bf16 layer with float32 input computes the same, returns float32."""
    model = hf_model("gqa4_topk_norm", seed=5)
    hf_bf16 = converted(model, torch.bfloat16)
    layer = q3.DecoderLayer.from_hf(hf_bf16.model.layers[0])
    x = draw_input(model, (1, 7, 64), seed=5, dtype=torch.bfloat16)[0]
    y16 = layer.prefill(x, layer.new_cache(8))
    y32 = layer.prefill(x.float(), layer.new_cache(8))
    assert y32.dtype == torch.float32
    assert torch.equal(y32.bfloat16(), y16)


def test_float16_layer_takes_float32_activations():
    """A float16 layer with float32 input computes the same, returns float32; a bf16 input
    returns bf16 of the same sums"""
    model = hf_model("gqa4_topk_norm", seed=5)
    layer = q3.DecoderLayer.from_hf(converted(model, torch.float16).model.layers[0])
    x = draw_input(model, (1, 7, 64), seed=5, dtype=torch.float16)[0]
    y16 = layer.prefill(x, layer.new_cache(8))
    y32 = layer.prefill(x.float(), layer.new_cache(8))
    assert y32.dtype == torch.float32 and y16.dtype == torch.float16
    assert torch.equal(y32.half(), y16)
