"""The cost model against the hand counts, the stage profile's structure, and the main job
on a tiny geometry. (Nothing here asserts a timing.)"""
import os
import subprocess
import sys

import pytest

import qwen3layer as q3
from qwen3layer.analysis.costs import STAGES, decode_bytes, decode_weight_bytes

REAL = q3.LayerConfig.qwen3_235b_a22b()
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def test_decode_token_touches_the_hand_counted_weight_bytes():
    m = q3.cost_model(REAL, "decode", tokens=1)
    assert m.weight_bytes == 445_661_696
    assert m.stage("qkv_proj").weight_bytes + m.stage("o_proj").weight_bytes == 142_606_336
    assert m.stage("experts").weight_bytes == 8 * 3 * 4096 * 1536 * 2


def test_fp8_decode_token_touches_the_hand_counted_weight_bytes():
    # e4m3 matrices: attention (8192 + 512 + 512) x 4096 + 4096 x 8192 = 71,303,168 B and 8 experts
    # x 3 x 1536 x 4096 = 150,994,944 B; router 128 x 4096 bf16 = 1,048,576 B; norms (4096 + 4096 +
    # 128 + 128) bf16 = 16,896 B; fp32 scales: attention 64x32 + 4x32 + 4x32 + 32x64 = 4,352, experts
    # 8 x (12x32 + 12x32 + 32x12) = 9,216, 13,568 x 4 B = 54,272 B
    m = q3.cost_model(REAL, "decode", tokens=1, weight_format="fp8_e4m3_block128")
    assert m.weight_bytes == 71_303_168 + 150_994_944 + 1_048_576 + 16_896 + 54_272 == 223_417_856
    assert m.stage("qkv_proj").weight_bytes + m.stage("o_proj").weight_bytes == 71_303_168 + 4_352 * 4
    assert m.stage("experts").weight_bytes == 150_994_944 + 9_216 * 4
    assert m.stage("router").weight_bytes == 1_048_576
    assert q3.cost_model(REAL, "decode", tokens=1, weight_format="fp8_e4m3_block128",
                         scale_dtype="bfloat16").weight_bytes == 223_417_856 - 13_568 * 2
    assert decode_weight_bytes(REAL, "bfloat16", "fp8_e4m3_block128") == 223_417_856
    # the KV cache stays in dtype: decode_bytes adds the same cache to both formats
    assert (decode_bytes(REAL, 512, "bfloat16") - decode_bytes(REAL, 512, "bfloat16", "fp8_e4m3_block128")
            == 445_661_696 - 223_417_856)
    # flops do not depend on how the weights are stored
    assert m.flops == q3.cost_model(REAL, "decode", tokens=1).flops


@pytest.mark.parametrize("weight_format", ["dense", "fp8_e4m3_block128"])
def test_a_pass_hitting_every_expert_reads_the_engines_weight_bytes(weight_format):
    # odd sizes: partial 128-blocks on every matrix, and the gate/up split inside one
    cfg = q3.LayerConfig(hidden_size=200, num_attention_heads=4, num_key_value_heads=2, head_dim=48,
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=130)
    layer = q3.DecoderLayer.random(cfg, seed=1, dtype="bfloat16", weight_format=weight_format)
    m = q3.cost_model(cfg, "prefill", tokens=256, weight_format=weight_format)
    assert m.weight_bytes == layer.weight_bytes
    assert layer._core.scale_dtype == (None if weight_format == "dense" else "float32")
    p = layer.profile("decode", tokens=2, context=3, repeat=1)
    assert p.cost.weight_bytes == q3.cost_model(cfg, "decode", 2, 3, weight_format=weight_format).weight_bytes


