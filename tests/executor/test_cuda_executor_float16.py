"""float16 on a CUDA layer (the SIMT executor's): the CUDA kernels take float32 and bfloat16
only, so every way of bringing fp16 to the device is refused by name before anything is made
or run, and the same calls on the CPU compute (tests/layer/test_parity_hf.py holds their
numbers). In a subprocess of its own (conftest.py)."""
import pytest
import torch

import qwen3layer as q3

pytestmark = pytest.mark.executor_subprocess
CFG = q3.LayerConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=24,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48)
ON_CPU_ONLY = r"float16 layer runs on the CPU only \(the CUDA kernels take float32 and bfloat16\), got float16 " \
              r"weights for device=0"


def test_a_random_float16_layer_on_the_device_is_refused():
    with pytest.raises(TypeError, match="dtype: a " + ON_CPU_ONLY):
        q3.DecoderLayer.random(CFG, dtype="float16", device="cuda")


def test_float16_weights_for_a_device_layer_are_refused_and_run_on_the_cpu():
    host = q3.DecoderLayer.random(CFG, seed=3, dtype="float16")
    weights = {name: torch.from_dlpack(t) for name, t in q3._C.random_weights(CFG, 3, "float16").items()}
    assert all(t.dtype == torch.float16 for t in weights.values())
    with pytest.raises(TypeError, match="dtype: a " + ON_CPU_ONLY):
        q3.DecoderLayer(CFG, weights, device="cuda")
    x = torch.from_dlpack(host.random_input((2, CFG.hidden_size), 1))
    assert x.dtype == torch.float16
    assert torch.equal(q3.DecoderLayer(CFG, weights).prefill(x, host.new_cache(4)), host.prefill(x, host.new_cache(4)))


def test_a_float16_cache_on_the_device_is_refused():
    layer = q3.DecoderLayer.random(CFG, seed=1, dtype="bfloat16", device="cuda")
    with pytest.raises(TypeError, match=r"dtype: a float16 KV cache is held on the CPU only .*got device=0"):
        layer.new_cache(8, dtype="float16")
    assert layer.new_cache(8).dtype == "bfloat16"


def test_a_float16_input_on_the_device_is_refused_before_the_cache_moves():
    layer = q3.DecoderLayer.random(CFG, seed=1, dtype="bfloat16", device="cuda")
    cache = layer.new_cache(8)
    x = q3.cuda.to_device(torch.zeros(1, CFG.hidden_size, dtype=torch.float16))
    with pytest.raises(TypeError, match=r"x: float16 is taken on the CPU only .*got a float16 tensor on cuda:0"):
        layer.decode(x, cache)
    assert cache.lengths == (0,)
