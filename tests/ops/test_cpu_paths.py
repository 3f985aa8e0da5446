"""The CPU kernel paths (portable C, AVX2, AVX-512, AVX512-BF16, AMX) agree with each other,
and the environment variable chooses among them."""
import os
import subprocess
import sys

import pytest
import torch

import qwen3layer as q3

PATHS = q3.build_info()["cpu_paths"]
BEST = PATHS[-1]
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
# shapes that reach every kernel branch: K not a multiple of 32, N not of 16, G = 6, D = 20
CFG = q3.LayerConfig(hidden_size=72, num_attention_heads=12, num_key_value_heads=2, head_dim=20,
                     num_experts=10, num_experts_per_tok=3, moe_intermediate_size=48)


def run_all(layer, x_prefill, x_decode):
    cache = layer.new_cache(96, batch=2)
    outs = [layer.prefill(x_prefill, cache, chunk_size=29)]
    outs += [layer.decode(x, cache) for x in x_decode]
    return outs, [torch.from_dlpack(cache.keys(b)).clone() for b in range(2)]


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(autouse=True)
def restore_path():
    yield
    q3.set_cpu_path(BEST)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-6), ("bfloat16", 5e-3), ("float16", 1e-3)])
def test_every_path_agrees_with_portable(dtype, tol):
    """fp32 weights: every path within fp32 rounding of the portable one. bf16 weights: the
    bf16 paths round activations to bf16 before their dot products (as transformers does), so
    they agree to bf16 rounding; each also passes the parity tests against transformers. fp16
    weights: every path sums in fp32, and the outputs and the cache round those sums to fp16."""
    layer = q3.DecoderLayer.random(CFG, seed=11, dtype=dtype)
    g = torch.Generator().manual_seed(12)
    tdt = getattr(torch, dtype)
    xp = torch.randn(2, 40, CFG.hidden_size, generator=g).to(tdt)
    xd = [torch.randn(2, CFG.hidden_size, generator=g).to(tdt) for _ in range(3)]
    q3.set_cpu_path("portable")
    ref, ref_keys = run_all(layer, xp, xd)
    for path in PATHS:
        q3.set_cpu_path(path)
        assert q3.build_info()["cpu_path"] == path
        outs, keys = run_all(layer, xp, xd)
        for o, r in zip(outs, ref):
            assert rel(o, r) <= tol, (path, rel(o, r))
        for k, r in zip(keys, ref_keys):
            assert rel(k, r) <= tol, (path, rel(k, r))


# Shapes that the AMX kernel takes (kernels/cpu/matmul_amx.c: bf16 weights, a bf16 scratch,
# T >= 4 tokens, N % 16 == 0, K % 32 == 0; anything else goes to the AVX512-BF16 kernel).
# hidden 96 and q 4 x 24 = 96 are multiples of 32; k/v 2 x 24 = 48 is 3 tiles of 16 rows, so
# its last 32-row block is half (na = 1); moe_intermediate 64. Every expert takes every token
# (top-4 of 4), so no top-k choice can flip between AMX (x rounded to bf16) and portable (fp32).
AMX_CFG = q3.LayerConfig(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                         num_experts=4, num_experts_per_tok=4, moe_intermediate_size=64)


@pytest.mark.skipif("amx" not in PATHS, reason="no 'amx' CPU path here: the CPU has no AMX-BF16 tiles "
                    "or Linux did not grant them (build_info()['cpu_paths'])")
def test_amx_path_at_shapes_it_takes_agrees_with_portable():
    """Prefill of 2 sequences x 37 tokens in chunks of 20: passes of 40 and 34 rows, so the
    AMX kernel itself runs (not its AVX512-BF16 fallback) for q/k/v/o (o accumulating into the
    residual) and for each expert's gate, up and down (40 or 34 tokens an expert, experts one
    after the other with the shared bf16 scratch), with 3 token blocks of 16 (a pair, then a
    single, zero-padded), and both full (32) and half (16, k/v) weight-row blocks. The decode
    steps (2 rows, fewer than 4) take the fallback. bf16 weights: AMX rounds x to bf16 as
    transformers does, portable does not, so they agree to bf16 rounding (5e-3, as above)."""
    layer = q3.DecoderLayer.random(AMX_CFG, seed=13, dtype="bfloat16")
    g = torch.Generator().manual_seed(14)
    xp = torch.randn(2, 37, AMX_CFG.hidden_size, generator=g).bfloat16()
    xd = [torch.randn(2, AMX_CFG.hidden_size, generator=g).bfloat16() for _ in range(2)]

    def run(path):
        q3.set_cpu_path(path)
        cache = layer.new_cache(48, batch=2)
        outs = [layer.prefill(xp, cache, chunk_size=20)] + [layer.decode(x, cache) for x in xd]
        return outs, [torch.from_dlpack(cache.keys(b)).clone() for b in range(2)]

    ref, ref_keys = run("portable")
    outs, keys = run("amx")
    for o, r in zip(outs + keys, ref + ref_keys):
        assert rel(o, r) <= 5e-3, rel(o, r)


@pytest.mark.skipif("amx" not in PATHS, reason="no 'amx' CPU path here: the CPU has no AMX-BF16 tiles "
                    "or Linux did not grant them (build_info()['cpu_paths'])")