def test_prefill_of_8192_tokens_is_the_hand_counted_flops():
    m = q3.cost_model(REAL, "prefill", tokens=8192)
    assert round(m.flops / 1e12, 3) == 4.750
    assert round((m.stage("qkv_proj").flops + m.stage("o_proj").flops) / 1e12, 3) == 1.168
    assert round(m.stage("router").flops / 1e12, 3) == 0.009
    assert round(m.stage("experts").flops / 1e12, 3) == 2.474
    assert round(m.stage("attention").flops / 1e12, 3) == 1.100
    assert [s.name for s in m.stages] == list(STAGES)


def test_chunks_change_the_bytes_not_the_flops():
    whole = q3.cost_model(REAL, "prefill", tokens=8192)
    chunked = q3.cost_model(REAL, "prefill", tokens=8192, chunk_size=2048)
    assert chunked.passes == 4 and chunked.flops == pytest.approx(whole.flops, rel=1e-12)
    # every chunk of 2048 tokens hits all 128 experts: four passes read the weights four times
    assert chunked.weight_bytes == pytest.approx(4 * whole.weight_bytes, rel=1e-6)
    assert q3.cost_model(REAL, "decode", tokens=4, context=100).passes == 4


@pytest.mark.parametrize("kwargs,msg", [(dict(mode="train"), "mode: expected 'prefill' or 'decode', got 'train'"),
                                        (dict(tokens=0), "tokens: expected a positive int, got 0"),
                                        (dict(context=-1), "context: expected a non-negative int, got -1"),
                                        (dict(chunk_size=0), "chunk_size: expected a positive int or None, got 0"),
                                        (dict(dtype="int8"), "dtype: expected 'float32', 'bfloat16' or 'float16', got 'int8'"),
                                        (dict(weight_format="fp8"), "weight_format: expected one of"),
                                        (dict(scale_dtype="float16"),
                                         "scale_dtype: expected 'float32' or 'bfloat16', got 'float16'")])
