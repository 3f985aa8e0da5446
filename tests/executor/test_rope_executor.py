"""Layers with a linear and a YaRN RoPE on the emulated CUDA device (the real qk_rope_kv.cu on
the SIMT executor) against the CPU layer, at positions far past the YaRN original window of 16:
two sequences' chunked prefill (one starting after 3 tokens of left padding), plain decode
steps and decode-graph replays. In a subprocess of its own (conftest.py); the RoPE scalings on
the CPU: tests/layer/test_rope_scaling.py."""
import pytest
import torch

import qwen3layer as q3
from executor_arrays import cpu_rounds_like_tensor_cores, executor_view, host, rel
from qwen3layer import _C

pytestmark = pytest.mark.executor_subprocess
TIMEOUT = 600
GEOMETRY = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=48, rope_theta=1e4, max_position_embeddings=128)
ROPES = {
    "linear x4": dict(rope_type="linear", rope_factor=4.0),
    "yarn x8 of 16": dict(rope_type="yarn", rope_factor=8.0, rope_original_max_position_embeddings=16),
    "yarn x4 untruncated, mscale": dict(rope_type="yarn", rope_factor=4.0, rope_original_max_position_embeddings=16,
                                        rope_truncate=False, rope_mscale=0.8, rope_mscale_all_dim=0.5),
}


def compare(cfg, dtype):
    w = _C.random_weights(cfg, 5, dtype)
    cpu, gpu = _C.Layer(cfg, w, None, -1), _C.Layer(cfg, w, None, 0)
    cc, cg = cpu.new_cache(96, 2), gpu.new_cache(96, 2)
    for c in (cc, cg):
        c.set_padding(3, 1)
    x = _C.random_tensor((2, 70, 64), 6, dtype)
    errs = [rel(host(gpu.prefill(_C.copy_tensor(x, 0), cg, None, 32)), host(cpu.prefill(x, cc, None, 32)))]
    for t in range(2):
        s = _C.random_tensor((2, 64), 7 + t, dtype)
        errs.append(rel(host(gpu.decode(_C.copy_tensor(s, 0), cg)), host(cpu.decode(s, cc))))
    graph = gpu.decode_graph(cg)
    for t in range(2):
        s = _C.random_tensor((2, 64), 9 + t, dtype)
        errs.append(rel(host(graph.replay(_C.copy_tensor(s, 0))), host(cpu.decode(s, cc))))
    keys = max(rel(executor_view(cg.keys(b)), torch.from_dlpack(cc.keys(b)).double().numpy()) for b in range(2))
    return {"max rel err": max(errs), "keys rel err": keys, "lengths": [list(cg.lengths), list(cc.lengths)]}


def bf16_keys_bound() -> float:
    """the bound on the bf16 keys against the CPU layer's: the tensor cores' k_proj takes x
    rounded to bf16, as the CPU's bf16 paths (avx512bf16, amx) do (2e-3); the fp32 paths keep x
    in fp32, a difference of x's own rounding (2.34e-3 measured on an AMD EPYC's avx2): 4e-3"""
    return 2e-3 if cpu_rounds_like_tensor_cores() else 4e-3


def test_emulated_cuda_layer_matches_the_cpu_layer():
    """qk_rope_kv.cu with linear and YaRN tables on the SIMT executor: chunked prefill of two
    sequences (one left-padded), decode steps and decode-graph replays at positions up to 73,
    past the original 16, against the CPU layer; keys included."""
    out = {}
    for name, rope in ROPES.items():
        cfg = q3.LayerConfig(**GEOMETRY, **rope)
        for dtype in ("float32", "bfloat16", "float16"):
            out[f"{name} {dtype}"] = compare(cfg, dtype)
    assert len(out) == 9
    for case, r in out.items():
        dtype = case.rsplit(" ", 1)[1]
        # fp16: fp32 sums on both sides, an fp16 rounding apart at most (test_cuda_executor_float16.py)
        tol = {"float32": 1e-5, "bfloat16": 5e-3, "float16": 1e-3}[dtype]
        assert r["max rel err"] <= tol, case
        assert r["keys rel err"] <= (bf16_keys_bound() if dtype == "bfloat16" else tol), case
        assert r["lengths"] == [[74, 74], [74, 74]], case
