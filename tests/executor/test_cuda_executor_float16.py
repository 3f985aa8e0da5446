"""float16 layers on a CUDA device (the SIMT executor's), against the CPU float16 layer on the same
weights: fp16 weights, activations and KV cache, every product and sum in fp32 on both (the CUDA
kernels widen fp16 exactly and round their fp16 stores to nearest even, as kernels/dtype.h), so
the two agree to within an fp16 rounding where their fp32 sums land on either side of one. fp16
takes the SIMT kernels (the GEMV, the block-per-token and split-KV attention), never the tensor
cores or cuBLAS, which would round it to bf16. In a subprocess of its own (conftest.py)."""
import numpy as np
import pytest
import torch

import qwen3layer as q3
from executor_arrays import compare_layers, executor_view, host, rel
from qwen3layer import _C

pytestmark = pytest.mark.executor_subprocess
TIMEOUT = 600
CFG = q3.LayerConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=24,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48)
H = CFG.hidden_size
# an output of fp16 where one element's two fp32 sums round apart: 2^-11 of it; the norm over
# all of them is far below (measured: 8.4e-7)
TOL = 1e-3


def cache_rel(gpu_cache, cpu_cache, batch):
    """the largest relative difference of the device cache's keys and values from the CPU's"""
    errs = []
    for b in range(batch):
        for get in ("keys", "values"):
            got = executor_view(getattr(gpu_cache, get)(b))
            want = torch.from_dlpack(getattr(cpu_cache, get)(b)).double().numpy()
            errs.append(rel(got, want))
    return max(errs)


def test_a_float16_layer_on_the_device_matches_the_cpu_layer():
    """_C.Layer on fp16 weights uploaded to the device: prefill of 2 sequences in chunks of 5,
    16 and whole, decode steps, decode-graph replays and a batch of 1, against the CPU layer"""
    w = _C.random_weights(CFG, 3, "float16")
    cpu, gpu = _C.Layer(CFG, w, None, -1), _C.Layer(CFG, w, None, 0)
    assert len(gpu.converted) == 11  # host weights copied once, as fp16 (not converted)
    errs, lengths = compare_layers(cpu, gpu, H, "float16", 5)
    assert max(errs) <= TOL and lengths, errs


def test_left_padding_chunks_and_the_cache_agree_with_the_cpu_layer():
    """a batch of 2, the second sequence after 3 tokens of left padding, a prefill of 21 tokens
    in chunks of 8 and 3 decode steps: the outputs (fp16, on the device) and the cache's keys and
    values (fp16, after RoPE: positions counted past the padding) against the CPU layer's"""
    w = _C.random_weights(CFG, 7, "float16")
    cpu, gpu = _C.Layer(CFG, w, None, -1), _C.Layer(CFG, w, None, 0)
    cc, cg = cpu.new_cache(32, 2), gpu.new_cache(32, 2)
    for c in (cc, cg):
        c.set_padding(3, 1)
    assert cg.dtype == "float16"
    x = _C.random_tensor((2, 21, H), 4, "float16")
    y = gpu.prefill(_C.copy_tensor(x, 0), cg, None, 8)
    assert (y.dtype, str(y.device)) == ("float16", "cuda:0")
    errs = [rel(host(y), host(cpu.prefill(x, cc, None, 8)))]
    for t in range(3):
        s = _C.random_tensor((2, H), 10 + t, "float16")
        errs.append(rel(host(gpu.decode(_C.copy_tensor(s, 0), cg)), host(cpu.decode(s, cc))))
    assert max(errs) <= TOL, errs
    assert list(cg.lengths) == list(cc.lengths) == [24, 24]
    assert cache_rel(cg, cc, 2) <= TOL


def test_the_python_layer_random_and_from_fp16_weights_on_the_device():
    """DecoderLayer.random(dtype="float16", device="cuda") is the CPU's random layer of the same
    seed, and DecoderLayer(CFG, fp16 torch weights, device="cuda") the CPU layer on them"""
    dev = q3.DecoderLayer.random(CFG, seed=3, dtype="float16", device="cuda")
    cpu = q3.DecoderLayer.random(CFG, seed=3, dtype="float16")
    x_dev, x = dev.random_input((2, 6, H), 1), cpu.random_input((2, 6, H), 1)
    assert (x_dev.dtype, str(x_dev.device)) == ("float16", "cuda:0")
    assert np.array_equal(host(x_dev), host(x))
    assert rel(host(dev.prefill(x_dev, dev.new_cache(8, 2))), host(cpu.prefill(x, cpu.new_cache(8, 2)))) <= TOL

    weights = {name: torch.from_dlpack(t) for name, t in _C.random_weights(CFG, 3, "float16").items()}
    assert all(t.dtype == torch.float16 for t in weights.values())
    layer = q3.DecoderLayer(CFG, weights, device="cuda")
    host_layer = q3.DecoderLayer(CFG, weights)
    xs = torch.from_dlpack(host_layer.random_input((3, H), 2))
    got = layer.prefill(q3.cuda.to_device(xs), layer.new_cache(4))
    assert got.dtype == "float16"
    assert rel(host(got), host_layer.prefill(xs, host_layer.new_cache(4)).double().numpy()) <= TOL


@pytest.mark.parametrize("layer_dtype", ["bfloat16", "float32"])
def test_a_float16_cache_and_inputs_for_another_layer_dtype_on_the_device(layer_dtype):
    """a device cache of float16 under a bf16 or fp32 layer, fed fp16 inputs: the keys and values
    stored as fp16 and attention reading them, as the CPU layer does with the same cache dtype"""
    w = _C.random_weights(CFG, 9, layer_dtype)
    cpu, gpu = _C.Layer(CFG, w, None, -1), _C.Layer(CFG, w, None, 0)
    cc, cg = cpu.new_cache(16, 2, "float16"), gpu.new_cache(16, 2, "float16")
    assert (cg.dtype, cc.dtype) == ("float16", "float16")
    x = _C.random_tensor((2, 9, H), 5, "float16")
    errs = [rel(host(gpu.prefill(_C.copy_tensor(x, 0), cg, None, 4)), host(cpu.prefill(x, cc, None, 4)))]
    s = _C.random_tensor((2, H), 6, "float16")
    errs.append(rel(host(gpu.decode(_C.copy_tensor(s, 0), cg)), host(cpu.decode(s, cc))))
    # bf16: the CPU's bf16 paths round activations to bf16 before their dot products, the CUDA path
    # does not (test_cuda_executor.py's tolerance)
    tol = 5e-3 if layer_dtype == "bfloat16" else TOL
    assert max(errs) <= tol, errs
    assert cache_rel(cg, cc, 2) <= tol
    assert list(cg.lengths) == [10, 10]
