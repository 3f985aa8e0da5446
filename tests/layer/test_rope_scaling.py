"""RoPE scaling (linear and YaRN, issue 21) against transformers (4.57 or 5.x): the engine's
table (inv_freq and the cos/sin scale) against rotary_emb's inv_freq and attention_scaling;
the layer against Qwen3MoeDecoderLayer at positions far past the YaRN original window
(prefill, chunked prefill and decode, fp32 and bf16, both CPU paths); and the RoPE variants
and values refused by name. The emulated CUDA layer against the CPU layer:
tests/executor/test_rope_executor.py."""
import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import transformers
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

import qwen3layer as q3
import qwen3layer.testing
from hf_reference import converted, draw_input, rel_err, run
from qwen3layer.config import ROPE_DEFAULTS

V5 = int(transformers.__version__.split(".")[0]) >= 5
transformers.logging.set_verbosity_error()  # the yarn factor / original max ratio warnings

# rope_scaling dicts (both versions take this spelling at construction), each a case of the
# variants' rules: factors above and below 1 and not integers, attention_factor given or
# derived (from factor, or from mscale / mscale_all_dim), truncate off, betas of all kinds,
# original_max_position_embeddings given or left to max_position_embeddings
ROPES = {
    "linear x2": {"rope_type": "linear", "factor": 2.0},
    "linear x8.5": {"rope_type": "linear", "factor": 8.5},
    "linear x3 int, old 'type'": {"type": "linear", "factor": 3},
    "yarn x4 of 64": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn x8 untruncated": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024,
                            "truncate": False},
    "yarn attention_factor": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.3,
                              "original_max_position_embeddings": 512},
    "yarn mscale": {"rope_type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 1.0,
                    "original_max_position_embeddings": 128},
    "yarn betas": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 4.5, "beta_slow": 0.5, "truncate": False,
                   "original_max_position_embeddings": 128},
    "yarn x0.5, no original max": {"rope_type": "yarn", "factor": 0.5},
}
HEAD_DIMS = (16, 24, 128, 256)  # 8 and 12 frequencies: torch's scalar pow; 64 and 128: its vector pow


GEOMETRY = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=4096)


def hf_config(rope: dict, head_dim: int = 24, theta: float = 1e6, max_pos: int = 4096, **kw) -> Qwen3MoeConfig:
    fields = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=head_dim, num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, vocab_size=16,
                  intermediate_size=64, num_hidden_layers=1, max_position_embeddings=max_pos, rope_theta=theta,
                  rope_scaling=dict(rope), rms_norm_eps=1e-6, attn_implementation="eager")
    return Qwen3MoeConfig(**(fields | kw))


