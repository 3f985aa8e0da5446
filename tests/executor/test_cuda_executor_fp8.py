"""FP8 layers (weight_format fp8_e4m3_block128) on the SIMT executor against the CPU FP8 layer
on the same weights, in a subprocess of its own (conftest.py): per case, the largest relative
error over its calls and whether the cache lengths agree.

Two geometries: hidden 320, moe_inter 160 (16-byte vector loads, partial 128-blocks, shapes
the tensor cores take) and hidden 200, moe_inter 130 (K % 16 != 0: one element a lane; not
for tensor cores). For each: fp32 and bf16 layers, with fp32 scales and experts per expert, and
with bf16 scales and experts fused (transformers 5.x); prefill of 2 sequences in chunks of 5, 16 and all 40 tokens
(bf16: the last two on tensor cores, experts dequantized one at a time), each followed by
two decode steps of both sequences (after the last, two replays of a decode graph); and a prompt of 7 tokens with two decode steps of batch 1."""
import ctypes

import numpy as np
import pytest
import torch

import qwen3layer as q3
from dlpack_ctypes import DELETER, DLDataType, DLDevice, DLManagedTensor, DLTensor, capsule_new
from executor_arrays import compare_layers, host
from fp8_weights import fp8_weights
from qwen3layer import _C

pytestmark = pytest.mark.executor_subprocess
TIMEOUT = 900
GEOMETRIES = {
    "h320": q3.LayerConfig(hidden_size=320, num_attention_heads=4, num_key_value_heads=2, head_dim=48,
                           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=160),
    "h200": q3.LayerConfig(hidden_size=200, num_attention_heads=4, num_key_value_heads=2, head_dim=40,
                           num_experts=6, num_experts_per_tok=2, moe_intermediate_size=130),
}


def run_case(cfg, dtype, scale_dtype, fused, seed):
    w = fp8_weights(cfg, dtype, scale_dtype, fused, seed)
    cpu = _C.Layer(cfg, w, None, -1, "fp8_e4m3_block128")
    gpu = _C.Layer(cfg, w, None, 0, "fp8_e4m3_block128")
    errs, lengths = compare_layers(cpu, gpu, cfg.hidden_size, dtype, seed)
    return {"max rel err": max(errs), "lengths agree": lengths, "format": gpu.weight_format,
            "uploaded": len(gpu.converted), "weight bytes equal": gpu.weight_bytes == cpu.weight_bytes}


# device weights borrowed: a ctypes DLPack producer over executor device memory (host memory
# there) at an offset; 16-byte aligned FP8 matrices are borrowed (nothing converted), one at
# + 8 bytes is copied once to an aligned block and named in `converted`, with the same outputs
DL_TYPES = {torch.bfloat16: (4, 16), torch.float32: (2, 32), torch.float8_e4m3fn: (10, 8)}


