"""GPTQ int4 layers (weight_format gptq_int4) on the SIMT executor against the CPU int4 layer on
the same weights, in a subprocess of its own (conftest.py): per case, the largest relative error
over its calls, as test_cuda_executor_fp8.py judges the FP8 layers, and whether the cache
lengths agree.

Two geometries: hidden 256, moe_inter 128 (shapes the tensor cores take, groups of 128 or 64)
and hidden 200, moe_inter 136 (N % 16 != 0 or K % 32 != 0 for every matrix: the GEMV at every
size; groups of 8). fp32 and bf16 layers; "gptq" (v1) and "gptq_v2" zeros; desc_act's g_idx (a
permutation of the groups' inputs: the kernels read g_idx input by input); and q/k/v/o_proj
dense (gptq_dense_attention: the experts alone 4-bit). Each: a prefill of 2 sequences in chunks
of 5 tokens (10 rows: the int4 GEMV), 16 and all 40 (32 and 80 rows; bf16: each matrix
dequantized to bf16 for the tensor cores, an expert's where 16 rows or more chose it), each
followed by two decode steps of both sequences (the GEMV and the grouped int4 experts), after
the last two replays of a decode graph; and a prompt of 7 tokens with two decode steps of one
sequence (executor_arrays.compare_layers, as for FP8). Then the values a file decides, refused on
the device as on the host: the check reads them back."""
import pytest
import torch

import qwen3layer as q3
from executor_arrays import compare_layers
from qwen3layer import _C

pytestmark = pytest.mark.executor_subprocess
TIMEOUT = 300  # seconds; the module takes a few on the project's 2 cores


def geometry(hidden, head_dim, experts, inter):
    """4 query heads on 2 KV heads, top-2 experts"""
    return q3.LayerConfig(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                          num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=inter)


GEOMETRIES = {"h256": geometry(256, 64, 8, 128), "h200": geometry(200, 40, 6, 136)}
# name: (geometry, dtype, engine settings, desc_act)
CASES = {
    "h256 float32 group 128": ("h256", "float32", dict(gptq_group=128), False),
    "h256 bfloat16 group 64 v2 desc_act": ("h256", "bfloat16", dict(gptq_group=64, gptq_v2=True), True),
    "h200 bfloat16 group 8": ("h200", "bfloat16", dict(gptq_group=8), False),
    "h256 float32 dense attention": ("h256", "float32", dict(gptq_group=128, gptq_dense_attention=True), False),
    "h256 bfloat16 dense attention": ("h256", "bfloat16", dict(gptq_group=128, gptq_dense_attention=True), False),
    # fp16 norms, router, activations (and dense attention): the GEMV at every size, no bf16 dequantization
    "h256 float16 group 128": ("h256", "float16", dict(gptq_group=128), False),
    "h200 float16 group 8 dense attention": ("h200", "float16", dict(gptq_group=8, gptq_dense_attention=True), False),
}
# the layer dtype's tolerance: fp16 sums in fp32 on both sides, its outputs an fp16 rounding apart
TOL = {"float32": 1e-5, "bfloat16": 5e-3, "float16": 1e-3}


def int4_weights(cfg, dtype, settings, desc_act, seed):
    """the GPTQ tensors of random_weights; desc_act: each matrix's g_idx permuted (each input's
    group another input's), so that no matrix's g_idx is k / group"""
    w = _C.random_weights(cfg, seed, dtype, "gptq_int4", **settings)
    if desc_act:
        gen = torch.Generator().manual_seed(seed)
        for name in [n for n in w if n.endswith(".g_idx")]:
            g = torch.from_dlpack(w[name])
            g.copy_(g[torch.randperm(g.numel(), generator=gen)])
    return w


def run_case(cfg, dtype, settings, desc_act, seed):
    w = int4_weights(cfg, dtype, settings, desc_act, seed)
    cpu = _C.Layer(cfg, w, None, -1, "gptq_int4", **settings)
    gpu = _C.Layer(cfg, w, None, 0, "gptq_int4", **settings)
    errs, lengths = compare_layers(cpu, gpu, cfg.hidden_size, dtype, seed)
    return {"max rel err": max(errs), "lengths agree": lengths, "format": gpu.weight_format,
            "uploaded": len(gpu.converted), "tensors": len(w), "weight bytes equal": gpu.weight_bytes == cpu.weight_bytes}


def test_int4_layers_on_the_executor_match_the_cpu_int4_layer():
    """GPTQ int4 layers on the emulated device against the CPU int4 layer on the same weights:
    prefill in chunks of 5, 16 and 40 tokens of 2 sequences, decode steps of 2 sequences (plain, and
    replays of a decode graph) and of 1. fp32 layers stream the nibbles everywhere (the GEMV,
    the grouped decode experts): as exact as the CPU's up to summation order. bf16 layers'
    prefill dequantizes to bf16 for the tensor cores, which round the activations and the
    dequantized weights to bf16: the tolerance of the FP8 bf16 layers. fp16 layers stream the
    nibbles at every size as fp32 ones do (tensor cores would round their activations to bf16)."""
    cases = {}
    for seed, (name, (geo, dtype, settings, desc_act)) in enumerate(CASES.items(), start=40):
        cases[name] = run_case(GEOMETRIES[geo], dtype, settings, desc_act, seed)
    assert len(cases) == 7
    for name, c in cases.items():
        assert c["max rel err"] <= TOL[name.split()[1]] and c["lengths agree"], (name, c)
        assert c["format"] == "gptq_int4" and c["weight bytes equal"], (name, c)
        assert c["uploaded"] == c["tensors"], (name, c)  # host weights uploaded once each


@pytest.mark.parametrize("tensor,index,value,message", [
    ("self_attn.k_proj.g_idx", 5, 2, r"self_attn.k_proj.g_idx: expected groups in \[0, 2\), got 2 at input 5"),
    ("mlp.experts.3.down_proj.g_idx", 0, -1, r"mlp.experts.3.down_proj.g_idx: expected groups in \[0, 1\), got -1 at "
                                             r"input 0"),
    ("mlp.experts.1.up_proj.scales", 7, float("nan"), r"mlp.experts.1.up_proj.scales: expected finite scales, got NaN "
                                                      r"at \[0, 7\]"),
])
def test_values_a_file_decides_are_refused_on_the_device_as_on_the_host(tensor, index, value, message):
    """a g_idx out of range or a NaN scale: the device layer reads them back from its device for
    the check and refuses them with the host layer's message, before any work"""
    cfg = GEOMETRIES["h256"]
    w = _C.random_weights(cfg, 3, "float32", "gptq_int4")
    torch.from_dlpack(w[tensor]).view(-1)[index] = value
    for device in (-1, 0):
        with pytest.raises(ValueError, match=message):
            _C.Layer(cfg, w, None, device, "gptq_int4")