def f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def ulp_rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("name", ROPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("theta", (1e4, 1e6))
def test_table_matches_rotary_emb(name, head_dim, theta):
    """The engine's inv_freq and scale against transformers' in this process: the scale
    exactly (its float, rounded to fp32 as torch multiplies cos by it), inv_freq within 2 ulp
    (torch's vectorised pow is Sleef's, 1 ulp off the correctly rounded powf at times, and
    the reciprocal and the YaRN blend carry it; test_table_bit_for_bit_with_torchs_scalar_path
    compares bit for bit)."""
    hc = hf_config(ROPES[name], head_dim, theta)
    emb = Qwen3MoeRotaryEmbedding(hc)
    inv_freq, scale = q3._C.rope_table(q3.LayerConfig.from_hf(hc))
    theirs = emb.inv_freq.tolist()
    assert len(inv_freq) == head_dim // 2
    assert max(ulp_rel(a, b) for a, b in zip(inv_freq, theirs)) <= 2 ** -22
    assert scale == f32(emb.attention_scaling)


# Run with ATEN_CPU_CAPABILITY=default: torch's kernels then loop over std::pow (glibc's powf,
# as the engine), std::cos, and so on: its tables are the engine's bit for bit.
SCALAR_TABLES = """
import json, os, sys
import transformers
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding
sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "..", "helpers"), os.path.join(sys.argv[1], "..", "..")]
# tests/layer/, tests/helpers/ and the checkout (built in place)
transformers.logging.set_verbosity_error()
from test_rope_scaling import hf_config
out = []
for rope, head_dim, theta in json.loads(sys.argv[2]):
    emb = Qwen3MoeRotaryEmbedding(hf_config(rope, head_dim, theta))
    out.append([emb.inv_freq.tolist(), emb.attention_scaling])
print(json.dumps(out))
"""


def test_table_bit_for_bit_with_torchs_scalar_path():
    cases = [(rope, D, theta) for rope in ROPES.values() for D in HEAD_DIMS for theta in (1e4, 1e6)]
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    r = subprocess.run([sys.executable, "-c", SCALAR_TABLES, os.path.dirname(__file__), json.dumps(cases)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    for (rope, D, theta), (theirs, scaling) in zip(cases, json.loads(r.stdout), strict=True):
        inv_freq, scale = q3._C.rope_table(q3.LayerConfig.from_hf(hf_config(rope, D, theta)))
        assert list(inv_freq) == theirs, (rope, D, theta)
        assert scale == f32(scaling)


@pytest.mark.skipif(not V5, reason="4.57 cannot compute a yarn factor of None (it raises)")
def test_yarn_factor_none_is_the_ratio_of_the_lengths_as_in_5x():
    hc = hf_config({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 512}, 128, max_pos=2048)
    cfg = q3.LayerConfig.from_hf(hc)
    assert cfg.rope_factor == 4.0 and cfg.rope_original_max_position_embeddings == 512
    emb = Qwen3MoeRotaryEmbedding(hc)
    inv_freq, scale = q3._C.rope_table(cfg)
    assert max(ulp_rel(a, b) for a, b in zip(inv_freq, emb.inv_freq.tolist())) <= 2 ** -22
    assert scale == f32(emb.attention_scaling)


def test_layer_properties_report_its_table():
    """A layer's rope_inv_freq and rope_attention_scaling: the default RoPE's scale is 1;
    YaRN's derived one 0.1 ln(factor) + 1, in fp32."""
    cfg = q3.LayerConfig.tiny()
    layer = q3.DecoderLayer.random(cfg, seed=1)
    assert layer.rope_inv_freq == q3._C.rope_table(cfg)[0] and len(layer.rope_inv_freq) == cfg.head_dim // 2
    assert layer.rope_attention_scaling == 1.0
    yarn = q3.DecoderLayer.random(dataclasses.replace(cfg, rope_type="yarn", rope_factor=4.0), seed=1)
    assert yarn.rope_attention_scaling == f32(0.1 * math.log(4.0) + 1.0)
    assert yarn.rope_inv_freq[0] == layer.rope_inv_freq[0]  # the fastest dims are extrapolated: unchanged
    assert yarn.rope_inv_freq[-1] < layer.rope_inv_freq[-1]  # the slowest interpolated


@pytest.mark.parametrize("name", ROPES)
def test_layer_config_round_trips_through_transformers(name):
    """hf_rope_kwargs (the accuracy ruler's transformers config) gives back the same RoPE."""
    from qwen3layer.hf_config import hf_rope_kwargs

    cfg = q3.LayerConfig.from_hf(hf_config(ROPES[name]))
    fields = {k: getattr(cfg, k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                           "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                           "norm_topk_prob", "max_position_embeddings")}
    assert q3.LayerConfig.from_hf(Qwen3MoeConfig(**fields, **hf_rope_kwargs(cfg))) == cfg


@pytest.mark.skipif(not V5, reason="the accuracy ruler builds its transformers layer from 5.x's fused expert weights")
def test_the_accuracy_ruler_builds_transformers_with_the_same_rope(tmp_path):
    """`python -m qwen3layer check` on a YaRN config.json: its transformers layer gets the same
    RoPE (40 tokens, 5 times YaRN's original window of 8), so the accuracy ruler passes."""
    cfg = dict(GEOMETRY, rope_theta=1e4, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                       "original_max_position_embeddings": 8})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, "-m", "qwen3layer", "check", "--geometry", str(path), "--tokens", "64",
                        "--chunk-size", "16", "--context", "40", "--latency-factor", "1e6", "--accuracy-tokens", "40",
                        "--json"], cwd=os.path.join(os.path.dirname(__file__), "..", ".."), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    accuracy = json.loads(r.stdout)["rulers"][0]
    assert accuracy["name"] == "accuracy against transformers" and accuracy["passed"], accuracy


# ---- the layer against transformers ----------------------------------------------------

PARITY = {
    "linear x4": {"rope_type": "linear", "factor": 4.0},
    "yarn x4 of 64": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn x8 of 64, untruncated, mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                                           "truncate": False, "mscale": 0.9, "mscale_all_dim": 0.6},
}
S, PREFILL, CHUNKED = 201, 120, 76  # positions 0..200: a prefill, a chunked prefill, 5 decode steps


def rope_model(rope: dict, seed: int, **kw) -> Qwen3MoeForCausalLM:
    """A tiny model (head_dim 32, theta 1e4: every dim turns over 200 positions), its
    attention weights N(0, 0.15^2) and the rest as hf_reference's (norms N(1, 0.04))."""
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(hf_config(rope, head_dim=32, theta=1e4, max_pos=256, **kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15 if "self_attn" in name else p.shape[-1] ** -0.5)
    return model


def run_layer(layer: q3.DecoderLayer, x: torch.Tensor):
    """x [B, S, H] through a fresh cache: a prefill of PREFILL tokens, CHUNKED more in chunks of
    32, then one decode step per remaining token; the outputs [B, S, H] and the cache"""
    B = x.shape[0]
    cache = layer.new_cache(256, batch=B)
    seq = lambda t: t if B > 1 else t[0]  # noqa: E731
    ys = [layer.prefill(seq(x[:, :PREFILL].contiguous()), cache).reshape(B, PREFILL, -1),
          layer.prefill(seq(x[:, PREFILL:PREFILL + CHUNKED].contiguous()), cache, chunk_size=32).reshape(B, CHUNKED, -1)]
    for t in range(PREFILL + CHUNKED, S):
        ys.append(layer.decode(x[:, t].contiguous(), cache).reshape(B, 1, -1))
    return torch.cat(ys, dim=1), cache


@pytest.mark.parametrize("name", PARITY)
def test_float32_layer_matches_transformers_past_the_original_window(name):
    """Two sequences at positions 0..200 (YaRN's original window: 64) within 1e-5 of
    transformers in fp32, outputs and cached keys, on the portable kernels and the best path;
    the same weights with the default RoPE are far off (so the scaling is what is checked)."""
    model = rope_model(PARITY[name], seed=1)
    x = draw_input(model, (2, S, 64), seed=1)
    ref = run(model, x)
    layer = q3.DecoderLayer.from_hf(model.model.layers[0])
    assert layer.config.rope_type == PARITY[name]["rope_type"]
    paths = q3.build_info()["cpu_paths"]
    try:
        for path in sorted({"portable", paths[-1]}):
            q3.set_cpu_path(path)
            y, cache = run_layer(layer, x)
            assert rel_err(y, ref.y) <= 1e-5, path
            assert rel_err(y - x, ref.y - x) <= 1e-5, path
            assert rel_err(y[:, PREFILL + CHUNKED:], ref.y[:, PREFILL + CHUNKED:]) <= 1e-5, path  # the decode steps
            for b in range(2):
                assert rel_err(torch.from_dlpack(cache.keys(b)), ref.keys[b]) <= 1e-5, path
    finally:
        q3.set_cpu_path(paths[-1])
    weights = {k: v.detach() for k, v in model.model.layers[0].state_dict().items()}
    plain = q3.DecoderLayer(dataclasses.replace(layer.config, **ROPE_DEFAULTS), weights)
    y, _ = run_layer(plain, x)
    assert rel_err(y - x, ref.y - x) > 1e-3


@pytest.mark.parametrize("name", ["linear x4", "yarn x8 of 64, untruncated, mscale"])
def test_bfloat16_layer_error_at_most_twice_transformers(name):
    """bf16 weights and input, positions 0..200 in the three kinds of call; each implementation
    against a float64 run of transformers on the same (bf16-valued) weights and input. Every
    token takes all 4 experts: over 201 tokens bf16 rounding would flip some top-k choice
    (of ours or of theirs) whatever margin the input was drawn with, and this test is about
    the attention's RoPE."""
    model = rope_model(PARITY[name], seed=2, num_experts=4, num_experts_per_tok=4)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    x = draw_input(model, (1, S, 64), seed=2, dtype=torch.bfloat16)
    hf_bf16 = converted(model, torch.bfloat16)
    layer = q3.DecoderLayer.from_hf(hf_bf16.model.layers[0])
    assert layer.dtype == "bfloat16"
    assert run_layer(layer, x)[0].dtype == torch.bfloat16
    calls = (PREFILL, (CHUNKED, 32)) + (1,) * (S - PREFILL - CHUNKED)  # run_layer's calls
    q3.testing.assert_matches(layer, hf_bf16.model.layers[0], x, torch.bfloat16, calls=calls)


# ---- refused variants and values -----------------------------------------------------------

@pytest.mark.parametrize("rope,match", [
    ({"rope_type": "dynamic", "factor": 2.0}, r"rope_type'\]: expected one of 'default', 'linear', 'yarn', got "
                                             r"'dynamic' \(dynamic NTK recomputes inv_freq"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 1024}, r"got 'llama3'"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
      "original_max_position_embeddings": 1024}, r"got 'longrope'"),
    ({"rope_type": "proportional", "factor": 2.0}, r"got 'proportional' \(the C layer computes"),
    ({"type": "ntk-by-parts", "factor": 2.0}, r"got 'ntk-by-parts'"),
    ({"rope_type": "yarn", "factor": 0.0}, r"rope_factor \(rope_parameters\['factor'\]\): expected a number > 0 for "
                                           r"the yarn RoPE, got 0"),
    ({"rope_type": "yarn", "factor": -2.0}, r"rope_factor .*: expected a number > 0 for the yarn RoPE, got -2"),
    ({"rope_type": "yarn", "factor": float("nan")}, r"rope_factor \(rope_parameters\['factor'\]\): expected a finite "
                                                    r"number, got nan"),
    ({"rope_type": "linear", "factor": float("inf")}, r"rope_factor .*: expected a finite number, got inf"),
    ({"rope_type": "linear", "factor": "2"}, r"config.rope_\w+\['factor'\]: expected a number, got '2'"),
    ({"rope_type": "linear"}, r"config.rope_\w+: the linear RoPE needs 'factor'"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": -1.0}, r"rope_beta_fast .*: expected a number > 0, got -1"),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": -1.0},
     r"config.rope_attention_factor: expected a number > 0 or None, got -1.0"),
    ({"rope_type": "yarn", "factor": 4.0, "mscale": float("nan"), "mscale_all_dim": 1.0},
     r"rope_mscale \(rope_parameters\['mscale'\]\): expected a finite number, got nan"),
    ({"rope_type": "yarn", "factor": 4.0, "truncate": "no"}, r"\['truncate'\]: expected a bool, got 'no'"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64.5},
     r"\['original_max_position_embeddings'\]: expected an int, got 64.5"),
    ({"rope_type": "linear", "type": "yarn", "factor": 4.0}, r"rope_type 'linear' and type 'yarn' disagree"),
    ({"rope_type": "linear", "factor": 4.0, "partial_rotary_factor": 0.5},
     r"\['partial_rotary_factor'\]: expected 1 \(RoPE over all of head_dim\), got 0.5"),
])
def test_refused_rope_in_a_config_json(rope, match):
    """config.json dicts in both spellings: 5.x's rope_parameters, 4.57's rope_scaling."""
    for spelling in ({"rope_parameters": dict(rope, rope_theta=1e6)}, {"rope_scaling": rope, "rope_theta": 1e6}):
        with pytest.raises(ValueError, match=match):
            q3.LayerConfig.from_hf(dict(GEOMETRY, **spelling))