def test_cost_model_rejects_bad_arguments(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        q3.cost_model(REAL, **({"mode": "decode"} | kwargs))


def test_cost_model_stage_names_the_stages_for_an_unknown_name():
    m = q3.cost_model(REAL, "decode")
    assert m.stage("router") is m.stages[STAGES.index("router")]
    with pytest.raises(ValueError, match=r"name: expected one of \['io', .*'experts'\], got 'expert'"):
        m.stage("expert")


def test_profile_times_every_stage_of_the_cost_model():
    layer = q3.DecoderLayer.random(q3.LayerConfig.tiny(), dtype="float32")
    for mode, tokens in (("prefill", 40), ("decode", 3)):
        p = layer.profile(mode, tokens=tokens, context=9, chunk_size=16, repeat=2)
        assert [s.name for s in p.stages] == list(STAGES)
        assert all(s.seconds >= 0 for s in p.stages)
        assert p.stage_seconds > 0 and p.call_seconds > 0
        assert sum(s.share for s in p.stages) == pytest.approx(1.0)
        assert p.cost.tokens == tokens and p.cache_bytes > 0
        assert "dominant" in p.table()


def test_profile_models_the_passes_the_layer_runs_without_a_chunk_size():
    """prefill with chunk_size=None runs passes of build_info()['default_chunk'] tokens; the
    profile's model counts those passes (it modelled the whole call as one before)"""
    layer = q3.DecoderLayer.random(q3.LayerConfig.tiny(), dtype="float32")
    chunk = q3.build_info()["default_chunk"]
    p = layer.profile("prefill", tokens=chunk + 40, repeat=1)
    assert (p.cost.passes, p.cost.chunk_size) == (2, chunk)
    assert p.cost.flops == q3.cost_model(layer.config, "prefill", chunk + 40, 0, chunk, "float32").flops


@pytest.mark.parametrize("batch", [1, 2])
def test_profile_hides_the_fraction_of_the_context_asked(batch):
    """hidden_keys: the context's prefill hides that fraction of its tokens (spread evenly) from
    the timed calls; the profile reports what the C cache holds hidden, a sequence"""
    layer = q3.DecoderLayer.random(q3.LayerConfig.tiny(), dtype="float32")
    p = layer.profile("decode", tokens=2, context=600, repeat=1, batch=batch, hidden_keys=0.25)
    assert p.hidden_keys == 150 and "context 600 (150 hidden)" in p.table()
    assert layer.profile("decode", tokens=1, context=9, repeat=1).hidden_keys == 0
    for bad in (1.0, -0.1, True, "0.5"):
        with pytest.raises(ValueError, match=r"hidden_keys: expected a fraction of the context in \[0, 1\), got"):
            layer.profile("decode", context=9, hidden_keys=bad)


def test_map_measures_masked_attention(tmp_path):
    r = run_cli("map", "--geometry", "tiny", "--tokens", "16", "--context", "64", "--hidden-keys", "0.5",
                "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "context 64 (32 hidden)" in r.stdout and "attention, masked against unmasked:" in r.stdout
    r = run_cli("map", "--geometry", "tiny", "--hidden-keys", "1")
    assert r.returncode == 2 and "--hidden-keys: expected a fraction of the context in [0, 1), got '1'" in r.stderr


def test_main_job_runs_on_a_tiny_geometry():
    r = subprocess.run([sys.executable, "-m", "qwen3layer", "run", "--geometry", "tiny", "--tokens", "40",
                        "--chunk-size", "16", "--new-tokens", "3"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "prefill  40 tokens in chunks of 16" in r.stdout
    assert "the map, prefill of 40 tokens in 3 chunk(s) of 16" in r.stdout
    assert "the map, decode: 3 steps from context 40" in r.stdout
    assert "40/40 tokens" in r.stderr  # the progress line


def test_main_job_rejects_bad_options():
    r = subprocess.run([sys.executable, "-m", "qwen3layer", "run", "--tokens", "0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--tokens: expected a positive int, got 0" in r.stderr


def run_cli(*args, env=None, timeout=180):
    return subprocess.run([sys.executable, "-m", "qwen3layer", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_map_writes_svg_png_and_the_sweep(tmp_path):
    r = run_cli("map", "--geometry", "tiny", "--tokens", "48", "--chunk-size", "16", "--sweep-chunk", "8,48",
                "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    for name in ("map.svg", "map.png", "sweep.svg", "sweep.png"):
        assert (tmp_path / name).stat().st_size > 1000, name
    assert (tmp_path / "map.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in (tmp_path / "map.svg").read_bytes()[:1000]
    assert "prefill: 48 token(s)" in r.stdout and "decode: 1 token(s)" in r.stdout
    assert "chunk size | prefill s" in r.stdout


def test_map_of_4_bit_weights(tmp_path):
    """map --int4: the gptq_int4 layer's stages (a geometry whose matrices the group divides)"""
    cfg = tmp_path / "config.json"
    cfg.write_text('{"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, '
                   '"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128}')
    r = run_cli("map", "--geometry", str(cfg), "--int4", "--tokens", "32", "--chunk-size", "16", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "4-bit GPTQ weights (RTN)" in r.stdout and (tmp_path / "map.svg").stat().st_size > 1000
    r = run_cli("map", "--geometry", str(cfg), "--int4", "--expert-device", "cpu", "--gpu-experts", "2")
    assert r.returncode == 2 and "the split's prediction is of dense weights in this version (no --fp8, --int4)" \
        in r.stderr


TINY_CHECK = ("check", "--geometry", "tiny", "--tokens", "64", "--chunk-size", "16", "--context", "40",
              "--latency-factor", "1e6", "--json")  # a tiny layer is overhead, not memory: latency is not its ruler


def test_check_passes_and_speaks_json():
    import json

    r = run_cli(*TINY_CHECK)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["pass"] is True
    assert [x["name"] for x in out["rulers"]] == ["accuracy against transformers", "decode latency", "prefill memory"]
    assert all(x["passed"] for x in out["rulers"])


def test_the_latency_ruler_is_not_judged_below_one_calls_overhead():
    """the tiny layer's floor (a few microseconds) is below one call's overhead: not judged,
    saying why, and check exits 0; a threshold above the overhead is judged"""
    from qwen3layer.analysis import rulers

    layer = q3.DecoderLayer.random(q3.LayerConfig.tiny(), seed=0, dtype="bfloat16")
    r = rulers.decode_latency(layer.config, layer, "bfloat16", 40, 1.33)
    assert r.passed is None and r.value > r.threshold
    assert "not judged: the threshold is below one call's overhead" in r.detail
    assert r.line().startswith("NOT RUN decode latency: ")
    assert rulers.decode_latency(layer.config, layer, "bfloat16", 40, 1e6).passed is True
    out = run_cli(*TINY_CHECK[:-3])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "NOT RUN decode latency" in out.stdout and "FAIL" not in out.stdout


def test_check_fails_when_a_weight_is_perturbed():
    import json

    r = run_cli(*TINY_CHECK, "--perturb", "self_attn.o_proj.weight")
    assert r.returncode == 1
    out = json.loads(r.stdout)
    assert out["pass"] is False and out["rulers"][0]["passed"] is False


def test_check_without_transformers_says_so(tmp_path):
    shim = tmp_path / "transformers"
    shim.mkdir()
    (shim / "__init__.py").write_text("raise ImportError('transformers is hidden for this test')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    r = run_cli(*TINY_CHECK[:-1], env=env)
    assert r.returncode == 0, r.stderr
    assert "NOT RUN accuracy against transformers: transformers and torch are needed" in r.stdout
    assert "Traceback" not in r.stderr


def test_main_job_runs_on_random_fp8_weights():
    r = run_cli("run", "--geometry", "tiny", "--fp8", "--tokens", "40", "--chunk-size", "16", "--new-tokens", "3")
    assert r.returncode == 0, r.stderr
    assert "random FP8 (fp8_e4m3_block128) matrices and bfloat16 norms and router" in r.stdout
    assert "weights fp8_e4m3_block128" in r.stdout  # the layer's repr
    assert "MB of FP8 weights and scales per token" in r.stdout
    assert "the map, decode: 3 steps from context 40" in r.stdout


def test_main_job_runs_on_random_int4_weights(tmp_path):
    """--int4: random 4-bit GPTQ weights (a geometry of 128-multiple inputs, from a config.json)"""
    import json
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 256, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2,
                               "moe_intermediate_size": 128, "norm_topk_prob": True}))
    r = run_cli("run", "--geometry", str(cfg), "--int4", "--tokens", "40", "--chunk-size", "20", "--new-tokens", "3")
    assert r.returncode == 0, r.stderr
    assert "random 4-bit GPTQ (RTN) (gptq_int4) matrices and bfloat16 norms and router" in r.stdout
    assert "weights gptq_int4" in r.stdout  # the layer's repr
    assert "MB of 4-bit weights, scales, zeros and g_idx per token" in r.stdout
    r = run_cli("run", "--int4", "--fp8")
    assert r.returncode == 2 and "--fp8, --int4: one weight format, got both" in r.stderr
    r = run_cli("run", "--int4", "--checkpoint", str(tmp_path))
    assert r.returncode == 2 and "--int4: random weights only" in r.stderr


def test_the_weight_format_by_its_api_name(tmp_path):
    """--weight-format gptq_int4 is --int4 and fp8_e4m3_block128 is --fp8 (DecoderLayer.random's names), in
    run, map, check and write-checkpoint; beside another format flag or a checkpoint it is refused by name"""
    import json
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 256, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2,
                               "moe_intermediate_size": 128, "norm_topk_prob": True}))
    r = run_cli("run", "--geometry", str(cfg), "--weight-format", "gptq_int4", "--tokens", "40", "--chunk-size", "20",
                "--new-tokens", "3")
    assert r.returncode == 0, r.stderr
    assert "weights gptq_int4" in r.stdout
    r = run_cli("write-checkpoint", str(tmp_path / "ck"), "--geometry", str(cfg), "--weight-format", "gptq_int4")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["quantization_config"]["bits"] == 4
    r = run_cli("run", "--weight-format", "gptq_int4", "--fp8")
    assert r.returncode == 2 and "--weight-format gptq_int4, --fp8: one weight format, got both" in r.stderr
    r = run_cli("map", "--weight-format", "dense", "--int4")
    assert r.returncode == 2 and "--weight-format dense, --int4: one weight format, got both" in r.stderr
    r = run_cli("check", "--weight-format", "fp8_e4m3_block128", "--int4")
    assert r.returncode == 2 and "--weight-format fp8_e4m3_block128, --int4: one weight format, got both" in r.stderr
    r = run_cli("run", "--weight-format", "fp8_e4m3_block128", "--checkpoint", str(tmp_path))
    assert r.returncode == 2 and "--weight-format fp8_e4m3_block128: random weights only" in r.stderr
    r = run_cli("run", "--weight-format", "int4")
    assert r.returncode == 2 and "invalid choice: 'int4'" in r.stderr


def test_main_job_fp8_is_for_random_weights_only(tmp_path):
    r = run_cli("run", "--fp8", "--checkpoint", str(tmp_path))
    assert r.returncode == 2
    assert "--fp8: random weights only (a checkpoint's weights keep their own format)" in r.stderr


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_check_fp8_measures_against_the_dequantized_weights(dtype):
    import json

    r = run_cli(*TINY_CHECK, "--fp8", "--dtype", dtype)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["pass"] is True and out["weight_format"] == "fp8_e4m3_block128"
    assert "FP8 weights against their dequantization" in out["rulers"][0]["detail"]
    assert all(x["passed"] for x in out["rulers"])


def test_check_fp8_fails_when_a_scale_is_perturbed():
    import json

    r = run_cli(*TINY_CHECK, "--fp8", "--perturb", "self_attn.o_proj.weight_scale_inv")
    assert r.returncode == 1
    assert json.loads(r.stdout)["rulers"][0]["passed"] is False
    r = run_cli(*TINY_CHECK, "--fp8", "--perturb", "self_attn.o_proj.weight")
    assert r.returncode != 0 and "self_attn.o_proj.weight is an FP8 matrix" in r.stderr


G8 = ('{"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_experts": 8, '
      '"num_experts_per_tok": 2, "moe_intermediate_size": 128}')  # every matrix a multiple of the 128 group


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_check_int4_measures_against_the_dequantized_weights(dtype, tmp_path):
    """check --int4: transformers' layer on the matrices dequantized in C (_C.dequantize_int4),
    the experts stacked into its fused tensors; a perturbed router fails the ruler, a 4-bit
    tensor cannot be perturbed"""
    import json

    (tmp_path / "g.json").write_text(G8)
    check = ("check", "--geometry", str(tmp_path / "g.json"), *TINY_CHECK[3:], "--int4", "--dtype", dtype)
    r = run_cli(*check)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["pass"] is True and out["weight_format"] == "gptq_int4"
    assert "4-bit weights against their dequantization" in out["rulers"][0]["detail"]
    r = run_cli(*check, "--perturb", "mlp.gate.weight")
    assert r.returncode == 1 and json.loads(r.stdout)["rulers"][0]["passed"] is False
    r = run_cli(*check, "--perturb", "self_attn.o_proj.scales")
    assert r.returncode != 0 and "self_attn.o_proj.scales is a 4-bit matrix's float16 tensor" in r.stderr


def test_cli_names_a_device_it_cannot_use():
    r = run_cli("run", "--geometry", "tiny", "--device", "tpu")
    assert r.returncode == 2
    assert "python -m qwen3layer run: device: expected 'cpu', 'cuda' or 'cuda:N', got 'tpu'" in r.stderr
    assert "Traceback" not in r.stderr