class DeviceProducer:
    """a contiguous DLPack producer on cuda:0 over a copy of host tensor t in executor device
    memory at byte_offset into a fresh block"""

    def __init__(self, t, byte_offset):
        raw = t.contiguous().view(-1).view(torch.uint8).numpy()
        self.block = _C.copy_tensor(_C.random_tensor((raw.nbytes // 2 + 16,), 0, "bfloat16"), 0)
        self.data_ptr = self.block.data_ptr + byte_offset
        ctypes.memmove(self.data_ptr, raw.ctypes.data, raw.nbytes)
        self.shape = (ctypes.c_int64 * t.dim())(*t.shape)
        self.deleter = DELETER(lambda _: None)
        self.managed = DLManagedTensor(DLTensor(self.data_ptr, DLDevice(2, 0), t.dim(), DLDataType(*DL_TYPES[t.dtype], 1),
                                                self.shape, None, 0), None, self.deleter)

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, **kw):
        return capsule_new(ctypes.addressof(self.managed), b"dltensor", None)


def borrowed_case(cfg, seed):
    w = fp8_weights(cfg, "bfloat16", torch.bfloat16, True, seed)
    aligned = {k: DeviceProducer(v, 0) for k, v in w.items()}
    odd = dict(aligned, **{"self_attn.o_proj.weight": DeviceProducer(w["self_attn.o_proj.weight"], 8)})
    a = _C.Layer(cfg, aligned, None, 0, "fp8_e4m3_block128")
    b = _C.Layer(cfg, odd, None, 0, "fp8_e4m3_block128")
    x = _C.random_tensor((1, 20, cfg.hidden_size), seed, "bfloat16")
    ya = host(a.prefill(_C.copy_tensor(x, 0), a.new_cache(24)))
    yb = host(b.prefill(_C.copy_tensor(x, 0), b.new_cache(24)))
    found = {"aligned converted": list(a.converted), "odd converted": list(b.converted),
             "outputs equal": bool(np.array_equal(ya, yb))}
    del a, b  # the layers release their views while the producers (and their deleters) live
    return found


def test_fp8_layers_on_the_executor_match_the_cpu_fp8_layer():
    """FP8 layers (e4m3 weights with 128 x 128 block scales) on the emulated device against the
    CPU FP8 layer on the same weights: prefill in chunks of 5, 16 and 40 tokens of 2 sequences,
    decode steps of 2 sequences (plain, and replays of a decode graph) and of 1, at hidden 320 / moe_inter 160 (16-byte FP8 loads,
    partial scale blocks) and 200 / 130 (one element a lane), fp32 and bf16 scales, experts per
    expert and fused. fp32 layers stream FP8 everywhere (the GEMV, the grouped decode
    experts): as exact as the CPU's up to summation order. bf16 layers' prefill dequantizes to
    bf16 for the tensor cores, which round the activations and the dequantized weights to
    bf16 where the CPU keeps fp32 products: the dense bf16 layer's tolerance. fp16 layers (fp16
    norms, router and activations) stream FP8 at every size as fp32 ones do: within an fp16
    rounding of the outputs."""
    cases = {}
    seed = 30
    # each geometry: fp32, bf16 and fp16 layers, each with fp32 scales and per-expert weights and
    # with bf16 scales and fused experts
    for geo, cfg in GEOMETRIES.items():
        for dtype in ("float32", "bfloat16", "float16"):
            for scale_dtype, fused in ((torch.float32, False), (torch.bfloat16, True)):
                name = f"{geo} {dtype} scales {str(scale_dtype)[6:]} {'fused' if fused else 'per expert'}"
                cases[name] = run_case(cfg, dtype, scale_dtype, fused, seed)
                seed += 1
    assert len(cases) == 12
    for name, c in cases.items():
        tol = {"float32": 1e-5, "bfloat16": 5e-3, "float16": 1e-3}[name.split()[1]]  # the layer dtype
        assert c["max rel err"] <= tol and c["lengths agree"], (name, c)
        assert c["format"] == "fp8_e4m3_block128" and c["weight bytes equal"], (name, c)
        # host weights are uploaded once each: 4 attention matrices and their scales, 4 norms,
        # the router; the experts' matrices and scales (2 fused tensors and their scales, or
        # 3 of each per expert)
        E = 8 if "h320" in name else 6
        assert c["uploaded"] == 13 + (4 if "fused" in name else 6 * E), (name, c)


def test_fp8_device_weights_are_borrowed_and_misaligned_ones_copied_once():
    """Device float8_e4m3fn matrices at 16-byte aligned addresses are borrowed (nothing in
    `converted`); one at + 8 bytes is copied once to an aligned block and named there, and the
    layer's outputs are bitwise those of the aligned one."""
    b = borrowed_case(GEOMETRIES["h320"], 50)
    assert b["aligned converted"] == [] and b["odd converted"] == ["self_attn.o_proj.weight"]
    assert b["outputs equal"]