def test_amx_int4_prefill_is_the_bf16_layer_on_the_dequantized_weights_bit_for_bit():
    """On amx a bf16 GPTQ layer's prefill dequantizes each weight to bf16(s (q - z)) for the
    tiles (kernels/cpu/matmul_int4_amx.c): the weight transformers' bf16 layer holds. So from 16
    tokens a matmul equals the bf16 layer's on those weights bit for bit: 40 tokens in one pass
    (three token blocks) and in chunks of 20 (two), 256 inputs in two panels of 128,
    every expert taking every token (top-4 of 4). Groups of 128 and of 32 (4 groups a block of
    128 inputs transposed at once)."""
    from gptq_reference import gptq_model, random_model
    geometry = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4,
                    num_experts_per_tok=4, moe_intermediate_size=128, norm_topk_prob=True)
    q3.set_cpu_path("amx")
    for group in (128, 32):
        model = random_model(geometry, 3)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        tensors = {k: v.bfloat16() if v.dtype == torch.float32 else v
                   for k, v in gptq_model(model, group=group, seed=3).items()}  # puts the dequantized values in model
        config = q3.LayerConfig.from_hf(model.config)
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": True, "desc_act": False}
        gptq = q3.DecoderLayer(config, tensors, weight_format="gptq_int4", quantization_config=qc)
        dense = q3.DecoderLayer(config, {k: v.bfloat16().contiguous() for k, v in model.model.layers[0].state_dict().items()})
        x = torch.randn(1, 40, 256, generator=torch.Generator().manual_seed(group)).bfloat16()
        for chunk in (40, 20):
            y = gptq.prefill(x, gptq.new_cache(40), chunk_size=chunk)
            want = dense.prefill(x, dense.new_cache(40), chunk_size=chunk)
            assert torch.equal(y, want), (group, chunk, float((y.float() - want.float()).abs().max()))


def test_unknown_or_unavailable_path_is_rejected():
    with pytest.raises(ValueError, match="cpu path: expected one of portable, avx2, avx512, avx512bf16, amx"):
        q3.set_cpu_path("sse9")
    assert q3.build_info()["cpu_path"] == BEST


def import_with(value):
    env = dict(os.environ, QWEN3LAYER_CPU_PATH=value)
    return subprocess.run([sys.executable, "-c", "import qwen3layer; print(qwen3layer.build_info()['cpu_path'])"],
                          cwd=ROOT, env=env, capture_output=True, text=True)


def test_environment_variable_forces_a_path():
    r = import_with("portable")
    assert r.returncode == 0 and r.stdout.strip() == "portable", r.stderr
    r = import_with("bogus")
    assert r.returncode != 0 and "QWEN3LAYER_CPU_PATH: cpu path: expected one of" in r.stderr


def test_probes_measure_something():
    assert q3._C.probe_read_bandwidth(64 << 20, 1) > 0.1
    assert q3._C.probe_fma_peak(0.05) > 0.1


def import_hiding(hide, path=None):
    """qwen3layer imported with QWEN3LAYER_CPU_HIDE (and QWEN3LAYER_CPU_PATH): its path and paths"""
    env = dict(os.environ, QWEN3LAYER_CPU_HIDE=hide)
    env.pop("QWEN3LAYER_CPU_PATH", None)
    if path:
        env["QWEN3LAYER_CPU_PATH"] = path
    code = "import qwen3layer; i = qwen3layer.build_info(); print(i['cpu_path'], ','.join(i['cpu_paths']))"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)


@pytest.mark.skipif("avx512bf16" not in PATHS, reason="this CPU has no avx512bf16 level to be the highest")
def test_the_highest_level_is_the_default():
    """a CPU whose highest level is avx512bf16 (amx absent or hidden) gets it by default; with
    it hidden, avx512; each still there when asked for"""
    r = import_hiding("amx")
    assert r.returncode == 0, r.stderr
    path, paths = r.stdout.split()
    assert path == "avx512bf16" and paths.split(",")[-1] == "avx512bf16", r.stdout
    r = import_hiding("amx,avx512bf16")
    assert r.returncode == 0 and r.stdout.split()[0] == "avx512", r.stdout + r.stderr
    r = import_hiding("amx", path="avx512")
    assert r.returncode == 0 and r.stdout.split()[0] == "avx512", r.stderr


@pytest.mark.skipif("avx2" not in PATHS, reason="no avx2 level on this CPU")
def test_hidden_levels_are_gone():
    r = import_hiding("avx2,avx512,avx512bf16,amx")
    assert r.returncode == 0 and r.stdout.split() == ["portable", "portable"], r.stdout + r.stderr
    r = import_hiding("avx2", path="avx2")
    assert r.returncode != 0 and "'avx2' is compiled but this CPU cannot run it" in r.stderr, r.stderr


@pytest.mark.parametrize("hide", ["sse9", "portable", "avx2,,amx"])
def test_hiding_what_is_not_a_level_fails_the_import(hide):
    r = import_hiding(hide)
    assert r.returncode != 0 and "QWEN3LAYER_CPU_HIDE: cpu paths to hide: expected a comma-separated list" \
        in r.stderr, r.stderr