@pytest.mark.parametrize("rope,match", [
    ({"rope_type": "dynamic", "factor": 2.0}, r"got 'dynamic' \(dynamic NTK"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 1024}, r"got 'llama3' \(Llama 3's"),
    ({"rope_type": "yarn", "factor": -1.0}, r"rope_factor .*: expected a number > 0 for the yarn RoPE, got -1"),
])
def test_refused_rope_in_a_transformers_config(rope, match):
    """Qwen3MoeConfig objects of the installed transformers, and the layers of their models."""
    hc = hf_config(rope, head_dim=16)
    with pytest.raises(ValueError, match=match):
        q3.LayerConfig.from_hf(hc)
    model = Qwen3MoeForCausalLM(hc)
    with pytest.raises(ValueError, match=match):
        q3.DecoderLayer.from_hf(model.model.layers[0])


@pytest.mark.parametrize("change,match", [
    (dict(rope_type="dynamic"), r"config.rope_type: expected 'default', 'linear' or 'yarn', got 'dynamic'"),
    (dict(rope_type=None), r"config.rope_type: expected 'default', 'linear' or 'yarn', got None"),
    (dict(rope_factor=4.0), r"rope_factor: the default RoPE does not use it; expected 1, got 4"),
    (dict(rope_type="linear", rope_factor=2.0, rope_beta_fast=16.0),
     r"rope_beta_fast: the linear RoPE does not use it; expected 32, got 16"),
    (dict(rope_type="linear", rope_factor=2.0, rope_original_max_position_embeddings=64),
     r"rope_original_max_position_embeddings: the linear RoPE does not use it; expected 0, got 64"),
    (dict(rope_type="yarn", rope_factor=4.0, rope_attention_factor=0.0),
     r"config.rope_attention_factor: expected a number > 0 or None, got 0.0"),
    (dict(rope_type="yarn", rope_factor=4.0, rope_beta_slow=0.0), r"rope_beta_slow .*: expected a number > 0, got 0"),
    (dict(rope_type="yarn", rope_factor=4.0, rope_original_max_position_embeddings=0),
     r"config.rope_original_max_position_embeddings: expected a positive integer, got 0"),
    (dict(rope_type="yarn", rope_factor=4.0, rope_mscale_all_dim=float("inf")),
     r"rope_mscale_all_dim .*: expected a finite number, got inf"),
    (dict(rope_type="yarn", rope_factor=1e-40), r"rope_factor .*inv_freq\[\d+\] is -?(inf|nan) with factor 1e-40"),
    (dict(rope_theta=float("inf")), r"rope_theta: expected a finite number > 1, got inf"),
])
def test_refused_layer_config(change, match):
    with pytest.raises(ValueError, match=match):
        q3.LayerConfig(**GEOMETRY, **change)


def test_rope_fields_repr_and_defaults():
    cfg = q3.LayerConfig(**GEOMETRY)
    assert "rope_" not in repr(cfg).replace("rope_theta", "")
    yarn = q3.LayerConfig(**GEOMETRY, rope_type="yarn", rope_factor=4.0, rope_original_max_position_embeddings=1024)
    assert repr(yarn).endswith("rope_type='yarn', rope_factor=4.0, rope_original_max_position_embeddings=1024)")
    assert eval(repr(yarn), {"LayerConfig": q3.LayerConfig}) == yarn
